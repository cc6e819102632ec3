"""Training on the shared data list (`--input=shared`): the step, the end of the day, the counts.

`SharedInput` plugs `tf_gba.data.data_list` into a Keras `model.fit` on a parameter-server
strategy:

* its `dataset_fn` reads `(features, label, batch_id)` from the list's tf.data service job;
* its train function (installed on the model) reads with `get_next_as_optional()`: a batch is
  trained on and counted (`DayCounters`); an empty read (the list is exhausted) ends the
  function's steps and marks the worker exhausted without running the strategy's step, so it
  neither takes a GBA token nor pushes a gradient nor moves the optimizer;
* its callback stops `fit` at the end of a logging interval once every worker has seen the end,
  so the batches each worker's service client had fetched are all trained on (or once the
  workers that have not are all blocked at a Hop-BS or Hop-BW barrier that only the others
  could open);
* `flush_partial_step()`: when the day ends with fewer than M gradients in the GBA buffers, it
  completes that global step with zero gradients, which applies what is buffered divided by M
  (SPEC: "divide by M", the global batch never grows) and leaves the token count on a multiple
  of M, aligned with the global step for the next run;
* a watchdog ends a day whose steps make no progress for `stall_timeout_s` (a tf.data worker
  died: its clients wait for it forever), so the job reports the lost batches instead of hanging.
"""

import math
import threading
import time
import uuid
from typing import Optional

import numpy as np
import tensorflow as tf
import tf_keras as keras

from tf_gba.data import data_list as data_list_lib
from tf_gba.training import pipelining
from tf_gba.training import rerun_ledger
from tf_gba.training import riding_metrics

# Above what the longest step (a straggler at 4x on a loaded machine, a Hop-BS barrier timeout)
# takes, well below what a user would wait before killing a hung job.
DEFAULT_STALL_TIMEOUT_S = 120.0

# Batches one worker can hold taken from the list but not yet trained: the one its service client
# keeps in flight (`DataList.dataset`), and what the tf.data worker serving it has read ahead. A
# run of a fixed step count lists this many per worker beyond its steps: otherwise its last steps
# find the list empty while held batches go untrained (8 workers, 160 steps over a 167-batch
# list: 155 to 160 trained, measured); 1.5 per worker was the most seen.
HELD_AHEAD_PER_WORKER = 4


def stall_limit(timeout: float, trained: bool) -> float:
  """Seconds without a finished step that make a stall. Before the run's first step finished, at
  least DEFAULT_STALL_TIMEOUT_S: the first step registers the functions and opens the data
  service's readers on every worker, which took over 15 s on a loaded 2-core machine (the chaos
  drill's `--stall_timeout_s=15` restarted a job that had not hung)."""
  return timeout if trained else max(timeout, DEFAULT_STALL_TIMEOUT_S)


class DataServiceStalled(RuntimeError):
  """No training step finished for too long: the shared data list stopped delivering."""


