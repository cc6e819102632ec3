"""closure_cancellation: when the coordinator's manager was cancelled by TF's runtime (no error of
the queue's own), a worker's loss is recovered in place; TF's own cancellations are left alone.

Runs on TF's real closure queue and cancellation manager; the recovery itself, on a real cluster
with a worker killed, is the chaos drill's (tests/e2e/test_chaos_drill.py)."""

import tensorflow as tf
from tensorflow.python.distribute.coordinator import cluster_coordinator as coordinator_lib
from tensorflow.python.eager import cancellation

from tf_gba.distribute import closure_cancellation

_WORKER_LOST = tf.errors.UnavailableError(
    None, None, "recvmsg:Connection reset by peer\nAdditional GRPC error information from remote "
    "target /job:worker/replica:0/task:0 while calling /tensorflow.eager.EagerService/Enqueue")
_PS_LOST = tf.errors.UnavailableError(
    None, None, "Socket closed\nAdditional GRPC error information from remote target /job:ps/"
    "replica:0/task:0 while calling /tensorflow.eager.EagerService/Enqueue")


class _Handler:
  """Stands for TF's WorkerPreemptionHandler: its own check of a failure."""

  def __init__(self, queue):
    self.queue = queue
    self.asked = []

  def _validate_preemption_failure(self, error):
    self.asked.append(error)
    if not coordinator_lib._is_worker_failure(error) or self.queue._cancellation_mgr.is_cancelled:  # pylint: disable=protected-access
      raise error


class _Worker:

  def __init__(self):
    self.ran = []

  def _process_closure(self, closure):
    self.ran.append(closure)


class _Cluster:

  def __init__(self):
    self.closure_queue = coordinator_lib._CoordinatedClosureQueue()  # pylint: disable=protected-access
    self.failure_handler = _Handler(self.closure_queue)
    self.workers = [_Worker()]

  def _record_and_ignore_transient_timeouts(self, error):
    return isinstance(error, tf.errors.DeadlineExceededError)


class _Coordinator:

  def __init__(self):
    self._cluster = _Cluster()


def test_a_worker_lost_under_a_manager_the_runtime_cancelled_is_recovered_in_place():
  coordinator = _Coordinator()
  cluster, queue = coordinator._cluster, coordinator._cluster.closure_queue
  assert closure_cancellation.install(coordinator)
  old = queue._cancellation_mgr
  # Without a cancellation, TF's own check decides.
  cluster.failure_handler._validate_preemption_failure(_WORKER_LOST)
  assert len(cluster.failure_handler.asked) == 1
  # The runtime cancelled the shared manager; the queue has no error and still runs.
  old.start_cancel()
  cluster.failure_handler._validate_preemption_failure(_WORKER_LOST)
  assert len(cluster.failure_handler.asked) == 1  # a worker loss, not re-raised
  assert queue._cancellation_mgr is not old and not queue._cancellation_mgr.is_cancelled
  queue.stop()


def test_a_function_cancelled_by_the_runtime_is_transient_and_a_ps_loss_is_not_a_worker_s():
  coordinator = _Coordinator()
  cluster, queue = coordinator._cluster, coordinator._cluster.closure_queue
  closure_cancellation.install(coordinator)
  cancelled = tf.errors.CancelledError(None, None, "RemoteExecuteNode::RunAsync")
  # Not cancelled: TF's own judgement (a cancellation is not a timeout).
  assert not cluster._record_and_ignore_transient_timeouts(cancelled)
  queue._cancellation_mgr.start_cancel()
  assert not closure_cancellation.is_worker_loss(queue, _PS_LOST)
  try:
    cluster.failure_handler._validate_preemption_failure(_PS_LOST)
    raise AssertionError("a parameter server's loss was taken for a worker's")
  except tf.errors.UnavailableError:
    pass
  assert cluster._record_and_ignore_transient_timeouts(cancelled)  # put back, manager renewed
  assert not queue._cancellation_mgr.is_cancelled
  queue.stop()


def test_the_queue_s_own_cancellation_is_left_to_tensorflow():
  coordinator = _Coordinator()
  queue = coordinator._cluster.closure_queue
  closure_cancellation.install(coordinator)
  # An error raised to the user: the queue holds it while it cancels.
  queue._error = ValueError("the user's step failed")
  queue._cancellation_mgr.start_cancel()
  assert not closure_cancellation.is_worker_loss(queue, _WORKER_LOST)
  queue._error = None
  # The queue stopping (the coordinator shut down).
  queue.stop()
  assert not closure_cancellation.is_worker_loss(queue, _WORKER_LOST)


def test_each_function_is_bound_to_the_manager_current_when_it_starts():
  coordinator = _Coordinator()
  queue, worker = coordinator._cluster.closure_queue, coordinator._cluster.workers[0]
  closure_cancellation.install(coordinator)
  concrete = tf.function(lambda: tf.constant(1)).get_concrete_function()
  closure = coordinator_lib.Closure(concrete, queue._cancellation_mgr)
  queue._cancellation_mgr.start_cancel()
  queue._cancellation_mgr = cancellation.CancellationManager()
  worker._process_closure(closure)
  assert worker.ran == [closure]
  # Bound to the new manager: it runs (the old, cancelled one would cancel it).
  assert int(closure._function()) == 1
  queue.stop()
