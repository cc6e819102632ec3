"""How long each worker's scheduled functions took, as the coordinator saw them.

A function's time runs from the moment the coordinator's thread for that worker takes it to the
moment its result is back: the worker's steps, and every wait they met (a parameter server, the
data list, the worker's own link). Only the coordinator sees a stalled link this way: a worker
whose link is cut finishes the steps it has and sits idle, and its own clock cannot tell that
from a worker with nothing to do. At a progress line, the longest function of each worker since
the last line says whether one worker held the interval up (only its function was long) or every
worker was held up (all of theirs were). Two clock reads per function, on the coordinator.
"""

import threading
import time
from typing import List


class FunctionTimes:
  """Wraps each of a ClusterCoordinator's worker threads' `_process_closure` to time it."""

  def __init__(self, coordinator):
    workers = coordinator._cluster.workers  # pylint: disable=protected-access
    self._lock = threading.Lock()
    self._longest = [0.0] * len(workers)
    # Functions still running, by worker: their start, so that a read during a long one counts it.
    self._running = [None] * len(workers)
    for worker in workers:
      self._wrap(worker)

  def _wrap(self, worker) -> None:
    index = worker.worker_index
    run = worker._process_closure  # pylint: disable=protected-access

    def timed(closure):
      start = time.monotonic()
      self._running[index] = start
      try:
        return run(closure)
      finally:
        seconds = time.monotonic() - start
        with self._lock:
          self._running[index] = None
          self._longest[index] = max(self._longest[index], seconds)

    worker._process_closure = timed  # pylint: disable=protected-access

  def longest_since_last_read(self) -> List[float]:
    """Per worker, the longest function (seconds) since the last call, one still running
    included; then starts over."""
    now = time.monotonic()
    with self._lock:
      out = [max(longest, running)
             for longest, running in zip(self._longest, self._running_at(now))]
      self._longest = [0.0] * len(out)
    return out

  def running_seconds(self) -> List[float]:
    """Per worker, how long its function running now has run (0.0 where none runs)."""
    now = time.monotonic()
    with self._lock:
      return self._running_at(now)

  def _running_at(self, now: float) -> List[float]:
    # Under self._lock.
    return [0.0 if start is None else now - start for start in self._running]
