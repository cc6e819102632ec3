"""DTS: delayed and temporally sparse synchronous updates with error compensation (seed 004).

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

Design. This module owns the SGD / momentum update instead of wrapping a tf_keras optimizer,
because the compensation is defined on the paper's momentum `u` (`u = m*u + g; w -= lr*u`, Eq. 4)
and tf_keras SGD's velocity equals `-lr*u` only while the learning rate is constant; owning the
update keeps every correction exact. The replicas' local models are the per-device copies of the
model's mirrored variables (under `MirroredStrategy` one copy per logical device, under
`MultiWorkerMirroredStrategy` one per worker): every update here writes each copy with its own
replica's values (`strategy.experimental_local_results`), never through the strategy's
synchronising assign, so the copies diverge between corrections as the algorithm requires.
The caller drives the schedule; `tf_gba.distribute.dts_training.DTSTrainer` does it with a real
background all-reduce.

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

Checkpoints: `tf.train.Checkpoint(optimizer=dts, ...)` saves `iterations` and *every replica's*
copy of the compensation state (a plain checkpoint of a mirrored variable keeps only the first
copy). With several replicas in one process it also saves every replica's copy of the model
variables; those are written back by `finish_restore()` (the trainer calls it before its next
step), after the model's own restore, which would otherwise overwrite all copies with the first.
Under `MultiWorkerMirroredStrategy` each worker holds only its own copies, so each worker must save
to and restore from its own checkpoint path. Exchanges in flight are not saved: their inputs are
(the slots), and the trainer restarts them after a restore, which gives the same means.

Example:

  strategy = tf.distribute.MirroredStrategy(devices)
  with strategy.scope():
    model = make_model()
    dts = DTS("momentum", learning_rate=0.05, momentum=0.9, delay=4, period=4)
    dts.build(model.trainable_variables)
  trainer = tf_gba.distribute.dts_training.DTSTrainer(strategy, dts, model.trainable_variables,
                                                      loss_fn)
"""

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

_INNER = ("sgd", "momentum")


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


