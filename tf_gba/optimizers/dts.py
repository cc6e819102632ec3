"""DTS: delayed and temporally sparse synchronous updates with error compensation.

Synchronous data-parallel SGD waits for the all-reduce of every step. DTS does not: each replica
updates its own copy of the model with its local gradient at once, the all-reduce runs in the
background, and when its mean arrives the replica corrects its model by the difference between
what it applied (its local gradients) and what synchronous SGD would have applied (the mean). After
each correction the replicas' average model is exactly synchronous SGD's model on the same
gradients (SPEC section 3). Two knobs:

* `delay` t: the exchange started after step s is consumed (waited for and compensated) at the end
  of step s + t - 1, i.e. before the forward pass of step s + t. It counts like the paper's Eq. 3:
  `delay=1` is plain synchronous SGD, `delay=t` gives
  `w(n,j) = w(n-1,j) - lr*grad(n-1,j) - lr*(avg(n-t) - grad(n-t,j))`.
* `period` p: only every p-th step exchanges: a *round* is the steps `[r*p, r*p + p - 1]`; its
  local gradients are accumulated and the accumulation is all-reduced once, after the round's last
  step `b = r*p + p - 1`, and consumed at the end of step `b + t - 1` (Eq. 9/16 for t = 1).

Design. `DTS` is a tf_keras optimizer that wraps a `tf_keras.optimizers.SGD` (with or without
momentum): the inner optimizer's `iterations` and momentum slots are DTS's, so a checkpoint of
synchronous training with the same SGD restores into DTS and back (only the "dts" entry is added).
The compensation is defined on the paper's momentum `u` (`u = m*u + g; w -= lr*u`, Eq. 4); SGD's
slot holds the velocity `v = -lr*u`, which is exact while the learning rate is constant, so DTS
refuses learning-rate schedules (and the inner options that change the update: nesterov, clipping,
weight decay, EMA). The replicas' local models are the per-device copies of the model's mirrored
variables (under `MirroredStrategy` one copy per logical device, under
`MultiWorkerMirroredStrategy` one per worker): every update here writes each copy with its own
replica's values (`strategy.experimental_local_results`), never through the strategy's
synchronising assign, so the copies diverge between corrections as the algorithm requires.

Two drivers run the schedule, both with a real background all-reduce
(`tf_gba.distribute.dts_training`): `model.fit(..., callbacks=[optimizer.exchange_callback()])`
(the local step runs inside Keras' step function, through `apply_gradients`; the callback starts
and consumes the exchanges between steps), and `DTSTrainer` for a custom loop. Keras calls no
optimizer code between steps, and a collective inside the step would block it, which is why the
exchange is a callback.

State per variable, per replica (the compensation state):
* `sum[k]`: for round slot k, the sum over the round's steps of the restarted momentum
  `S(i) = m*S(i-1) + grad(i)` (`S` restarts at the round's first step); for SGD (m = 0) simply the
  sum of the round's local gradients. Exchanged at the round's end.
* `end[k]` (momentum only): `S(b)`, the restarted momentum at the round's last step. Exchanged too
  (the paper's "extra term to correct the momentum", Eq. 10-11).
* `u` (momentum only): the local momentum.
Slots are reused round-robin: `num_slots = ceil((t - 1) / p) + 1` rounds can be alive at once (one
accumulating, the others in flight); a slot is zeroed when its round is consumed, so accumulation
needs no reset.

Compensation of a round with last step b, consumed at the end of step n (lag `l = n - b`, which is
`t - 1` on schedule), with `dsum = mean(sum[k]) - sum[k]` and `dend = mean(end[k]) - end[k]`:

    u      += m**l * dend
    w(n+1) -= lr * (dsum + m * c_l * dend),     c_l = sum_{k<l} m**k

This replaces every local gradient of the round by the mean in the local trajectory, which is
exactly Eq. 3 (SGD, p = 1), Eq. 7-8 (momentum, p = 1: `u(n) += m**t * d`, `w -= lr*c_t*d`), Eq. 9
(SGD, t = 1) and Eq. 11 (momentum, t = 1). **Settled** for the combined form (Eq. 12-13): the paper
counts its delay there from the step after the round (its t is our `delay - 1`), and Eq. 13 as
printed scales the weight correction by `m**t` only, which for p = 1 disagrees with Eq. 8 and
breaks the "average model equals synchronous SGD" property; this module uses the exact correction
above, which reduces to Eq. 12 for SGD and to Eq. 8 and Eq. 11 in the special cases.

Embedding gradients (`tf.IndexedSlices`): with plain SGD the local step and the accumulation are
sparse scatters; the exchange and the correction are dense (the all-reduce sums whole tables).
With momentum the gradient is made dense (the momentum touches every row anyway).

Checkpoints: `tf.train.Checkpoint(optimizer=dts, ...)` saves what the inner SGD saves
(`iterations`, the momentum slots: the same names as synchronous training with that SGD, so
checkpoints switch to and from Sync) plus a "dts" entry: *every replica's* copy of the compensation
state and, with several replicas in one process, of the model variables and momentum slots (a
plain checkpoint of a mirrored variable keeps only the first copy). Those copies are written back
by `finish_restore()` (the drivers call it before their next step), after the model's own restore,
which would otherwise overwrite all copies with the first. A synchronous checkpoint has no "dts"
entry: its replicas are equal and no round is in flight, which is the state it restores. Under
`MultiWorkerMirroredStrategy` each worker holds only its own copies, so each worker must save to
and restore from its own checkpoint path. Exchanges in flight are not saved: their inputs are (the
slots), and the drivers restart them after a restore, which gives the same means.

Example:

  strategy = tf.distribute.MirroredStrategy(devices)
  with strategy.scope():
    model = make_model()
    optimizer = tf_gba.optimizers.DTS(tf_keras.optimizers.SGD(0.1, momentum=0.9), delay=2,
                                      period=2)
    model.compile(optimizer=optimizer, loss="binary_crossentropy")
  model.fit(dataset, epochs=1, steps_per_epoch=100,
            callbacks=[optimizer.exchange_callback()])
"""

