"""The runtime of DTS (delayed and temporally sparse updates, SPEC section 3): its exchanges.

The optimizer (`tf_gba.optimizers.DTS`) does each replica's local step and holds the compensation
state; this module runs the schedule around it. At the end of a round (every `period` steps) the
round's accumulated gradients go to a background all-reduce (`AsyncAllReduce`, with optional
injected latency) and `delay - 1` steps later the loop waits for that mean and applies the
compensation. Every worker issues its collectives in the same order because the schedule depends
only on the step number; `synchronize()` drains what is in flight so that all replicas hold the
same model (the replicas' average, i.e. synchronous SGD's model on the same gradients).

Two drivers share `ExchangeSchedule`:
* `DTSExchangeCallback` (made by `DTS.exchange_callback()`) for `model.fit`: Keras runs the local
  step through `DTS.apply_gradients`; the callback runs the exchanges between steps.
* `DTSTrainer`, a custom loop, for MultiWorkerMirroredStrategy (the binary's `--mode=dts`): there
  fit's own cross-worker collectives (its metrics' all-reduce each step) would interleave with the
  exchange thread's, and collectives must run in the same order on every worker.

The optimizer is used by duck typing (`apply_local`, `payload`, `compensate`, the schedule
functions): this layer does not import the optimizers above it.

Example:

  strategy = make_local_mirrored_strategy(4)
  with strategy.scope():
    model = make_model()
    optimizer = tf_gba.optimizers.DTS(tf_keras.optimizers.SGD(0.05, momentum=0.9), delay=4,
                                      period=4)
    model.compile(optimizer=optimizer, loss="binary_crossentropy")
  model.fit(dataset, steps_per_epoch=500,
            callbacks=[optimizer.exchange_callback(latency_ms=50)])
"""

from typing import Callable, Dict, Sequence

import numpy as np
import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute.latency import AsyncAllReduce


# One MirroredStrategy per device set and process: two strategies number their collectives
# (group and instance keys) the same way, so over shared devices their all-reduces abort each other
# ("Shape mismatch in the collective instance 100").
_LOCAL_STRATEGIES: Dict[tuple, tf.distribute.MirroredStrategy] = {}


def make_local_mirrored_strategy(num_replicas: int) -> tf.distribute.MirroredStrategy:
  """A MirroredStrategy over `num_replicas` logical CPU devices of this process.

  Splits the first physical CPU into logical devices; that has to happen before TensorFlow
  initialises its devices, so call this early (before any tensor is created). Every call for the
  same devices returns the same strategy (see `_LOCAL_STRATEGIES`): use this one rather than a
  second `tf.distribute.MirroredStrategy` over them in the same process.
  """
  cpu = tf.config.list_physical_devices("CPU")[0]
  try:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num_replicas)])
  except RuntimeError:
    pass  # Already initialised: use what exists, checked below.
  devices = [d.name for d in tf.config.list_logical_devices("CPU")]
  if len(devices) < num_replicas:
    raise RuntimeError(
        f"need {num_replicas} logical CPU devices but TensorFlow was initialised with "
        f"{len(devices)}; call make_local_mirrored_strategy() before creating any tensor.")
  key = tuple(devices[:num_replicas])
  if key not in _LOCAL_STRATEGIES:
    _LOCAL_STRATEGIES[key] = tf.distribute.MirroredStrategy(list(key))
  return _LOCAL_STRATEGIES[key]