class SharedInput:
  """The shared data list of one run (one day or a fixed number of steps).

  Args:
    config: the run's TrainConfig.
    strategy: its GBAStrategy.
    dispatcher: host:port of the tf.data service dispatcher.
    data_kwargs: options of the data source.
    rows: the day's rows as `(features, labels)` instead of reading `config.data`.
  """

  def __init__(self, config, strategy, dispatcher: str, data_kwargs: dict, rows=None):
    self.config = config
    self.strategy = strategy
    self.dispatcher = dispatcher
    if rows is None:
      rows = data_list_lib.load_rows(config.data, config.day, strict=config.strict_data,
                                     **data_kwargs)
    features, labels = rows
    nb = math.ceil(len(labels) / config.local_batch_size)
    # A run of a fixed number of steps lists the day as often as those steps need, and what the
    # workers hold ahead at its end.
    self.day_mode = config.steps is None
    passes = 1 if self.day_mode else max(1, math.ceil(self.entries_for(config.steps) / nb))
    self.list = data_list_lib.DataList(features, labels, config.local_batch_size,
                                       seed=config.seed, passes=passes)
    # One job per run and day: readers of one job share one queue.
    self.job_name = f"tf_gba_{config.day}_{uuid.uuid4().hex[:12]}"
    self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
      self.counters = data_list_lib.DayCounters(self.list.num_batches)
      # A function run again after its worker failed skips the steps it had trained.
      self.ledger = rerun_ledger.RerunLedger()
    # Times each batch was trained before this run started (restored with the checkpoint of a
    # resumed run, see `resume`); the counters above count this run's trainings only.
    self.restored_seen = np.zeros([self.list.num_batches], np.int64)
    self.batches_reread: Optional[int] = None
    self.stalled: Optional[str] = None
    self.flushed_gradients = 0
    self._last_progress = time.time()
    self._pending = []
    self._lock = threading.Lock()

  def entries_for(self, steps: int) -> int:
    """List entries a run of `steps` fixed steps needs so that each of its steps trains a batch."""
    return steps + HELD_AHEAD_PER_WORKER * self.strategy.num_workers

  @property
  def num_batches(self) -> int:
    return self.list.num_batches

  @property
  def total_steps(self) -> int:
    """Steps the run expects to train: the fixed count, or one per batch of the day left."""
    return len(self.list.batch_order) if self.day_mode else self.config.steps

  @property
  def max_steps(self) -> int:
    """Steps fit may schedule: the fixed count; in day mode no bound of its own, since the
    callback stops fit once every worker has seen the end of the list (after the slowest one has
    trained the batches its client already holds) and the watchdog stops a stalled day."""
    return self.config.steps if not self.day_mode else 2**40

  def seen_total(self) -> Optional[np.ndarray]:
    """Times each batch of the day was trained, by this run and the runs it resumes.

    Read where every scheduled step has finished (a checkpoint, after fit), it matches the
    model: what a checkpoint written there stores as the data position; at a progress line, what
    the steps finished by then trained. None while a worker is being restarted (its counters
    cannot be read then).
    """
    each = self.counters.read_counts(self.counters.seen)
    if any(v is None for v in each):
      return None
    return self.restored_seen + np.stack(each).astype(np.int64).sum(0)

  def resume(self, seen: np.ndarray, last_recorded: Optional[np.ndarray] = None,
             min_entries: int = 0) -> int:
    """Takes up the list after a failure: `seen` is the data position of the checkpoint restored.

    Batches it counts as trained are not listed again (see `DataList.skip_trained`); in day mode
    what is left is exactly the day's batches not in the checkpoint. `last_recorded`: the counts
    the failed run recorded last (at its last progress line); the batches it trained beyond the
    checkpoint are trained again, and counted as `batches_reread`. Call before `fit`.
    """
    seen = np.asarray(seen, np.int64)
    dropped = self.list.skip_trained(seen, min_entries=min_entries)
    self.restored_seen = seen
    if last_recorded is not None:
      self.batches_reread = int(np.maximum(np.asarray(last_recorded, np.int64) - seen, 0).sum())
    return dropped

  def dataset_fn(self, ctx=None):
    del ctx  # every worker reads the same job: the service, not the input context, splits
    return self.list.dataset(self.dispatcher, self.job_name)

  def dataset_creator(self) -> keras.utils.experimental.DatasetCreator:
    """What `fit` reads: `dataset_fn` on every worker, without the per-worker iterator's buffer.

    ParameterServerStrategy's per-worker iterator otherwise keeps batches of its own (a
    MultiDeviceIterator: a host buffer and a device prefetch, `experimental_per_replica_buffer_
    size=1`), which no other worker can take. A slow worker then trains them last, after the
    others have finished the day (a 12-batch day, worker 0 200x slower: it trained 6 batches
    with the buffer, 4 without); and a worker blocked at the Hop-BS/Hop-BW barrier when the day
    ends there loses them (a 3-worker Hop-BW day, 12 runs under load: 9 missed 1 or 2 batches
    with the buffer, none without).
    """
    return keras.utils.experimental.DatasetCreator(
        self.dataset_fn,
        input_options=tf.distribute.InputOptions(experimental_per_replica_buffer_size=0))

  # ---- the train step ----------------------------------------------------------------------------
  def install_train_function(self, model) -> None:
    """Makes `model.fit` use the shared-list step (see the module docstring).

    One scheduled function runs the model's steps-per-execution steps (Keras' counter, read on
    the coordinator when the function is scheduled, as Keras does: the last function of an epoch
    runs what is left of it), each reading its own batch, taking its own token, pushing its own
    gradient and counting its batch; a run of the function after a worker failure skips the
    steps a previous run finished (`rerun_ledger`).
    """
    strategy, counters = self.strategy, self.counters

    ledger = self.ledger

    def run_step(data, number, steps_done):
      ledger.ride_mark(number, steps_done)
      done = _train_step(model, data)
      with tf.control_dependencies([done]):
        model._train_counter.assign_add(1)  # pylint: disable=protected-access
      return tf.identity(done)

    def trained(optional, number, steps_done):
      """One step on a read batch: (a scalar done after the step, its batch id, examples)."""
      features, labels, batch_id = optional.get_value()
      done = strategy.run(run_step, args=((features, labels), number, steps_done))
      with tf.control_dependencies([done]):
        return (tf.identity(done), tf.cast(tf.identity(batch_id), tf.int64),
                tf.size(labels, out_type=tf.int64))

    def read_if(wanted, iterator, after=()):
      # A read only where a step will train it: a batch taken from the list is a batch trained.
      # Neither branch has an op on a parameter server, so the condition stays on the worker.
      with tf.control_dependencies(after):
        return tf.cond(wanted, iterator.get_next_as_optional,
                       lambda: tf.experimental.Optional.empty(iterator.element_spec))

    def steps(iterator, num_steps, number):
      num_steps = tf.cast(num_steps, tf.int32)
      done = tf.cast(ledger.start(number), tf.int32)
      handles = counters.handles()

      # A run of `number` after a failed one starts after the steps that one recorded (see
      # `rerun_ledger`). One after another: each step's push is done (and recorded) before the
      # next step reads. The loop ends at `num_steps` or at the first read that finds the list
      # exhausted: a step of a function is a step of the loop only where it trains, since each
      # `tf.cond` around a step on the parameter servers sends its condition there and its
      # branch's end back, two transfers per step.
      def more(i, optional, last):
        del last
        return tf.logical_and(i < num_steps, optional.has_value())

      def step(i, optional, last):
        del last
        # The step marks itself done in the ledger once its gradients are pushed.
        step_done, batch_id, examples = trained(optional, number, i + 1)
        recorded = counters.record_step(handles, batch_id, examples)
        with tf.control_dependencies([recorded, step_done]):
          last = tf.identity(step_done)
        return i + 1, read_if(i + 1 < num_steps, iterator, after=[last]), last

      i, _, last = tf.while_loop(
          more, step, (done, read_if(done < num_steps, iterator), tf.constant(0, tf.int64)))
      # A loop ended by an empty read marks the worker as having seen the end (-1); one that ran
      # its steps counts nothing more (-2).
      with tf.control_dependencies([last]):
        ended = counters.record_step(handles, tf.where(i < num_steps, -1, -2),
                                     tf.constant(0, tf.int64))
      # The model's metrics once per function, not per step: each read is a transfer from the
      # parameter server.
      with tf.control_dependencies([last, ended]):
        return tf.nest.map_structure(tf.identity, model.get_metrics_result())

    function = tf.function(steps, reduce_retracing=True)

    def schedule(iterator):
      num_steps = model._steps_per_execution  # pylint: disable=protected-access
      value = self.coordinator.schedule(
          function, args=(iterator, num_steps.value() if num_steps is not None else
                          tf.constant(1, tf.int64), ledger.next_number()))
      with self._lock:
        self._pending.append(value)
      return value

    def make_train_function(force=False):
      del force
      model.train_function = schedule
      return schedule

    # Keras calls model.make_train_function() at the start of fit.
    model.make_train_function = make_train_function
    model.train_function = None

  # ---- the end of the day ------------------------------------------------------------------------
  def callback(self) -> keras.callbacks.Callback:
    shared = self

    class _EndOfList(keras.callbacks.Callback):

      def on_epoch_end(self, epoch, logs=None):
        # Each step reads one entry of the list: no worker can have seen its end before as many
        # steps as it has entries were scheduled, so the workers' flags (a round trip to each)
        # are read only from then on. (A step run again after a worker failure reads again: the
        # end is then seen later, never missed.)
        if (epoch + 1) * self.params["steps"] < len(shared.list.batch_order):
          return
        exhausted = shared.counters.exhausted_each()
        if all(exhausted):
          self.model.stop_training = True
        elif any(exhausted):
          # Hop-BS, Hop-BW: the workers that still hold a batch may all be blocked at the
          # barrier, waiting for steps only the exhausted workers could have taken. Nothing can
          # let them go then, and the exhausted workers' no-op reads would go on forever; the
          # end of fit releases them (their steps push nothing: `released_steps`).
          blocked = shared.strategy.blocked_workers()
          if blocked is not None and all(e or b for e, b in zip(exhausted, blocked)):
            self.model.stop_training = True

    return _EndOfList()

  def watch(self) -> "SharedInput":
    """Starts the stall watchdog (a daemon thread, until `stop_watching`)."""
    self._watching = True
    timeout = self.config.stall_timeout_s

    def loop():
      trained = False
      while self._watching:
        time.sleep(min(1.0, timeout / 4))
        now = time.time()
        with self._lock:
          done = [v for v in self._pending if pipelining.finished(v)]
          self._pending = [v for v in self._pending if not pipelining.finished(v)]
          waiting = bool(self._pending)
        trained = trained or bool(done)
        limit = stall_limit(timeout, trained)
        if done or not waiting:
          self._last_progress = now
        elif now - self._last_progress > limit:
          self.stalled = (f"no training step finished for {limit:.0f} s while "
                          f"{len(self._pending)} were scheduled (--stall_timeout_s): the "
                          "shared data list stopped delivering or a server stopped answering "
                          "(a tf.data worker lost, a stalled link?)")
          _fail_scheduled_steps(self.coordinator, DataServiceStalled(self.stalled))
          return

    self._thread = threading.Thread(target=loop, daemon=True, name="data_list_watchdog")
    self._thread.start()
    return self

  def stop_watching(self) -> None:
    self._watching = False

  def flush_partial_step(self, model, optimizer) -> int:
    """GBA: completes a global step left with fewer than M gradients; returns the zeros pushed.

    Each zero gradient takes the next token and a place in the step like a real one, so the
    inner optimizer applies (sum of the buffered gradients) / M, once, as SPEC's "divide by M"
    says for a step whose other entries were dropped.
    """
    if self.config.mode != "gba" or not hasattr(optimizer, "_token_source"):
      return 0
    m = self.strategy.num_aggregate
    missing = (-int(optimizer.token_generator.count().numpy())) % m
    if not missing:
      return 0
    variables = list(model.trainable_variables)
    sparse = [optimizer._var_key(v) in optimizer._sparse_keys for v in variables]  # pylint: disable=protected-access

    def zeros(var, is_sparse):
      if is_sparse:
        return tf.IndexedSlices(tf.zeros([0] + var.shape[1:].as_list(), var.dtype),
                                tf.zeros([0], tf.int64), tf.constant(var.shape.as_list(),
                                                                     tf.int64))
      return tf.zeros(var.shape, var.dtype)

    @tf.function
    def push_zeros():
      def fn():
        optimizer.apply_gradients([(zeros(v, s), v) for v, s in zip(variables, sparse)])
        return tf.constant(0)
      return self.strategy.run(fn)

    for _ in range(missing):
      self.coordinator.schedule(push_zeros)
      # One at a time: each must take its token before the next.
      self.coordinator.join()
    self.flushed_gradients = missing
    return missing

  def report(self) -> dict:
    out = self.counters.report(self.list.batch_sizes(), passes=self.list.passes,
                               restored=self.restored_seen)
    out.update({"input": "shared", "day_mode": self.day_mode, "rows": self.list.num_rows,
                "num_batches": self.list.num_batches, "passes": self.list.passes,
                "job_name": self.job_name, "stalled": self.stalled,
                "flushed_zero_gradients": self.flushed_gradients,
                # Trained before this run (the checkpoint resumed from), and trained again here
                # after a failure: counted from the batch ids (None: not a resumed run).
                "restored_batches": int(self.restored_seen.sum()),
                "batches_reread": self.batches_reread})
    out["lost"] = out["missed"] if self.day_mode else None
    if not self.day_mode:
      # A fixed step count stops wherever it stops: the unread rest of the list is not "missed".
      out["missed"] = None
      out.pop("missed_examples", None)
    return out


