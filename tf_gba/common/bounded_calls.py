"""Calls the caller waits for only so long: a read of a server that may not answer.

A remote read of a worker whose link is cut does not fail: its packets are dropped, TCP sends
them again later and later, and the call returns when the link is back, seconds or minutes on.
A progress line of the parameter-server modes reads every worker's counters; waiting there for a
stalled worker would stop the coordinator from scheduling the other workers' steps. Each call
here runs on a thread of its own and the caller waits for it up to a deadline; a call that has
not returned by then is left running (a remote call cannot be taken back) and its key answers
"no answer" at once until it has returned, so a silent server holds at most one call.

Imports nothing beyond the standard library.

Example:

  calls = BoundedCalls(deadline_s=3.0)
  answers = calls.call_many({0: read_worker_0, 1: read_worker_1})
  answered, value = answers[0]
"""

import threading
import time
from typing import Any, Callable, Dict, Hashable, Optional, Tuple


class _Call:
  """One call on a daemon thread: its value or its error once `done` is set."""

  def __init__(self, fn: Callable[[], Any]):
    self.done = threading.Event()
    self.value = None
    self.error = None
    self._fn = fn
    threading.Thread(target=self._run, daemon=True, name="bounded_call").start()

  def _run(self) -> None:
    try:
      self.value = self._fn()
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e  # raised by the caller that waits for it; dropped if nobody did
    finally:
      self.done.set()


class BoundedCalls:
  """Runs calls that the caller waits for up to `deadline_s` seconds, at most one per key."""

  def __init__(self, deadline_s: float):
    if deadline_s <= 0:
      raise ValueError(f"deadline_s must be positive, got {deadline_s}")
    self.deadline_s = float(deadline_s)
    self._lock = threading.Lock()
    self._calls: Dict[Hashable, _Call] = {}

  def in_flight(self, key: Hashable) -> bool:
    """Whether a call of `key` that was not waited for to its end is still running."""
    with self._lock:
      call = self._calls.get(key)
    return call is not None and not call.done.is_set()

  def call_many(self, fns: Dict[Hashable, Callable[[], Any]],
                deadline_s: Optional[float] = None) -> Dict[Hashable, Tuple[bool, Any]]:
    """Starts each call (all at once) and waits for them, together, up to the deadline
    (`deadline_s`, or the one given at construction).

    Returns, per key, `(True, value)` for a call that returned in time, `(False, None)` for one
    that did not, or whose key's last call is still running (not started again). A call that
    raised in time raises here.
    """
    started = {}
    with self._lock:
      for key, fn in fns.items():
        running = self._calls.get(key)
        if running is not None and not running.done.is_set():
          started[key] = None
          continue
        started[key] = self._calls[key] = _Call(fn)
    end = time.monotonic() + (self.deadline_s if deadline_s is None else deadline_s)
    out = {}
    for key, call in started.items():
      if call is None or not call.done.wait(max(0.0, end - time.monotonic())):
        out[key] = (False, None)
        continue
      if call.error is not None:
        raise call.error
      out[key] = (True, call.value)
    return out

  def call(self, key: Hashable, fn: Callable[[], Any]) -> Tuple[bool, Any]:
    """`call_many` of one call."""
    return self.call_many({key: fn})[key]
