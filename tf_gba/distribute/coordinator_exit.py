"""Stopping a ClusterCoordinator's threads when the interpreter exits, before it finalizes.

ClusterCoordinator runs a daemon thread per worker and one that handles worker failures, and
stops them only from its `__del__`. A strategy keeps its coordinator for its whole life, so that
`__del__` runs during interpreter finalization: cancelling the closure queue then runs TensorFlow
C++ (cancellation callbacks, remote handles) while Python tears down its modules and ends every
daemon thread that asks for the interpreter again. A user's script that ended in an exception
with functions still in flight (a `model.fit` refused while its datasets were still being built)
was seen to abort there (`terminate called ...`, exit status -6) instead of exiting with 1.

Here the coordinator's threads are stopped from an `atexit` handler instead, while the
interpreter and the servers are still whole: each finishes the function it runs and leaves its
loop, and they are waited for (a few seconds at most; a thread still in a call then is left as
before). The binary ends with `os._exit` and never gets here; `__del__` stopping again later
finds the threads gone.
"""

import atexit
import threading
import time
import weakref

_JOIN_S = 5.0

_coordinators = weakref.WeakSet()
_registered = False
_lock = threading.Lock()


def stop_at_exit(coordinator) -> None:
  """Stops `coordinator`'s threads when the interpreter exits (once per process registered)."""
  global _registered
  with _lock:
    _coordinators.add(coordinator)
    if not _registered:
      # Registered after LocalCluster's own handler, so it runs before it: servers still up.
      atexit.register(stop_all)
      _registered = True


def stop_all(join_s: float = _JOIN_S) -> int:
  """Lets every registered coordinator's threads finish the function each runs and leave, waits
  up to `join_s` for them, then stops the failure handler; returns how many threads still run."""
  with _lock:
    coordinators = list(_coordinators)
  clusters = []
  for coordinator in coordinators:
    try:
      cluster = coordinator._cluster  # pylint: disable=protected-access
      queue = cluster.closure_queue
      # What ClusterCoordinator's own stop does, less cancelling the functions in flight:
      # cancelled here, each logs an error of TensorFlow's ("Remote function ... failed with
      # CancelledError") and its executor one more at finalization. Waiting costs what they have
      # left.
      with queue._queue_lock:  # pylint: disable=protected-access
        queue._should_process_closures = False  # pylint: disable=protected-access
        queue._closures_queued_condition.notify_all()  # pylint: disable=protected-access
      for worker in cluster.workers:
        worker.stop()
    except AttributeError:
      continue  # a coordinator without these internals: left to its own `__del__`, as before
    clusters.append(cluster)
  deadline = time.monotonic() + join_s
  still = _join([t for c in clusters for t in _worker_threads(c)], deadline)
  handlers = [c.failure_handler for c in clusters]
  for handler in handlers:
    handler.stop()
  return still + _join([getattr(h, "_preemption_handler_thread", None) for h in handlers],
                       deadline)


def _worker_threads(cluster) -> list:
  # The threads running these workers' loops (ClusterCoordinator keeps no list of them): only
  # they are waited for, not another coordinator's of the same names, which nothing stopped.
  workers = set(map(id, cluster.workers))
  return [t for t in threading.enumerate()
          if id(getattr(getattr(t, "_target", None), "__self__", None)) in workers]


def _join(threads, deadline: float) -> int:
  threads = [t for t in threads if t is not None and t is not threading.current_thread()]
  for thread in threads:
    thread.join(max(0.0, deadline - time.monotonic()))
  return sum(t.is_alive() for t in threads)