class DTS(tf.Module):
  """Delayed (`delay`) and temporally sparse (`period`) SGD / momentum SGD with compensation.

  Args:
    inner: "sgd" or "momentum": the local update rule.
    learning_rate: constant learning rate `lr` (the corrections assume it does not change).
    momentum: `m` for inner="momentum" (ignored for "sgd").
    delay: t >= 1; the exchange started after step s is consumed at the end of step s + t - 1.
    period: p >= 1; one exchange per p steps.
    name: name scope of the state variables.
  """

  def __init__(self, inner: str = "sgd", learning_rate: float = 0.01, momentum: float = 0.9,
               delay: int = 1, period: int = 1, name: str = "DTS"):
    super().__init__(name=name)
    if inner not in _INNER:
      raise ValueError(f"inner must be one of {_INNER}, got {inner!r}")
    if int(delay) != delay or delay < 1:
      raise ValueError(f"delay must be an integer >= 1 (1 = synchronous), got {delay!r}")
    if int(period) != period or period < 1:
      raise ValueError(f"period must be an integer >= 1 (1 = every step), got {period!r}")
    if inner == "momentum" and not 0.0 <= momentum < 1.0:
      raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    if learning_rate <= 0:
      raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}")
    self.inner = inner
    self.learning_rate = float(learning_rate)
    self.momentum = float(momentum) if inner == "momentum" else 0.0
    self.delay = int(delay)
    self.period = int(period)
    self.num_slots = math.ceil((self.delay - 1) / self.period) + 1
    self.restore_generation = 0
    self._strategy: Optional[tf.distribute.Strategy] = None
    self._state: List[_VarState] = []
    self.local_models: Optional[_PerReplicaCopies] = None
    self.iterations: Optional[tf.Variable] = None

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
    return self.iterations is not None

  @property
  def num_local_replicas(self) -> int:
    """Replicas of this process (each holds its own copy of the model and of the state)."""
    self._check_built()
    return len(self._strategy.experimental_local_results(self.iterations))

  def build(self, var_list: Sequence[tf.Variable]):
    """Creates the state for `var_list`; call once, under the strategy's scope."""
    if self.built:
      raise RuntimeError("DTS.build() was already called")
    self._strategy = tf.distribute.get_strategy()
    momentum = self.inner == "momentum"
    with self._strategy.scope(), tf.name_scope(self.name):
      self.iterations = tf.Variable(0, dtype=tf.int64, trainable=False, name="iterations")
      copies = {}
      for i, var in enumerate(var_list):
        slots = [self.num_slots] + var.shape.as_list()
        zeros = lambda shape=slots, dtype=var.dtype: tf.zeros(shape, dtype)
        state = _VarState(var, tf.Variable(zeros, trainable=False, name=f"sum_{i}"))
        copies[f"sum_{i}"] = state.sum
        if momentum:
          state.end = tf.Variable(zeros, trainable=False, name=f"end_{i}")
          state.momentum = tf.Variable(tf.zeros(var.shape, var.dtype), trainable=False,
                                       name=f"momentum_{i}")
          copies[f"end_{i}"] = state.end
          copies[f"momentum_{i}"] = state.momentum
        self._state.append(state)
    # Attribute assignment makes these checkpoint dependencies (by name, so a restore that ran
    # before build() is applied now).
    self.state = _PerReplicaCopies(self._strategy, copies, on_restore=self._restored)
    if self.num_local_replicas > 1:
      self.local_models = _PerReplicaCopies(
          self._strategy, {f"var_{i}": v for i, v in enumerate(var_list)}, deferred=True,
          on_restore=self._restored)

  def local_state(self, index: int) -> Dict[str, np.ndarray]:
    """The compensation state of built variable `index`, stacked over the local replicas.

    Keys: "sum" (`[replicas, num_slots, *shape]`), and for momentum "end" (same shape) and
    "momentum" (`[replicas, *shape]`). For inspection and tests.
    """
    self._check_built()
    state = self._state[index]
    named = {"sum": state.sum, "end": state.end, "momentum": state.momentum}
    return {name: np.stack([c.numpy() for c in self._strategy.experimental_local_results(v)])
            for name, v in named.items() if v is not None}

  def _restored(self):
    self.restore_generation += 1

  def finish_restore(self):
    """Writes the restored per-replica model copies (after the model's own restore)."""
    if self.local_models is not None:
      self.local_models.apply_pending()

  def get_config(self) -> dict:
    return {"inner": self.inner, "learning_rate": self.learning_rate, "momentum": self.momentum,
            "delay": self.delay, "period": self.period, "name": self.name}

  @classmethod
  def from_config(cls, config: dict) -> "DTS":
    return cls(**config)

  # ----------------------------------------------------------------------------------------------
  # Updates, called in cross-replica context (inside tf.function) with per-replica values. Their
  # loops run over variables and replicas in Python, so autograph has nothing to convert (and
  # converting them made tracing several times slower).

  def _check_built(self):
    if not self.built:
      raise RuntimeError("call DTS.build(var_list) under the strategy scope first")

  @tf.autograph.experimental.do_not_convert
  def apply_local(self, grads, slot):
    """Local step on every replica: update its model copy and accumulate into round slot `slot`.

    Args:
      grads: list (one per built variable) of per-replica gradients (Tensor or IndexedSlices;
        None means zero).
      slot: int32 scalar tensor, `slot_of(round_of(step))`.
    """
    self._check_built()
    if len(grads) != len(self._state):
      raise ValueError(f"expected {len(self._state)} gradients, got {len(grads)}")
    for state, grad in zip(self._state, grads):
      if grad is None:
        continue
      var_copies = self._strategy.experimental_local_results(state.var)
      for r, g in enumerate(self._strategy.experimental_local_results(grad)):
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
    u = self._copy(state.momentum, r)
    end = self._copy(state.end, r)
    u_new = u.assign(m * u + g)
    var.assign_sub(lr * u_new)
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
          self._copy(state.momentum, r).assign_add(tf.cast(u_coef, var.dtype) * d_end)
          var.assign_sub(lr * (d_sum + tf.cast(w_coef, var.dtype) * d_end))