class ExchangeSchedule:
  """Starts and consumes the exchanges of a DTS optimizer around its local steps.

  Args:
    strategy: the optimizer's strategy.
    optimizer: a built `tf_gba.optimizers.DTS`.
    latency_ms: propagation delay injected into every exchange.
    exchange_timeout_s: how long to wait for one exchange before giving up (a dead peer).
  """

  def __init__(self, strategy: tf.distribute.Strategy, optimizer, latency_ms: float = 0.0,
               exchange_timeout_s: float = 600.0):
    self._strategy = strategy
    self._opt = optimizer
    self._timeout = exchange_timeout_s
    self.exchange = AsyncAllReduce(strategy, latency_ms=latency_ms)
    self._in_flight: Dict[int, object] = {}
    self._steps = 0
    self._generation = None  # restore generation seen; None: read the step counter first
    self.slots = [tf.constant(k, tf.int32) for k in range(optimizer.num_slots)]
    self._coefs: Dict[int, tuple] = {}

    @tf.function
    def payload_fn(slot):
      return self._opt.payload(slot)

    @tf.function
    def compensate_fn(mean, slot, u_coef, w_coef):
      self._opt.compensate(mean, slot, u_coef, w_coef)

    self._payload_fn = payload_fn
    self._compensate_fn = compensate_fn

  @property
  def steps(self) -> int:
    """Steps run so far (restored ones included)."""
    return self._steps

  def slot_for_next_step(self):
    return self.slots[self._opt.slot_of(self._opt.round_of(self._steps))]

  def _coefficients(self, lag: int):
    if lag not in self._coefs:
      u_coef, w_coef = self._opt.coefficients(lag)
      self._coefs[lag] = (tf.constant(u_coef, tf.float32), tf.constant(w_coef, tf.float32))
    return self._coefs[lag]

  def _start(self, rnd: int):
    payload = self._payload_fn(self.slots[self._opt.slot_of(rnd)])
    self._in_flight[rnd] = self.exchange.start(payload)

  def _consume(self, rnd: int, lag: int):
    handle = self._in_flight.pop(rnd, None)
    if handle is None:
      return  # Already consumed early by synchronize().
    mean = handle.result(self._timeout)
    self._compensate_fn(mean, self.slots[self._opt.slot_of(rnd)], *self._coefficients(lag))

  def resume(self):
    """Picks up a checkpoint restore: resyncs the step counter, restarts the exchanges in flight.

    Idempotent and cheap when nothing was restored.
    """
    if self._generation == self._opt.restore_generation:
      return
    self._generation = self._opt.restore_generation
    self._opt.finish_restore()
    for handle in self._in_flight.values():
      handle.result(self._timeout)  # Let stale collectives finish (every worker runs them).
    self._in_flight.clear()
    self._steps = int(self._opt.iterations.numpy())
    # Their inputs are the restored slots, so the restarted exchanges give the same means.
    for rnd in self._opt.rounds_in_flight(self._steps):
      self._start(rnd)

  def after_step(self):
    """Called once the local step `steps` has run: starts and consumes what is due after it."""
    opt, n = self._opt, self._steps
    self._steps = n + 1
    if opt.is_round_end(n):
      self._start(opt.round_of(n))
    due = opt.due_round(n)
    if due is not None:
      self._consume(due, n - opt.round_end(due))

  def synchronize(self):
    """Consumes every exchange in flight and exchanges the unfinished round, now."""
    self.resume()
    last = self._steps - 1
    if last < 0:
      return
    opt = self._opt
    for rnd in sorted(self._in_flight):
      self._consume(rnd, last - opt.round_end(rnd))
    if not opt.is_round_end(last):
      # The current round's steps so far; its slot restarts from zero afterwards, so its regular
      # exchange at the round end will cover only the steps after this one.
      rnd = opt.round_of(last)
      self._start(rnd)
      self._consume(rnd, 0)

  def close(self):
    """Waits for queued exchanges (peers expect them) and stops the exchange thread."""
    for handle in self._in_flight.values():
      try:
        handle.result(self._timeout)
      except Exception:  # pylint: disable=broad-except
        pass  # Closing after a failure: the original error is what matters.
    self._in_flight.clear()
    self.exchange.close()


class DTSExchangeCallback(keras.callbacks.Callback):
  """Runs a DTS optimizer's exchanges under `model.fit` (use `DTS.exchange_callback()`).

  Keras runs each step's local update through `DTS.apply_gradients`; after every step this starts
  the exchange of a finished round and consumes the one that is due. With
  `synchronize_at_end` (default) the end of `fit` drains the exchanges so that every replica holds
  the replicas' average model (synchronous SGD's model), e.g. before a checkpoint that
  synchronous training will read.
  """

  def __init__(self, optimizer, latency_ms: float = 0.0, exchange_timeout_s: float = 600.0,
               synchronize_at_end: bool = True):
    super().__init__()
    self._opt = optimizer
    self._latency_ms = latency_ms
    self._timeout = exchange_timeout_s
    self._synchronize_at_end = synchronize_at_end
    self.schedule = None

  def on_train_begin(self, logs=None):
    opt = self._opt
    if self.model is not None and self.model.optimizer is not opt:
      raise ValueError("This DTS exchange callback belongs to another optimizer: pass "
                       "model.optimizer.exchange_callback() to fit.")
    if not opt.built and self.model is not None and self.model.built:
      opt.build(self.model.trainable_variables)
    if not opt.built and int(opt.iterations.numpy()) > 0:
      # Its restored state would only be created by the first step, after the schedule started.
      raise ValueError("Resuming DTS under fit: build the model (call it on a batch) before fit, "
                       "so that the restored optimizer state exists before the first step.")
    opt.exchange_driver = self
    self.schedule = ExchangeSchedule(opt.strategy, opt, latency_ms=self._latency_ms,
                                     exchange_timeout_s=self._timeout)
    self.schedule.resume()

  def on_train_batch_end(self, batch, logs=None):
    del batch, logs
    done = int(self._opt.iterations.numpy())
    if done != self.schedule.steps + 1:
      raise RuntimeError(
          f"DTS runs its exchanges between steps, but {done - self.schedule.steps} steps ran in "
          "one call: compile the model with steps_per_execution=1.")
    self.schedule.after_step()

  def on_train_end(self, logs=None):
    try:
      if self._synchronize_at_end:
        self.schedule.synchronize()
    finally:
      self.schedule.close()
      self._opt.exchange_driver = None


