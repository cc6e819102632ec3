"""Stopping a run on SIGINT or SIGTERM: the steps in flight end, a checkpoint is written, one line.

A preemptible cluster stops a task with SIGTERM (then SIGKILL after a grace period), a user with
Ctrl-C. `install()` replaces Python's KeyboardInterrupt (a traceback from wherever the main
thread was, and nothing saved) with a request the training loops read at their next stop point
(the end of a logging interval: the steps scheduled finish), where they write a checkpoint and
raise `Interrupted`; the binary prints one line saying where to resume and exits 128 + the signal
(130 for SIGINT, 143 for SIGTERM), as a shell reports a process killed by it. A second signal
ends the process at once, as TensorFlow's `PreemptionCheckpointHandler` does after its save.

Imports nothing beyond the standard library (the binary's supervisor stays free of TensorFlow).

Example:

  interrupt.install()
  ...
  if interrupt.requested():          # at a stop point of the training loop
    path = save_checkpoint()
    raise interrupt.Interrupted(interrupt.requested(), path, global_step)
"""

import signal
import threading
from typing import Callable, List, Optional

from tf_gba.common import exiting

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_lock = threading.Lock()
_state = {"signum": None}
# Called (in the main thread, from the handler) when the first signal arrives: tell processes that
# do not receive it themselves (the replicated modes' workers) to stop.
_on_request: List[Callable[[], None]] = []
# Called before the process ends at a second signal (removing what the run would have removed).
_on_abort: List[Callable[[], None]] = []


class Interrupted(Exception):
  """A run stopped by a signal after writing `checkpoint` (None: nothing to save yet)."""

  def __init__(self, signum: int, checkpoint: Optional[str], global_step: Optional[int],
               detail: Optional[str] = None):
    self.signum, self.checkpoint, self.global_step = int(signum), checkpoint, global_step
    super().__init__(f"stopped by {name(self.signum)}: {detail}" if detail else
                     message(self.signum, checkpoint, global_step))

  @property
  def exit_code(self) -> int:
    return exit_code(self.signum)


def exit_code(signum: int) -> int:
  """128 + the signal: what a shell reports for a process the signal ended (130, 143)."""
  return 128 + int(signum)


def name(signum: int) -> str:
  return signal.Signals(signum).name


def message(signum: int, checkpoint: Optional[str], global_step: Optional[int]) -> str:
  """The one line the binary prints for a run stopped by `signum`."""
  if checkpoint is None:
    return (f"stopped by {name(signum)} before anything was trained; rerun the same command to "
            "start.")
  return (f"stopped by {name(signum)} at global step {global_step}: checkpoint {checkpoint} "
          "written; rerun the same command to resume from it.")


def _handler(signum, frame):  # pylint: disable=unused-argument
  with _lock:
    first = _state["signum"] is None
    if first:
      _state["signum"] = signum
  if not first:
    for callback in list(_on_abort):
      try:
        callback()
      except Exception:  # pylint: disable=broad-except
        pass  # ending anyway
    exiting.exit_now(exit_code(signum))
  for callback in list(_on_request):
    try:
      callback()
    except Interrupted:
      raise  # a job that cannot stop at a progress point ends where the main thread is
    except Exception:  # pylint: disable=broad-except
      pass  # the loops still read requested()


def install(on_abort: Optional[Callable[[], None]] = None) -> None:
  """Handles SIGINT and SIGTERM in this process (call from the main thread)."""
  if on_abort is not None:
    _on_abort.append(on_abort)
  for signum in SIGNALS:
    signal.signal(signum, _handler)


def installed() -> bool:
  return signal.getsignal(signal.SIGTERM) is _handler


def requested() -> Optional[int]:
  """The signal that asked this process to stop, or None."""
  return _state["signum"]


def on_request(callback: Callable[[], None]) -> None:
  """Calls `callback` when the first signal arrives (now, if one already has)."""
  _on_request.append(callback)
  if _state["signum"] is not None:
    callback()


def remove_on_request(callback: Callable[[], None]) -> None:
  if callback in _on_request:
    _on_request.remove(callback)


def request(signum: int = signal.SIGTERM) -> None:
  """Asks this process to stop as `signum` would (tests, and a stop file read by a worker)."""
  _handler(signum, None)


def reset() -> None:
  """Forgets a request (tests that run several jobs in one process)."""
  _state["signum"] = None
