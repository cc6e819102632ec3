"""A periodic checkpoint save that waits too long for a server ends the job for a restart.

A save talks to every server: it reads the variables on the parameter servers, and TF registers
its save function with every server of the cluster at every save (`MultiDeviceSaver.save`), so
a stalled link, a worker's or a server's, or a partitioned coordinator holds it. The stall
watchdog (`shared_input.SharedInput.watch`) watches only scheduled steps, and none is scheduled
while the coordinator saves: measured by the chaos drill (gba, seed 2, 52,000 steps), a 25 s
partition of the coordinator that began during a save held the job in silence past the 20 s
limit, and a partition that does not heal would have held it until TCP gave up. Past the limit
the job now ends in one line with exit 75: the binary's supervisor (or the user's rerun)
resumes from the last checkpoint; the unfinished one is never listed (`PeriodicCheckpoint`).

The limit: --stall_timeout_s, and at least SLOWER_THAN_LONGEST times the run's longest save so
far (kept over resumptions, `recovery.record_save_seconds`), so that a large model's slow saves
are not taken for stalls; before the run's first save, at least DEFAULT_STALL_TIMEOUT_S (the
first save also traces its function).
"""

import contextlib
import threading
import time
from typing import Callable, Iterator, Optional

from tf_gba.common import exiting
from tf_gba.training import recovery
from tf_gba.training.shared_input import DEFAULT_STALL_TIMEOUT_S

# A save this many times longer than the run's longest one is held by a link, not by its size.
SLOWER_THAN_LONGEST = 4.0


def save_limit(stall_timeout_s: float, longest_save_s: Optional[float]) -> float:
  """Seconds a periodic save may take before it is a stall."""
  if longest_save_s is None:
    return max(stall_timeout_s, DEFAULT_STALL_TIMEOUT_S)
  return max(stall_timeout_s, SLOWER_THAN_LONGEST * longest_save_s)


def stalled_message(limit_s: float) -> str:
  return (f"a checkpoint save has waited {limit_s:.0f} s for a server that does not answer "
          "(a stalled link or a partitioned coordinator; the limit is --stall_timeout_s, and at "
          f"least {SLOWER_THAN_LONGEST:.0f}x the run's longest save). Rerun the same command to "
          "resume from the last checkpoint in model_dir; if this model's saves take that long, "
          "raise --stall_timeout_s.")


@contextlib.contextmanager
def watched(model_dir: str, stall_timeout_s: float,
            exit_now: Callable[[int], None] = exiting.exit_now) -> Iterator[None]:
  """Runs a periodic save; past `save_limit` it prints one line, records the failure (cause
  `Stalled`) and ends the process with EXIT_RESTART. A save that ends records its duration."""
  limit_s = save_limit(stall_timeout_s, recovery.longest_save_seconds(model_dir))
  done = threading.Event()

  def expire():
    if done.wait(limit_s):
      return
    recovery.end_for_restart(model_dir, recovery.Stalled(stalled_message(limit_s)), exit_now)

  began = time.time()
  threading.Thread(target=expire, daemon=True, name="save_watchdog").start()
  try:
    yield
  finally:
    done.set()
  recovery.record_save_seconds(model_dir, time.time() - began)