import copy
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
import tf_keras as keras

from tf_gba.common import arguments
from tf_gba.optimizers import wrapping


def per_replica_nests(strategy: tf.distribute.Strategy, nest) -> List:
  """Splits a nest of distributed values into one nest of local tensors per local replica."""
  per_leaf = [strategy.experimental_local_results(leaf) for leaf in tf.nest.flatten(nest)]
  if not per_leaf:
    return [nest]
  return [tf.nest.pack_sequence_as(nest, [copies[r] for copies in per_leaf])
          for r in range(len(per_leaf[0]))]


class _PerReplicaCopies(tf.__internal__.tracking.Trackable):
  """Checkpoints every local replica's copy of some mirrored variables.

  A checkpoint of a mirrored variable holds only its first copy; DTS's copies differ by design.
  Saved as one tensor per variable, stacked over the local replicas. With `deferred=True` the
  restored values are kept and written by `apply_pending()` instead of at restore time.
  """

  def __init__(self, strategy, variables: Dict[str, tf.Variable], deferred: bool = False,
               on_restore=None):
    super().__init__()
    self._strategy = strategy
    self._variables = variables
    self._deferred = deferred
    self._on_restore = on_restore
    self._pending: Dict[str, tf.Tensor] = {}

  def _copies(self, var) -> Tuple[tf.Variable, ...]:
    return tuple(self._strategy.experimental_local_results(var))

  def _serialize_to_tensors(self):
    return {name: tf.stack([c.read_value() for c in self._copies(var)])
            for name, var in self._variables.items()}

  def _restore_from_tensors(self, restored_tensors):
    ops = []
    for name, value in restored_tensors.items():
      if name not in self._variables:
        continue
      copies = self._copies(self._variables[name])
      if value.shape[0] is not None and value.shape[0] != len(copies):
        raise ValueError(
            f"DTS checkpoint entry {name!r} holds {value.shape[0]} replica copies but this "
            f"process has {len(copies)} local replicas; restore with the same number of local "
            "replicas per worker.")
      if self._deferred and tf.executing_eagerly():
        self._pending[name] = value
      else:
        ops.extend(c.assign(value[i]) for i, c in enumerate(copies))
    if self._on_restore is not None:
      self._on_restore()
    return tf.group(ops) if ops else None

  def apply_pending(self):
    for name, value in self._pending.items():
      for i, c in enumerate(self._copies(self._variables[name])):
        c.assign(value[i])
    self._pending.clear()


