"""A killed worker recovered in place, where TensorFlow's runtime cancels the coordinator itself.

ClusterCoordinator runs every scheduled function through one cancellation manager, its closure
queue's. It recovers a worker that died (runs its function again on another worker, and takes
the worker back once it is restarted) only while that manager is not cancelled: a cancelled one
means that the coordinator is cancelling everything after an error of its own
(`_validate_preemption_failure` re-raises the worker's failure then, and every other function
fails with it).

When a worker is killed during a function, the runtime itself sometimes cancels that shared
manager: measured by the chaos drill with TF's Python `CancellationManager.start_cancel` and
`_validate_preemption_failure` logged, in the runs where the killed worker was not recovered in
place (3 of 6 short drills that day), the killed worker's `UnavailableError` met a manager
already cancelled although nothing in Python had cancelled it, no error was pending on the
queue, and the other worker's function had just failed `CANCELLED`. The worker's loss then
reached `coordinator.schedule` and the job restarted from its last checkpoint (`RuntimeFault`,
about 15 s and up to a checkpoint interval of steps) instead of recovering in place (under 1 s).

`install` makes that case a worker loss again: where the manager is cancelled while no error is
pending on the queue and the queue still runs, it is renewed; a worker's failure (as TF judges
it) is then handled as a worker preemption (its function goes back on the queue, and the worker
is taken back once the cluster is updated), and another worker's function cancelled with it as
a transient failure (put back, as TF takes the cancellations that name a server). Each
function is bound to the queue's current manager as it starts, so that one queued before the
renewal is not cancelled by the old manager. TF's own cancellation (an error raised to the user,
the queue stopping) is left as it is: it sets the queue's error, or stops it, first.
"""

from absl import logging
import tensorflow as tf
from tensorflow.python.distribute.coordinator import cluster_coordinator as coordinator_lib
from tensorflow.python.eager import cancellation

def _cancelled_by_the_runtime(queue) -> bool:
  """The queue's manager is cancelled, while the queue has no error of its own and still runs."""
  return (queue._cancellation_mgr.is_cancelled  # pylint: disable=protected-access
          and queue._error is None  # pylint: disable=protected-access
          and queue._should_process_closures)  # pylint: disable=protected-access


def _renew(queue) -> None:
  with queue._queue_lock:  # pylint: disable=protected-access
    if _cancelled_by_the_runtime(queue):
      queue._cancellation_mgr = cancellation.CancellationManager()  # pylint: disable=protected-access
      logging.info("tf_gba: the coordinator's cancellation manager was cancelled by "
                   "TensorFlow's runtime after a worker failure; renewed, the worker is "
                   "recovered in place")


def is_worker_loss(queue, error: Exception) -> bool:
  """Whether `error`, met while `queue`'s manager was cancelled by the runtime, is a worker's
  loss that ClusterCoordinator can recover from (renewing the manager first)."""
  return (_cancelled_by_the_runtime(queue) and not isinstance(error, tf.errors.CancelledError)
          and coordinator_lib._is_worker_failure(error))  # pylint: disable=protected-access


def is_derived_cancellation(queue, error: Exception) -> bool:
  """Whether `error` is a function cancelled by the runtime's own cancellation of `queue`'s
  manager: transient (the function goes back on the queue, its worker is not lost), as TF takes
  the cancellations that name a server."""
  return _cancelled_by_the_runtime(queue) and isinstance(error, tf.errors.CancelledError)


def install(coordinator) -> bool:
  """Installs the recovery on `coordinator` (a ClusterCoordinator); False where its internals
  are not the ones this was measured on (nothing installed)."""
  cluster = getattr(coordinator, "_cluster", None)
  handler = getattr(cluster, "failure_handler", None)
  queue = getattr(cluster, "closure_queue", None)
  validate = getattr(handler, "_validate_preemption_failure", None)
  transient = getattr(cluster, "_record_and_ignore_transient_timeouts", None)
  if validate is None or transient is None or not all(hasattr(queue, name) for name in (
      "_cancellation_mgr", "_error", "_should_process_closures", "_queue_lock")):
    return False

  # TF's wait_on_failure asks these in turn: whether the failure is transient (the function is
  # put back), then whether it is a worker's preemption (the worker is taken back) or else
  # re-raised (every function cancelled).
  def record_and_ignore_transient_timeouts(error):
    if is_derived_cancellation(queue, error):
      _renew(queue)
      return True
    return transient(error)

  def validate_preemption_failure(error):
    if is_worker_loss(queue, error):
      _renew(queue)
      return None
    return validate(error)

  cluster._record_and_ignore_transient_timeouts = record_and_ignore_transient_timeouts  # pylint: disable=protected-access
  handler._validate_preemption_failure = validate_preemption_failure  # pylint: disable=protected-access
  for worker in cluster.workers:
    _bind_at_start(worker, queue)
  return True


def _bind_at_start(worker, queue) -> None:
  run = worker._process_closure  # pylint: disable=protected-access

  def process_closure(closure):
    concrete = getattr(closure, "_concrete_function", None)
    if concrete is not None:
      closure._function = queue._cancellation_mgr.get_cancelable_function(concrete)  # pylint: disable=protected-access
    return run(closure)

  worker._process_closure = process_closure  # pylint: disable=protected-access
