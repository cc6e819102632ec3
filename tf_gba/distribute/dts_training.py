"""Custom training loop for DTS (delayed and temporally sparse updates, SPEC section 3).

`DTSTrainer` drives `tf_gba.optimizers.DTS`: each step is a purely local update on every replica
(no collective in the step function); at the end of a round (every `period` steps) it hands the
round's accumulated gradients to a background all-reduce (`AsyncAllReduce`, with optional injected
latency) and `delay - 1` steps later it waits for that mean and applies the compensation. Every
worker issues its collectives in the same order because the schedule depends only on the step
number; `synchronize()` drains what is in flight so that all replicas hold the same model (the
replicas' average, i.e. synchronous SGD's model on the same gradients).

`train_dts(...)` is the entry for a training binary's `--mode=dts`: it builds a tf_keras model that
returns probabilities for a binary label, trains it for a number of steps with binary
cross-entropy, and returns a summary (steps/s, final loss, eval AUC).

Example:

  strategy = make_local_mirrored_strategy(4)
  summary = train_dts(lambda: my_model(), dataset_fn, steps=500, delay=4, period=4,
                      latency_ms=50, strategy=strategy, inner="momentum", learning_rate=0.05,
                      eval_dataset_fn=eval_fn)
  print(summary["steps_per_sec"], summary["eval_auc"])
"""

import os
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf
import tf_keras as keras

from tf_gba.common import metrics
from tf_gba.distribute.latency import AsyncAllReduce
from tf_gba.optimizers.dts import DTS