class _VarState:
  """Compensation state of one model variable (kept out of automatic checkpoint tracking)."""

  def __init__(self, var, sum_, end=None, momentum=None):
    self.var, self.sum, self.end, self.momentum = var, sum_, end, momentum


@keras.utils.register_keras_serializable(package="tf_gba")
class DTS(wrapping.InnerOptimizerDelegation, keras.optimizers.Optimizer):
  """Delayed (`delay`) and temporally sparse (`period`) SGD / momentum SGD with compensation.

  tf_keras internals kept (no public equivalent): `inner._trackable_children` (the SGD's
  checkpoint entries stand in DTS's place: Sync <-> DTS switching) and the base class's
  `_build_index_dict` / `_var_key` (matching Keras' gradients to the built variables).

  Args:
    inner: a `tf_keras.optimizers.SGD` with a constant learning rate; its `momentum` (0 for
      plain SGD) is the local update's. Create it, and DTS, under the strategy's scope.
    delay: t >= 1; the exchange started after step s is consumed at the end of step s + t - 1.
    period: p >= 1; one exchange per p steps.
    name: name scope of the state variables.
  """

  def __init__(self, inner: keras.optimizers.Optimizer, delay: int = 1, period: int = 1,
               name: str = "DTS", **kwargs):
    if isinstance(inner, dict):
      inner = keras.optimizers.deserialize(inner)
    if not isinstance(inner, keras.optimizers.SGD):
      raise ValueError(
          f"DTS's inner optimizer must be a tf_keras.optimizers.SGD (momentum allowed), got "
          f"{inner!r}: its compensation is defined for (momentum) SGD only.")
    delay = arguments.integer("delay (1 = synchronous)", delay, minimum=1, owner="DTS")
    period = arguments.integer("period (1 = every step)", period, minimum=1, owner="DTS")
    # The public config names a schedule (a dict) where the learning rate is not a number.
    if isinstance(inner.get_config()["learning_rate"], dict):
      raise ValueError("DTS needs a constant learning rate (its corrections assume it): pass "
                       "SGD(learning_rate=<float>), not a schedule.")
    unsupported = [n for n in ("nesterov", "clipnorm", "clipvalue", "global_clipnorm",
                               "weight_decay", "use_ema") if getattr(inner, n, None)]
    if unsupported:
      raise ValueError(f"DTS's inner SGD must not set {', '.join(unsupported)}: the compensation "
                       "replays plain (momentum) SGD steps.")
    if not 0.0 <= inner.momentum < 1.0:
      raise ValueError(f"momentum must be in [0, 1), got {inner.momentum!r}")
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, (tf.distribute.MirroredStrategy,
                                 tf.distribute.MultiWorkerMirroredStrategy)):
      raise RuntimeError(
          "DTS runs under a MirroredStrategy or MultiWorkerMirroredStrategy: create the model, the "
          "SGD and DTS inside `with strategy.scope():`.")
    if not strategy.extended.variable_created_in_scope(inner.iterations):
      raise RuntimeError("DTS's inner SGD was created outside the strategy's scope: create it "
                         "inside `with strategy.scope():`, like DTS.")
    kwargs.pop("jit_compile", None)
    kwargs.pop("is_legacy_optimizer", None)
    super().__init__(name=name, jit_compile=False, **kwargs)
    self._inner = inner
    self.momentum = float(inner.momentum)
    self.delay = int(delay)
    self.period = int(period)
    self.num_slots = math.ceil((self.delay - 1) / self.period) + 1
    self.restore_generation = 0
    self._strategy = strategy
    self._state: List[_VarState] = []
    self._dts_state = tf.Module(name="dts_state")
    self.local_models: Optional[_PerReplicaCopies] = None
    self.exchange_driver = None  # Set by the driver of the schedule (callback or trainer).

  # ---- delegation to the inner SGD (iterations, learning rate, variables: wrapping.py) -----------
  @property
  def strategy(self) -> tf.distribute.Strategy:
    """The strategy DTS was created under (its replicas are the local models)."""
    return self._strategy

  @property
  def inner(self) -> str:
    """"momentum" or "sgd": the local update rule."""
    return "momentum" if self.momentum else "sgd"

  def _wrapper_state(self):
    # Beside the inner SGD's children (iterations, momentum slots): a checkpoint of synchronous
    # training with the same SGD restores into DTS and back; the compensation state and the
    # per-replica copies are the added "dts" entry.
    return "dts", self._dts_state

  # ----------------------------------------------------------------------------------------------
  # Schedule: pure functions of the step number, identical on every worker.

  def round_of(self, step: int) -> int:
    return step // self.period

  def round_end(self, rnd: int) -> int:
    """The last step of round `rnd`, after which its exchange starts."""
    return rnd * self.period + self.period - 1

  def slot_of(self, rnd: int) -> int:
    return rnd % self.num_slots

  def is_round_end(self, step: int) -> bool:
    return step % self.period == self.period - 1

  def due_round(self, step: int) -> Optional[int]:
    """The round whose exchange is consumed at the end of `step`, if any."""
    last = step - (self.delay - 1)
    if last >= 0 and self.is_round_end(last):
      return self.round_of(last)
    return None

  def rounds_in_flight(self, steps_done: int) -> List[int]:
    """Rounds started but not yet consumed once `steps_done` steps have fully run."""
    if steps_done <= 0:
      return []
    last_step = steps_done - 1
    first = self.round_of(max(0, last_step - self.delay - self.period + 1))
    started = [r for r in range(first, self.round_of(last_step) + 1)
               if self.round_end(r) <= last_step]
    return [r for r in started if self.round_end(r) + self.delay - 1 > last_step]

  def coefficients(self, lag: int) -> Tuple[float, float]:
    """(`m**lag`, `m * c_lag`) of a correction consumed `lag` steps after its round ended."""
    m = self.momentum
    c = sum(m ** k for k in range(lag))
    return m ** lag, m * c

  # ----------------------------------------------------------------------------------------------
  # State.

  @property
  def built(self) -> bool:
    return bool(self._state)

  @built.setter
  def built(self, value):
    del value  # The tf_keras base class sets it; `built` here means "the state exists".

  @property
  def num_local_replicas(self) -> int:
    """Replicas of this process (each holds its own copy of the model and of the state)."""
    self._check_built()
    return len(self._strategy.experimental_local_results(self.iterations))

  def build(self, var_list: Sequence[tf.Variable]):
    """Creates the state for `var_list` (and the inner SGD's slots); idempotent."""
    if self.built:
      return
    var_list = list(var_list)
    with tf.init_scope(), self._strategy.scope():
      self._inner.build(var_list)
      self._build_index_dict(var_list)
      # SGD creates one momentum slot per variable, in `var_list` order.
      slots = self._inner.momentums
      copies, models = {}, {}
      with tf.name_scope(self.name):
        for i, var in enumerate(var_list):
          shape = [self.num_slots] + var.shape.as_list()
          zeros = lambda shape=shape, dtype=var.dtype: tf.zeros(shape, dtype)
          state = _VarState(var, tf.Variable(zeros, trainable=False, name=f"sum_{i}"))
          copies[f"sum_{i}"] = state.sum
          models[f"var_{i}"] = var
          if self.momentum:
            state.end = tf.Variable(zeros, trainable=False, name=f"end_{i}")
            state.momentum = slots[i]
            copies[f"end_{i}"] = state.end
            models[f"momentum_{i}"] = state.momentum
          self._state.append(state)
      # Attribute assignment makes these checkpoint dependencies (by name, so a restore that ran
      # before build() is applied now).
      self._dts_state.state = _PerReplicaCopies(self._strategy, copies, on_restore=self._restored)
      if self.num_local_replicas > 1:
        # The model and its momentum slots are mirrored variables, which a plain checkpoint keeps
        # one copy of; their own restore writes that copy everywhere, so these copies are written
        # after it, by finish_restore().
        self.local_models = _PerReplicaCopies(self._strategy, models, deferred=True,
                                              on_restore=self._restored)
        self._dts_state.local_models = self.local_models

  def local_state(self, index: int) -> Dict[str, np.ndarray]:
    """The compensation state of built variable `index`, stacked over the local replicas.

    Keys: "sum" (`[replicas, num_slots, *shape]`), and for momentum "end" (same shape) and
    "momentum" (`[replicas, *shape]`: the paper's `u`, i.e. SGD's slot divided by `-lr`). For
    inspection and tests.
    """
    self._check_built()
    state = self._state[index]
    out = {}
    for name, v in (("sum", state.sum), ("end", state.end), ("momentum", state.momentum)):
      if v is not None:
        out[name] = np.stack([c.numpy() for c in self._strategy.experimental_local_results(v)])
    if "momentum" in out:
      out["momentum"] = out["momentum"] / -float(self._inner.learning_rate.numpy())
    return out

  def _restored(self):
    self.restore_generation += 1

  def finish_restore(self):
    """Writes the restored per-replica model copies (after the model's own restore)."""
    if self.local_models is not None:
      self.local_models.apply_pending()

  def get_config(self) -> dict:
    return {"name": self.name, "inner": keras.optimizers.serialize(self._inner),
            "delay": self.delay, "period": self.period}

  @classmethod
  def from_config(cls, config: dict, custom_objects=None) -> "DTS":
    # Deep: tf_keras' deserialize rewrites the class name inside the dict it is given.
    config = copy.deepcopy(config)
    inner = keras.optimizers.deserialize(config.pop("inner"), custom_objects=custom_objects)
    return cls(inner, **config)

  def exchange_callback(self, latency_ms: float = 0.0, exchange_timeout_s: float = 600.0,
                        synchronize_at_end: bool = True):
    """The Keras callback that runs DTS's exchanges under `model.fit` (pass it to fit)."""
    # Imported here: the runtime lives in tf_gba.distribute, the layer below this one.
    from tf_gba.distribute import dts_training  # pylint: disable=g-import-not-at-top
    return dts_training.DTSExchangeCallback(self, latency_ms=latency_ms,
                                            exchange_timeout_s=exchange_timeout_s,
                                            synchronize_at_end=synchronize_at_end)

  # ----------------------------------------------------------------------------------------------
  # Keras entry: `model.fit` calls this in replica context with the replica's gradients.

  def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False,
                      **kwargs):
    """The local step of every replica (no collective); `exchange_callback()` does the rest."""
    del name, skip_gradients_aggregation, kwargs
    if tf.distribute.get_strategy() is not self._strategy:
      raise RuntimeError("DTS was created under a different strategy than the one applying it: "
                         "create the model, the SGD and DTS under the same `strategy.scope()`.")
    if self.exchange_driver is None:
      raise RuntimeError("DTS under model.fit needs its exchange: pass "
                         "callbacks=[optimizer.exchange_callback()] to fit.")
    grads_and_vars = list(grads_and_vars)
    context = tf.distribute.get_replica_context()
    if context is None:
      raise RuntimeError("DTS.apply_gradients runs in replica context (inside strategy.run or "
                         "model.fit); in a custom loop use DTSTrainer.")
    return context.merge_call(self._apply_merged, args=(grads_and_vars,))

  def _apply_merged(self, strategy, grads_and_vars):
    del strategy
    if not self.built:
      self.build([v for _, v in grads_and_vars])
    by_key = {self._var_key(v): g for g, v in grads_and_vars}
    # Keras scales each replica's loss by 1 / replicas so that the strategy's sum of the replicas'
    # gradients is the mean: a replica's own step uses its gradient unscaled.
    scale = float(self._strategy.num_replicas_in_sync)
    grads = [by_key.get(self._var_key(state.var)) for state in self._state]
    steps = self.iterations.read_value()
    slot = tf.cast((steps // self.period) % self.num_slots, tf.int32)
    self.apply_local(grads, slot, scale=scale)
    return self.iterations

  def update_step(self, gradient, variable):
    raise NotImplementedError("DTS applies through apply_gradients(); call that instead.")

  # ----------------------------------------------------------------------------------------------
  # Updates, called in cross-replica context (inside tf.function) with per-replica values. Their
  # loops run over variables and replicas in Python, so autograph has nothing to convert (and
  # converting them made tracing several times slower).

  def _check_built(self):
    if not self.built:
      raise RuntimeError("DTS is not built yet: call optimizer.build(var_list) first.")

  @tf.autograph.experimental.do_not_convert
  def apply_local(self, grads, slot, scale: float = 1.0):
    """Local step on every replica: update its model copy and accumulate into round slot `slot`.

    Args:
      grads: list (one per built variable) of per-replica gradients (Tensor or IndexedSlices;
        None means zero).
      slot: int32 scalar tensor, `slot_of(round_of(step))`.
      scale: factor on every gradient (Keras' per-replica loss scaling undone).
    """
    self._check_built()
    if len(grads) != len(self._state):
      raise ValueError(f"expected {len(self._state)} gradients, got {len(grads)}")
    for state, grad in zip(self._state, grads):
      if grad is None:
        continue
      var_copies = self._strategy.experimental_local_results(state.var)
      for r, g in enumerate(self._strategy.experimental_local_results(grad)):
        if scale != 1.0:
          g = (tf.IndexedSlices(g.values * scale, g.indices, g.dense_shape)
               if isinstance(g, tf.IndexedSlices) else g * scale)
        with tf.device(var_copies[r].device):
          self._apply_local_one(state, r, var_copies[r], g, slot)
    self.iterations.assign_add(1)

  def _copy(self, var, r):
    return self._strategy.experimental_local_results(var)[r]

  def _apply_local_one(self, state, r, var, g, slot):
    lr = tf.cast(self.learning_rate, var.dtype)
    total = self._copy(state.sum, r)
    if self.inner == "sgd":
      if isinstance(g, tf.IndexedSlices):
        var.scatter_sub(tf.IndexedSlices(lr * g.values, g.indices, g.dense_shape))
        idx = tf.cast(g.indices, tf.int64)
        rows = tf.stack([tf.fill(tf.shape(idx), tf.cast(slot, tf.int64)), idx], axis=1)
        total.scatter_nd_add(rows, g.values)
      else:
        var.assign_sub(lr * g)
        total.scatter_nd_add([[slot]], g[None])
      return
    g = tf.convert_to_tensor(g)
    m = tf.cast(self.momentum, var.dtype)
    # SGD's slot is the velocity v = -lr * u, updated exactly as tf_keras SGD does.
    v = self._copy(state.momentum, r)
    end = self._copy(state.end, r)
    v_new = v.assign(-g * lr + v * m)
    var.assign_add(v_new)
    restarted = m * tf.gather(end, slot) + g
    end.scatter_nd_update([[slot]], restarted[None])
    total.scatter_nd_add([[slot]], restarted[None])

  @tf.autograph.experimental.do_not_convert
  def payload(self, slot):
    """Per-replica values to all-reduce for the round in `slot` (call after its last step)."""
    self._check_built()
    tensors = [s.sum for s in self._state]
    if self.inner == "momentum":
      tensors += [s.end for s in self._state]
    # Reading a mirrored variable in replica context gives that replica's own copy.
    return self._strategy.run(lambda: [tf.gather(t, slot) for t in tensors])

  @tf.autograph.experimental.do_not_convert
  def compensate(self, mean_payload, slot, u_coef, w_coef):
    """Replaces the round's local gradients by their all-reduced mean; frees the slot.

    Args:
      mean_payload: the all-reduced `payload(slot)` (per replica, every copy the same mean).
      slot: int32 scalar tensor.
      u_coef, w_coef: `coefficients(lag)` as scalar tensors.
    """
    self._check_built()
    means = per_replica_nests(self._strategy, mean_payload)
    n = len(self._state)
    for i, state in enumerate(self._state):
      var_copies = self._strategy.experimental_local_results(state.var)
      for r, mean in enumerate(means):
        var = var_copies[r]
        with tf.device(var.device):
          lr = tf.cast(self.learning_rate, var.dtype)
          total = self._copy(state.sum, r)
          d_sum = mean[i] - tf.gather(total, slot)
          zero = tf.zeros_like(d_sum)[None]
          total.scatter_nd_update([[slot]], zero)
          if self.inner == "sgd":
            var.assign_sub(lr * d_sum)
            continue
          end = self._copy(state.end, r)
          d_end = mean[n + i] - tf.gather(end, slot)
          end.scatter_nd_update([[slot]], zero)
          self._copy(state.momentum, r).assign_sub(lr * tf.cast(u_coef, var.dtype) * d_end)
          var.assign_sub(lr * (d_sum + tf.cast(w_coef, var.dtype) * d_end))