class DTSTrainer:
  """Runs DTS steps on `strategy` with a real non-blocking exchange (a custom loop).

  The iterator passed to `step()` must not issue collectives of its own: under
  MultiWorkerMirroredStrategy use repeating (infinite) datasets, or the distributed iterator
  all-reduces a "has data" flag on every `next()`.

  Args:
    strategy: MirroredStrategy or MultiWorkerMirroredStrategy (the optimizer's).
    optimizer: a `tf_gba.optimizers.DTS`; built here for `variables` if it was not built yet.
    variables: the trained variables (created under `strategy.scope()`).
    loss_fn: `loss_fn(batch) -> scalar`, run in replica context on the replica's batch; it must
      read `variables` (the replica's own copy is what it sees there).
    latency_ms: propagation delay injected into every exchange.
    exchange_timeout_s: how long to wait for one exchange before giving up (a dead peer).
  """

  def __init__(self, strategy: tf.distribute.Strategy, optimizer,
               variables: Sequence[tf.Variable], loss_fn: Callable, latency_ms: float = 0.0,
               exchange_timeout_s: float = 600.0):
    self._strategy = strategy
    self._opt = optimizer
    self._variables = list(variables)
    self._loss_fn = loss_fn
    if not optimizer.built:
      with strategy.scope():
        optimizer.build(self._variables)
    optimizer.exchange_driver = self
    self._schedule = ExchangeSchedule(strategy, optimizer, latency_ms=latency_ms,
                                      exchange_timeout_s=exchange_timeout_s)
    self.exchange = self._schedule.exchange

    def replica_step(batch):
      with tf.GradientTape() as tape:
        loss = self._loss_fn(batch)
      return loss, tape.gradient(loss, self._variables)

    # The round's payload is read by the schedule's payload function, not here: one trace of the
    # (large) step function instead of two, for one small extra call per round.
    @tf.function
    def step_fn(iterator, slot):
      loss, grads = strategy.run(replica_step, args=(next(iterator),))
      self._opt.apply_local(grads, slot)
      return loss

    self._step_fn = step_fn

  @property
  def steps(self) -> int:
    """Steps run so far (restored ones included)."""
    return self._schedule.steps

  def resume(self):
    """Picks up a checkpoint restore: resyncs the step counter, restarts the exchanges in flight.

    Idempotent and cheap when nothing was restored; `step()` and `synchronize()` call it.
    """
    self._schedule.resume()

  def step(self, iterator) -> float:
    """Runs one step on `iterator` (a distributed iterator); returns the local replicas' mean loss.

    Every worker must call this the same number of times: the exchanges are collectives.
    """
    self._schedule.resume()
    loss = self._step_fn(iterator, self._schedule.slot_for_next_step())
    self._schedule.after_step()
    return float(np.mean([x.numpy() for x in self._strategy.experimental_local_results(loss)]))

  def synchronize(self):
    """Consumes every exchange in flight and exchanges the unfinished round, now.

    Afterwards every replica holds the same model: the replicas' average, which is synchronous
    SGD's model on the gradients seen so far. A collective: call it on every worker at the same
    step. Training can continue afterwards.
    """
    self._schedule.synchronize()

  def close(self):
    """Waits for queued exchanges (peers expect them) and stops the exchange thread."""
    self._schedule.close()
    if self._opt.exchange_driver is self:
      self._opt.exchange_driver = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