def make_local_mirrored_strategy(num_replicas: int) -> tf.distribute.MirroredStrategy:
  """A MirroredStrategy over `num_replicas` logical CPU devices of this process.

  Splits the first physical CPU into logical devices; that has to happen before TensorFlow
  initialises its devices, so call this early (before any tensor is created).
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
  return tf.distribute.MirroredStrategy(devices[:num_replicas])


class DTSTrainer:
  """Runs DTS steps on `strategy` with a real non-blocking exchange.

  The iterator passed to `step()` must not issue collectives of its own: under
  MultiWorkerMirroredStrategy use repeating (infinite) datasets, or the distributed iterator
  all-reduces a "has data" flag on every `next()`.

  Args:
    strategy: MirroredStrategy, MultiWorkerMirroredStrategy or the default strategy.
    optimizer: a `DTS`; built here for `variables` if it was not built yet.
    variables: the trained variables (created under `strategy.scope()`).
    loss_fn: `loss_fn(batch) -> scalar`, run in replica context on the replica's batch; it must
      read `variables` (the replica's own copy is what it sees there).
    latency_ms: propagation delay injected into every exchange.
    exchange_timeout_s: how long to wait for one exchange before giving up (a dead peer).
  """

  def __init__(self, strategy: tf.distribute.Strategy, optimizer: DTS,
               variables: Sequence[tf.Variable], loss_fn: Callable, latency_ms: float = 0.0,
               exchange_timeout_s: float = 600.0):
    self._strategy = strategy
    self._opt = optimizer
    self._variables = list(variables)
    self._loss_fn = loss_fn
    self._timeout = exchange_timeout_s
    if not optimizer.built:
      with strategy.scope():
        optimizer.build(self._variables)
    self.exchange = AsyncAllReduce(strategy, latency_ms=latency_ms)
    self._in_flight: Dict[int, object] = {}
    self._steps = 0
    self._generation = None  # restore generation seen; None: read the step counter first
    self._slots = [tf.constant(k, tf.int32) for k in range(optimizer.num_slots)]
    self._coefs: Dict[int, tuple] = {}

    def replica_step(batch):
      with tf.GradientTape() as tape:
        loss = self._loss_fn(batch)
      return loss, tape.gradient(loss, self._variables)

    # The round's payload is read by payload_fn, not here: one trace of the (large) step function
    # instead of two, for one small extra call per round.
    @tf.function
    def step_fn(iterator, slot):
      loss, grads = strategy.run(replica_step, args=(next(iterator),))
      self._opt.apply_local(grads, slot)
      return loss

    @tf.function
    def payload_fn(slot):
      return self._opt.payload(slot)

    @tf.function
    def compensate_fn(mean, slot, u_coef, w_coef):
      self._opt.compensate(mean, slot, u_coef, w_coef)

    self._step_fn = step_fn
    self._payload_fn = payload_fn
    self._compensate_fn = compensate_fn

  @property
  def steps(self) -> int:
    """Steps run so far (restored ones included)."""
    return self._steps

  def _coefficients(self, lag: int):
    if lag not in self._coefs:
      u_coef, w_coef = self._opt.coefficients(lag)
      self._coefs[lag] = (tf.constant(u_coef, tf.float32), tf.constant(w_coef, tf.float32))
    return self._coefs[lag]

  def _start(self, rnd: int, payload):
    self._in_flight[rnd] = self.exchange.start(payload)

  def _consume(self, rnd: int, lag: int):
    handle = self._in_flight.pop(rnd, None)
    if handle is None:
      return  # Already consumed early by synchronize().
    mean = handle.result(self._timeout)
    self._compensate_fn(mean, self._slots[self._opt.slot_of(rnd)], *self._coefficients(lag))

  def resume(self):
    """Picks up a checkpoint restore: resyncs the step counter, restarts the exchanges in flight.

    Idempotent and cheap when nothing was restored; `step()` and `synchronize()` call it.
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
      self._start(rnd, self._payload_fn(self._slots[self._opt.slot_of(rnd)]))

  def step(self, iterator) -> float:
    """Runs one step on `iterator` (a distributed iterator); returns the local replicas' mean loss.

    Every worker must call this the same number of times: the exchanges are collectives.
    """
    self.resume()
    opt, n = self._opt, self._steps
    rnd = opt.round_of(n)
    slot = self._slots[opt.slot_of(rnd)]
    loss = self._step_fn(iterator, slot)
    self._steps = n + 1
    if opt.is_round_end(n):
      self._start(rnd, self._payload_fn(slot))
    due = opt.due_round(n)
    if due is not None:
      self._consume(due, n - opt.round_end(due))
    return float(np.mean([x.numpy() for x in self._strategy.experimental_local_results(loss)]))

  def synchronize(self):
    """Consumes every exchange in flight and exchanges the unfinished round, now.

    Afterwards every replica holds the same model: the replicas' average, which is synchronous
    SGD's model on the gradients seen so far. A collective: call it on every worker at the same
    step. Training can continue afterwards.
    """
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
      self._start(rnd, self._payload_fn(self._slots[opt.slot_of(rnd)]))
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

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _binary_crossentropy(labels, probs):
  labels = tf.reshape(tf.cast(labels, probs.dtype), [-1])
  return tf.reduce_mean(keras.losses.binary_crossentropy(labels[:, None],
                                                         tf.reshape(probs, [-1, 1])))


def _worker_checkpoint_dir(checkpoint_dir: str, strategy) -> str:
  """Each worker keeps its own DTS checkpoint: its replicas' compensation state is its own."""
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    return checkpoint_dir
  return os.path.join(checkpoint_dir, f"worker_{strategy.cluster_resolver.task_id or 0}")


def evaluate_binary(model, dataset) -> Dict[str, float]:
  """AUC and log loss ("log_loss", as train_dts's summary names it) of `model` on `dataset`."""
  result = metrics.evaluate_binary(model, dataset)
  return {"auc": result["auc"], "log_loss": result["logloss"], "examples": result["examples"]}


def train_dts(model_fn: Callable[[], keras.Model],
              dataset_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset],
              steps: int, delay: int = 1, period: int = 1, latency_ms: float = 0.0,
              strategy: Optional[tf.distribute.Strategy] = None, inner: str = "sgd",
              learning_rate: float = 0.01, momentum: float = 0.9,
              eval_dataset_fn: Optional[Callable[[], tf.data.Dataset]] = None,
              checkpoint_dir: Optional[str] = None, checkpoint_every: int = 0,
              log_every: int = 0, global_batch_size: Optional[int] = None,
              exchange_timeout_s: float = 600.0) -> Dict:
  """Trains a binary-label tf_keras model with DTS and returns a summary.

  Args:
    model_fn: builds the model (called under `strategy.scope()`); the model maps features to
      probabilities. If it is not built yet, it is built on one batch of `dataset_fn`.
    dataset_fn: `InputContext -> tf.data.Dataset` of (features, labels) batches of the
      per-replica batch size, repeating (as for `distribute_datasets_from_function`).
    steps: total number of steps (restored steps count).
    delay, period, inner, learning_rate, momentum: see `tf_gba.optimizers.DTS`.
    latency_ms: injected latency per exchange.
    strategy: defaults to the current (default) strategy.
    eval_dataset_fn: `() -> tf.data.Dataset` of (features, labels) batches; evaluated after the
      final `synchronize()`, when every replica holds the replicas' average model.
    checkpoint_dir: if set, restore the latest checkpoint there and save every `checkpoint_every`
      steps (0: only at the end). Multi-worker: each worker uses `<dir>/worker_<task>`.
    log_every: print the loss every this many steps (0: never).
    global_batch_size: examples per step over all replicas; if given, the summary also has
      `examples_per_sec`.
    exchange_timeout_s: see `DTSTrainer`.

  Returns:
    dict with the configuration, `steps_per_sec` (steady state: the first `delay + period - 1`
    steps, which trace the step functions, are not timed), `examples_per_sec` (global),
    `final_loss` (mean training loss of the last min(20, steps) steps on this worker's replicas),
    `exchanges`, `blocked_seconds` (time the loop waited for exchanges), and with an eval set
    `eval_auc`, `eval_log_loss`.
  """
  strategy = strategy or tf.distribute.get_strategy()
  if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    # A finite dataset makes every `next()` on the distributed iterator a cross-worker collective
    # (to agree on the last partial batch), which would interleave with the exchange's.
    if dataset_fn(tf.distribute.InputContext()).cardinality() != tf.data.INFINITE_CARDINALITY:
      raise ValueError("dataset_fn must return a repeating (infinite) dataset under "
                       "MultiWorkerMirroredStrategy")
  with strategy.scope():
    model = model_fn()
    if not model.built:
      features, _ = next(iter(dataset_fn(tf.distribute.InputContext())))
      model(features)
    optimizer = DTS(inner, learning_rate=learning_rate, momentum=momentum, delay=delay,
                    period=period)
    optimizer.build(model.trainable_variables)

  def replica_loss(batch):
    features, labels = batch
    loss = _binary_crossentropy(labels, model(features, training=True))
    if model.losses:
      loss += tf.add_n(model.losses)
    return loss

  manager = None
  if checkpoint_dir:
    task_dir = _worker_checkpoint_dir(checkpoint_dir, strategy)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(checkpoint, task_dir, max_to_keep=2)
    if manager.latest_checkpoint:
      checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()

  iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
  losses: List[float] = []
  warmup = delay + period - 1
  with DTSTrainer(strategy, optimizer, model.trainable_variables, replica_loss,
                  latency_ms=latency_ms, exchange_timeout_s=exchange_timeout_s) as trainer:
    trainer.resume()
    first = trainer.steps
    begin = time.perf_counter()
    timed_from, timed_steps = begin, 0
    while trainer.steps < steps:
      losses.append(trainer.step(iterator))
      done = trainer.steps
      if done - first == warmup:
        timed_from, timed_steps = time.perf_counter(), 0
      elif done - first > warmup:
        timed_steps += 1
      if log_every and done % log_every == 0:
        print(f"[dts] step {done} loss {losses[-1]:.5f}", flush=True)
      if manager is not None and checkpoint_every and done % checkpoint_every == 0:
        manager.save(checkpoint_number=done)
    end = time.perf_counter()
    if timed_steps == 0:  # Too few steps to leave out the warm-up.
      timed_from, timed_steps = begin, len(losses)
    trainer.synchronize()
    if manager is not None:
      manager.save(checkpoint_number=trainer.steps)
    summary = {
        "mode": "dts", "inner": inner, "delay": delay, "period": period,
        "latency_ms": float(latency_ms), "learning_rate": learning_rate,
        "momentum": optimizer.momentum, "steps": trainer.steps, "steps_run": len(losses),
        "num_replicas": strategy.num_replicas_in_sync,
        "steps_per_sec": timed_steps / max(end - timed_from, 1e-9),
        "train_seconds": end - begin,
        "final_loss": float(np.mean(losses[-20:])) if losses else float("nan"),
        "exchanges": trainer.exchange.num_started,
        "blocked_seconds": trainer.exchange.blocked_seconds,
    }
  if global_batch_size:
    summary["examples_per_sec"] = summary["steps_per_sec"] * global_batch_size
  if eval_dataset_fn is not None:
    metrics = evaluate_binary(model, eval_dataset_fn())
    summary.update(eval_auc=metrics["auc"], eval_log_loss=metrics["log_loss"],
                   eval_examples=metrics["examples"])
  return summary

