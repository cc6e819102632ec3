"""`fit` epochs that do not stop the workers, for the parameter-server modes.

ParameterServerStrategy takes no batch-level callbacks, so the runner's progress lines, the shared
data list's end-of-day check and `--mode=auto`'s watch run where a `fit` epoch ends, and there
Keras joins the `ClusterCoordinator`: every worker waits for the slowest step still running
before the next epoch's steps are scheduled. With a 4x straggler at 8 workers that wait is 3-6 % of
a run, and it grows with the number of workers (docs/evaluation.md, "Speed at 8 workers").

Inside `Pipeline(model, coordinator)`:

* the join at an epoch's end returns as soon as the workers have taken all but `spare` of the
  steps scheduled, so each worker still has a step to take while the callbacks run and the next
  epoch is scheduled; a step's error still raises there at once;
* the train function's result that Keras fetches at the epoch's end (it reads the loss from the
  model's metrics, but fetches the last result first) is the newest step that has finished, not
  the newest scheduled, which would be a wait for it;
* whatever needs every scheduled step done (a checkpoint, the model after `fit`) calls `settle()`,
  the coordinator's own join.

Counts read at an epoch's end (worker steps, the list's batches, the global step) are therefore
those of the steps finished by then, with up to `spare` + one per worker still running.
"""

import collections
import threading
from typing import Optional

import tensorflow as tf

RemoteValue = tf.distribute.experimental.coordinator.RemoteValue


def finished(remote_value) -> bool:
  """Whether a scheduled step's result is there (a value or an error), without waiting."""
  # RemoteValue has no public "is it done" query; its status is what fetch() waits on.
  status = getattr(remote_value, "_status", None)
  return status is not None and getattr(status, "name", str(status)) == "READY"


class _NewestFinished(RemoteValue):
  """A step's result as Keras keeps it for the epoch's end: fetched then, it is the newest step
  finished by then (the step itself if none has)."""

  def __init__(self, pipeline: "Pipeline", value: RemoteValue):  # pylint: disable=super-init-not-called
    self._pipeline = pipeline
    self._value = value

  def _resolved(self) -> RemoteValue:
    return self._pipeline.newest_finished() or self._value

  def fetch(self):
    return self._resolved().fetch()

  def get(self):
    return self._resolved().get()


class Pipeline:
  """Epoch ends that let the workers run on, for the duration of a `with` around `model.fit`.

  Args:
    model: the Keras model `fit` trains; its train function is wrapped while inside.
    coordinator: the strategy's `ClusterCoordinator` (one per strategy: `fit` uses the same).
    spare: steps left queued when an epoch's join returns: one per worker keeps every worker
      busy through callbacks shorter than a step.
  """

  def __init__(self, model, coordinator, spare: int):
    self.model = model
    self.coordinator = coordinator
    self.spare = int(spare)
    self._join = None
    self._make_train_function = None
    self._lock = threading.Lock()
    # The newest steps scheduled, newest last; enough to hold every step that can be running
    # or queued when an epoch ends.
    self._recent = collections.deque(maxlen=4 * (self.spare + 1) + 64)

  # ---- joins -------------------------------------------------------------------------------------
  def settle(self) -> None:
    """Waits until every step scheduled so far has finished (raises a step's error)."""
    (self._join or self.coordinator.join)()

  def _join_leaving_spare(self) -> None:
    queue = self.coordinator._cluster.closure_queue  # pylint: disable=protected-access
    while True:
      with queue._queue_lock:  # pylint: disable=protected-access
        if queue._error is not None:  # pylint: disable=protected-access
          break
        if queue._queue.qsize() <= self.spare:  # pylint: disable=protected-access
          return
        # Notified whenever a worker takes a step; the timeout covers a notification that
        # went to another waiter (a `schedule` waiting for room in a full queue).
        queue._queue_free_slot_condition.wait(timeout=0.05)  # pylint: disable=protected-access
    self.settle()  # raises the step's error, as Keras's join would have

  # ---- results -----------------------------------------------------------------------------------
  def track(self, value: RemoteValue) -> RemoteValue:
    with self._lock:
      self._recent.append(value)
    return _NewestFinished(self, value)

  def newest_finished(self) -> Optional[RemoteValue]:
    with self._lock:
      recent = list(self._recent)
    return next((v for v in reversed(recent) if finished(v)), None)

  # ---- the `with` --------------------------------------------------------------------------------
  def __enter__(self) -> "Pipeline":
    model, pipeline = self.model, self
    # Keras calls model.make_train_function() at the start of fit; whatever it builds (its own
    # scheduling function, or the shared list's) is wrapped to hand back `_NewestFinished`.
    self._make_train_function = model.__dict__.get("make_train_function")
    make = model.make_train_function

    def make_train_function(force=False):
      scheduled = make(force=force)
      if getattr(scheduled, "_tf_gba_pipeline", None) is pipeline:
        return scheduled

      def train_function(iterator):
        return pipeline.track(scheduled(iterator))

      train_function._tf_gba_pipeline = pipeline  # pylint: disable=protected-access
      model.train_function = train_function
      return train_function

    model.make_train_function = make_train_function
    model.train_function = None
    # An attribute of this coordinator only (the strategy's own wrapper stays inside).
    self._join = self.coordinator.join
    self.coordinator.join = self._join_leaving_spare
    return self

  def __exit__(self, *exc) -> None:
    self.coordinator.join = self._join
    self._join = None
    if self._make_train_function is None:
      self.model.__dict__.pop("make_train_function", None)
    else:
      self.model.make_train_function = self._make_train_function
    self.model.train_function = None