def _train_step(model, data) -> tf.Tensor:
  """`model.train_step(data)` without the metrics' results it returns; a scalar once it is done.

  Keras' step ends by reading every metric's result, on the parameter servers, for logs that
  only the function's last step gives to the coordinator; the function reads them once at its
  end instead. The loss tracker's adds ride with the step's gradients (`riding_metrics`). A
  model with a `train_step` of its own runs it as it is.
  """
  if (type(model).train_step is not keras.Model.train_step
      or type(model).compute_metrics is not keras.Model.compute_metrics):
    return _done_after(model.train_step(data))
  # As keras.Model.train_step (tf_keras 2.21), but compute_metrics' update only.
  x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
  with tf.GradientTape() as tape:
    y_pred = model(x, training=True)
    if type(model).compute_loss is keras.Model.compute_loss:
      # Its metrics exist once it is built, which its first call does (as it does there).
      if not model.compiled_loss._built:  # pylint: disable=protected-access
        model.compiled_loss.build(y_pred)
      with riding_metrics.adds_ride(model.compiled_loss.metrics):
        loss = model.compute_loss(x, y, y_pred, sample_weight)
    else:
      loss = model.compute_loss(x, y, y_pred, sample_weight)
  model._validate_target_and_loss(y, loss)  # pylint: disable=protected-access
  applied = model.optimizer.minimize(loss, model.trainable_variables, tape=tape)
  model.compiled_metrics.update_state(y, y_pred, sample_weight)
  return _done_after(applied)


def _done_after(outputs) -> tf.Tensor:
  # Only tensors and ops: an optimizer may return its `iterations` variable, and reading it here
  # would be one more transfer. The step's stateful ops run before the loop's next iteration
  # whatever this depends on (the loop body's control outputs).
  deps = [t for t in tf.nest.flatten(outputs) if isinstance(t, (tf.Tensor, tf.Operation))]
  with tf.control_dependencies(deps):
    return tf.constant(0, tf.int64)


def _fail_scheduled_steps(coordinator, error: Exception) -> None:
  """Makes the coordinator's join() raise `error`, cancelling the steps queued and running.

  What a step's own error does (ClosureQueue.mark_failed), without counting a step as finished:
  the running steps end through the cancellation that the raising join() starts.
  """
  q = coordinator._cluster.closure_queue  # pylint: disable=protected-access
  with q._queue_lock:  # pylint: disable=protected-access
    if q._error is None:  # pylint: disable=protected-access
      q._error = error  # pylint: disable=protected-access
    q._stop_waiting_condition.notify_all()  # pylint: disable=protected-access
