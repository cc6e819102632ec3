"""A non-blocking all-reduce with injected network latency.

`AsyncAllReduce.start(values)` returns at once; a background thread runs the strategy's all-reduce
(`ReplicaContext.all_reduce`, MEAN by default) and the caller picks the result up later with
`handle.result()`. This is what lets DTS start the exchange of step n at step n and consume it
several local steps later, instead of blocking on it like synchronous training.

Ordering: one thread runs the exchanges first-in first-out, so every worker issues its collectives
in the order it called `start`. Callers must call `start` in the same order on every worker (DTS
does: the schedule depends only on the step number), and nothing else may issue collectives while
exchanges are in flight.

Latency model (`latency_ms`): a propagation delay, not a bandwidth limit. An exchange started at
time T is delivered no earlier than T + latency; several exchanges can be in flight at once, like
packets on a long link. The exchange thread sleeps until T + latency and then runs the collective,
so the sleep is in the exchange path: the training loop only waits if it asks for a result before
it is delivered. Synchronous training (asking at once) therefore pays the full latency every step;
delayed updates hide it behind local steps.

Example:

  exchange = AsyncAllReduce(strategy, latency_ms=50)
  handle = exchange.start(per_replica_tensors)   # returns immediately
  ...                                            # local steps
  mean = handle.result()                         # same structure, reduced over all replicas
  exchange.close()
"""

import queue
import threading
import time
from typing import Any, Optional

import tensorflow as tf


class ExchangeHandle:
  """The pending result of one `AsyncAllReduce.start` call."""

  def __init__(self, index: int, started_at: float, owner: "AsyncAllReduce"):
    self.index = index
    self.started_at = started_at
    self._owner = owner
    self._done = threading.Event()
    self._value = None
    self._error: Optional[BaseException] = None

  def done(self) -> bool:
    return self._done.is_set()

  def result(self, timeout: Optional[float] = None) -> Any:
    """Waits for the reduced values (at most `timeout` seconds) and returns them.

    Raises:
      TimeoutError: the exchange did not finish in time (e.g. a peer worker died).
      Exception: whatever the collective raised, re-raised here.
    """
    if not self._done.is_set():
      begin = time.perf_counter()
      finished = self._done.wait(timeout)
      self._owner._add_blocked(time.perf_counter() - begin)  # pylint: disable=protected-access
      if not finished:
        raise TimeoutError(f"all-reduce #{self.index} did not finish within {timeout} s")
    if self._error is not None:
      raise self._error
    return self._value

  def _finish(self, value=None, error: Optional[BaseException] = None):
    self._value, self._error = value, error
    self._done.set()


_STOP = object()


class AsyncAllReduce:
  """Runs all-reduces of `strategy` on a background thread, with an optional injected latency.

  Args:
    strategy: the `tf.distribute.Strategy` whose replicas reduce (MirroredStrategy,
      MultiWorkerMirroredStrategy, or the default strategy, where the mean is the value itself).
    latency_ms: propagation delay added to every exchange (see the module docstring).
    reduce_op: `tf.distribute.ReduceOp` or its name.
  """

  def __init__(self, strategy: tf.distribute.Strategy, latency_ms: float = 0.0,
               reduce_op=tf.distribute.ReduceOp.MEAN):
    if latency_ms < 0:
      raise ValueError(f"latency_ms must be >= 0, got {latency_ms}")
    self._strategy = strategy
    self.latency_s = float(latency_ms) / 1000.0
    self._reduce_op = reduce_op
    self._queue: "queue.Queue" = queue.Queue()
    self._lock = threading.Lock()
    self._started = 0
    self._blocked_s = 0.0
    self._closed = False
    self._thread = threading.Thread(target=self._run, name="tf_gba-async-allreduce", daemon=True)
    self._thread.start()

    @tf.function
    def all_reduce(values):
      def reduce_in_replica(v):
        # With one local replica the strategy passes plain tensors, placed nowhere in particular;
        # the all-reduce needs a device, which an op created here (in the replica's scope) has.
        v = tf.nest.map_structure(tf.identity, v)
        return tf.distribute.get_replica_context().all_reduce(self._reduce_op, v)
      return strategy.run(reduce_in_replica, args=(values,))

    self._all_reduce = all_reduce

  @property
  def num_started(self) -> int:
    return self._started

  @property
  def blocked_seconds(self) -> float:
    """Total time callers spent waiting in `ExchangeHandle.result` (exposed communication)."""
    with self._lock:
      return self._blocked_s

  def _add_blocked(self, seconds: float):
    with self._lock:
      self._blocked_s += seconds

  def start(self, values) -> ExchangeHandle:
    """Starts reducing `values` (a nest of per-replica tensors) and returns at once."""
    if self._closed:
      raise RuntimeError("AsyncAllReduce is closed")
    # Trace (or look the trace up) here, on the training thread, which entered the strategy's
    # scopes; the exchange thread then only runs it, so tracing never delays an exchange. The
    # same structure reuses one trace.
    concrete = self._all_reduce.get_concrete_function(values)
    handle = ExchangeHandle(self._started, time.perf_counter(), self)
    self._started += 1
    self._queue.put((handle, concrete, values))
    return handle

  def _run(self):
    while True:
      item = self._queue.get()
      if item is _STOP:
        return
      handle, concrete, values = item
      wait = handle.started_at + self.latency_s - time.perf_counter()
      if wait > 0:
        time.sleep(wait)
      try:
        handle._finish(value=concrete(values))
      except Exception as e:  # pylint: disable=broad-except
        # Re-raised on the training thread by handle.result(); failing here would hang it.
        handle._finish(error=e)

  def close(self, timeout: float = 60.0):
    """Finishes the queued exchanges and stops the thread (idempotent)."""
    if self._closed:
      return
    self._closed = True
    self._queue.put(_STOP)
    self._thread.join(timeout)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
