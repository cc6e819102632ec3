"""AdaptiveRevision: delay-tolerant AdaGrad for asynchronous parameter-server training.

McMahan & Streeter, "Delay-Tolerant Algorithms for Asynchronous Distributed Online Learning"
(NIPS 2014), Algorithm 1; SPEC section 2. Every coordinate keeps, besides the parameter x, the sum
`gbar` of all gradients applied so far and two accumulators `z`, `z'` (slots `gbar`, `z`,
`z_prime`; `gbar = 0`, `z = z' = G0` initially). A worker reads `gbar` together with the
parameters, and sends the value it read (`gbar_old`) back with its gradient `g`. The update then
knows the gradients applied while `g` was outstanding, `g_bck = gbar - gbar_old`, grows the
accumulator by `g^2 + 2 g g_bck` instead of AdaGrad's `g^2`, and revises the steps already taken
for `g_bck` to the new, smaller learning rate. Without delay (`gbar_old == gbar`) it is AdaGrad
with initial accumulator G0 and learning rate `alpha`.

Where `gbar_old` comes from, in order of precedence:

1. `apply_with_gbar_old(grads_and_vars, gbar_olds)`: given explicitly (tests, simulated delays).
2. The strategy's pre-step reader: under a strategy with `register_pre_step_reader`
   (`tf_gba.distribute.GBAStrategy`), `build()` registers a reader that snapshots every `gbar`
   slot at the start of each step, before the forward pass reads the parameters, and
   `apply_gradients` takes the snapshot from `tf_gba.distribute.step_context.current().reads`.
   The reader must be registered before the step function is traced: call
   `optimizer.build(model.trainable_variables)` under the strategy scope before `model.fit` or
   the first `strategy.run` (otherwise the first trace builds the optimizer too late, and the
   fallback below is used for every step of that trace; a warning says so).
3. Fallback (no hook, single process, or the step was traced before `build`): `gbar` is read at
   apply time, which gives `g_bck` ~ 0, i.e. plain AdaGrad (AsyncAdaGrad-GD when there is
   concurrency). That is exact when nothing else updates the variables concurrently.

Cost of the snapshot (2.): it stays on the variable's parameter server and is never sent over the
network; gathering the gradient's rows from it also happens there. For a dense variable the read
shares the slot's buffer, and the update then copies the slot once (copy-on-write, O(size)). For
an embedding table updated sparsely the slot is in copy-on-read mode, so each step copies the
whole `gbar` table on its parameter server (O(rows x dim) memory traffic and one table-sized
temporary per in-flight step). An exact scheme that only reads the rows of the batch needs the ids
before the forward pass, which a parameter-free reader does not have.

Example:

  >>> opt = AdaptiveRevision(alpha=0.1, g0=1.0)
  >>> var = tf.Variable([1.0, 2.0])
  >>> opt.build([var])
  >>> gbar_old = opt.read_state([var])             # the Read, with the parameters
  >>> grads = [tf.constant([0.5, -1.0])]           # computed from var as read
  >>> opt.apply_with_gbar_old(zip(grads, [var]), gbar_old)
"""

import contextlib
import itertools
import numbers
import threading
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from absl import logging
import tensorflow as tf
import tf_keras as keras

from tf_gba.common import arguments
from tf_gba.common import keras_apply
from tf_gba.distribute import step_context
from tf_gba.ops import adaptive_revision_ops

SLOT_NAMES = ("gbar", "z", "z_prime")

_reader_ids = itertools.count()
# gbar_old tensors for the apply_gradients call in progress: (optimizer id, graph id) -> a stack of
# {variable index: gbar_old}. `update_step` is called by the tf_keras base class with only
# (gradient, variable), so the snapshot travels beside it. Keyed by graph, not thread: under a
# distribution strategy `apply_gradients` runs in a replica thread but `update_step` runs in the
# merge_call, on the strategy's own thread (ParameterServerStrategy runs each replica in a thread
# of its own), tracing into the same graph.
_pending: Dict[Tuple[int, int], List[Dict[int, Any]]] = {}
_pending_lock = threading.Lock()


def _graph_key(optimizer_id: int) -> Tuple[int, int]:
  return optimizer_id, id(tf.compat.v1.get_default_graph())


@contextlib.contextmanager
def _pending_gbar_olds(optimizer_id: int, gbar_olds: Dict[int, Any]):
  key = _graph_key(optimizer_id)
  with _pending_lock:
    _pending.setdefault(key, []).append(gbar_olds)
  try:
    yield
  finally:
    with _pending_lock:
      stack = _pending[key]
      stack.remove(gbar_olds)
      if not stack:
        del _pending[key]


def _current_gbar_olds(optimizer_id: int) -> Dict[int, Any]:
  with _pending_lock:
    stack = _pending.get(_graph_key(optimizer_id))
    return stack[-1] if stack else {}


def _check_strategy(what: str) -> None:
  """Refuses a distribution strategy without a pre-step reader hook.

  Distributed, gbar_old must be read before each step (by GBAStrategy); without the hook every
  update would silently be plain AdaGrad. Outside any strategy (one process, no delay) AdaGrad is
  what Algorithm 1 reduces to.
  """
  if not tf.distribute.has_strategy():
    return
  strategy = tf.distribute.get_strategy()
  if not hasattr(strategy, "register_pre_step_reader"):
    raise RuntimeError(
        f"AdaptiveRevision needs tf_gba.distribute.GBAStrategy (it reads gbar before each step) "
        f"but was {what} under {type(strategy).__name__}: create, build and train it inside "
        "GBAStrategy's scope.")


@keras.utils.register_keras_serializable(package="tf_gba")
class AdaptiveRevision(keras.optimizers.Optimizer):
  """Optimizer implementing AdaptiveRevision (McMahan & Streeter 2014, Algorithm 1).

  Per coordinate, with `g` the gradient and `gbar_old` the `gbar` read with the parameters:

      g_bck = gbar - gbar_old;  eta_old = alpha / sqrt(z')
      z += g^2 + 2 g g_bck;     z' = max(z, z') (use_max) or z;  eta = alpha / sqrt(z')
      x += -eta g + (eta_old - eta) g_bck;  gbar += g

  applied atomically per coordinate on the variable's device by the custom kernels of
  `tf_gba.ops.adaptive_revision_ops`. Sparse gradients (`tf.IndexedSlices`, e.g. of embedding
  lookups) update only their rows; duplicate ids are summed first.

  Args:
    alpha: learning-rate scale (the optimizer's `learning_rate`): a float or a
      `LearningRateSchedule`. A schedule changes alpha for future updates; the revision of
      outstanding steps then uses the current alpha.
    g0: G0 > 0, the initial value of z and z' (the paper uses 1).
    use_max: True: AdaptiveRevision, with z' = max(z, z') so learning rates never increase.
      False: the paper's AdaptiveRevision*, learning rate from z itself; with the minibatch delay
      pattern it equals AdaGrad on the minibatch sums (footnote 5), but under other delay
      patterns z can decrease and, rarely, reach <= 0, which fails the update with an error.
    name: name of the optimizer.
    **kwargs: the tf_keras optimizer arguments (clipnorm, clipvalue, global_clipnorm,
      weight_decay, use_ema, ...). `jit_compile` must be False: the kernels cannot be compiled by
      XLA.

  Example:

    >>> with strategy.scope():                    # e.g. tf_gba.distribute.GBAStrategy
    ...   model = build_model()
    ...   opt = AdaptiveRevision(alpha=0.05)
    ...   opt.build(model.trainable_variables)    # registers the gbar snapshot reader
    ...   model.compile(optimizer=opt, loss="binary_crossentropy")
  """

  def __init__(self, alpha=0.1, g0: float = 1.0, use_max: bool = True,
               name: str = "AdaptiveRevision", **kwargs):
    if kwargs.pop("jit_compile", False):
      raise ValueError("AdaptiveRevision runs custom kernels that XLA cannot compile; "
                       "pass jit_compile=False (the default).")
    if "learning_rate" in kwargs:
      raise TypeError("AdaptiveRevision calls its learning-rate scale `alpha`; pass alpha=... "
                      "instead of learning_rate=...")
    if alpha is None or isinstance(alpha, (numbers.Number, str)):  # (schedules, variables: as
      # Keras takes them)
      arguments.number("alpha (the learning-rate scale)", alpha, minimum=0.0, inclusive=False,
                       owner="AdaptiveRevision")
    g0 = arguments.number("g0 (the initial accumulator G0)", g0, minimum=0.0, inclusive=False,
                          owner="AdaptiveRevision")
    if not isinstance(use_max, (bool, int)):
      raise TypeError(f"AdaptiveRevision: use_max must be a bool, got {use_max!r}.")
    _check_strategy("created")
    super().__init__(name=name, jit_compile=False, **kwargs)
    self._learning_rate = self._build_learning_rate(alpha)
    self.g0 = g0
    self.use_max = bool(use_max)
    self._pre_step_reader_name: Optional[str] = None
    self._warned_fallback = False

  # --- Hyper-parameters -------------------------------------------------------------------------

  @property
  def alpha(self):
    """The learning-rate scale alpha (same as `learning_rate`)."""
    return self.learning_rate

  @alpha.setter
  def alpha(self, value):
    self.learning_rate = value

  @property
  def pre_step_reader_name(self) -> Optional[str]:
    """Key of this optimizer's gbar snapshot in `step_context.current().reads`, once built under
    a strategy with a pre-step reader hook; None otherwise."""
    return self._pre_step_reader_name

  # --- Slots ------------------------------------------------------------------------------------

  def build(self, var_list):
    """Creates the slots `gbar` (0), `z` and `z_prime` (G0) of every variable.

    Under a strategy with `register_pre_step_reader`, also registers the per-step gbar snapshot.

    Args:
      var_list: the trainable variables this optimizer will update.
    """
    super().build(var_list)
    if getattr(self, "_built", False):
      return
    self._built = True
    self._gbar, self._z, self._z_prime = [], [], []
    for var in var_list:
      dtype = getattr(var, "true_dtype", var.dtype)
      self._gbar.append(self.add_variable_from_reference(var, "gbar"))
      for slots, slot_name in ((self._z, "z"), (self._z_prime, "z_prime")):
        slots.append(self.add_variable_from_reference(
            var, slot_name, initial_value=tf.fill(var.shape, tf.constant(self.g0, dtype))))
    self._maybe_register_pre_step_reader()

  def get_slot(self, var, slot_name: str) -> tf.Variable:
    """Returns the slot `slot_name` ("gbar", "z" or "z_prime") of `var`."""
    if slot_name not in SLOT_NAMES:
      raise ValueError(f"Unknown slot {slot_name!r}; AdaptiveRevision has slots {SLOT_NAMES}.")
    index = self._var_index(var)
    return {"gbar": self._gbar, "z": self._z, "z_prime": self._z_prime}[slot_name][index]

  def _var_index(self, var) -> int:
    if not getattr(self, "_built", False):
      raise ValueError("The optimizer is not built yet: call optimizer.build(var_list) first.")
    key = self._var_key(var)
    if key not in self._index_dict:
      raise KeyError(f"Variable {var.name} is not one this optimizer was built with.")
    return self._index_dict[key]

  # --- Reads ------------------------------------------------------------------------------------

  def _maybe_register_pre_step_reader(self):
    strategy = self._distribution_strategy
    if not hasattr(strategy, "register_pre_step_reader"):
      strategy = tf.distribute.get_strategy()
    register = getattr(strategy, "register_pre_step_reader", None)
    if register is None:
      _check_strategy("built")
      return
    self._pre_step_reader_name = f"AdaptiveRevision/{self.name}/gbar/{next(_reader_ids)}"
    register(self._pre_step_reader_name, self._snapshot_all_gbar)

  def _snapshot_all_gbar(self) -> List[tf.Tensor]:
    # On each slot's own device, so that a snapshot on a parameter server stays there.
    snapshots = []
    for gbar in self._gbar:
      with tf.device(gbar.device):
        snapshots.append(tf.identity(gbar.read_value()))
    return snapshots

  def read_state(self, var_list: Sequence[tf.Variable],
                 indices: Optional[Sequence[Any]] = None) -> List[Any]:
    """Reads the gbar slots: the Read of Algorithm 1, to be done with the parameter read.

    Builds the optimizer on `var_list` if it is not built yet.

    Args:
      var_list: variables whose gbar to read.
      indices: optional, one entry per variable: None reads the whole slot; an integer vector
        reads only those rows (for embedding tables), returned as `tf.IndexedSlices`.

    Returns:
      One snapshot per variable: a tensor of the variable's shape, or `tf.IndexedSlices` of the
      rows asked for. Pass them to `apply_with_gbar_old`. Later updates do not change them.
    """
    var_list = list(var_list)
    if not getattr(self, "_built", False):
      with tf.init_scope():
        self.build(var_list)
    if indices is None:
      indices = [None] * len(var_list)
    if len(indices) != len(var_list):
      raise ValueError(f"indices has {len(indices)} entries for {len(var_list)} variables.")
    out = []
    for var, idx in zip(var_list, indices):
      gbar = self.get_slot(var, "gbar")
      with tf.device(gbar.device):
        if idx is None:
          out.append(tf.identity(gbar.read_value()))
        else:
          idx = tf.convert_to_tensor(idx)
          out.append(tf.IndexedSlices(tf.gather(gbar, idx), idx,
                                      tf.shape(gbar, out_type=idx.dtype)))
    return out

  # --- Updates ----------------------------------------------------------------------------------

  def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False,
                      **kwargs):
    """Applies gradients, with gbar_old from the step's pre-step read when there is one.

    See the module docstring for where gbar_old comes from and the fallback without it.
    """
    _check_strategy("applied")
    gbar_olds = {}
    info = step_context.current()
    name_ = self._pre_step_reader_name
    if info is not None and name_ is not None and name_ in info.reads:
      gbar_olds = dict(enumerate(info.reads[name_]))
    elif info is not None and not self._warned_fallback:
      self._warned_fallback = True
      logging.warning(
          "AdaptiveRevision %r: this step has no gbar snapshot (the optimizer was built after the "
          "step function started tracing), so it applies plain AdaGrad updates (g_bck = 0). Call "
          "optimizer.build(model.trainable_variables) under the strategy scope before training.",
          self.name)
    with _pending_gbar_olds(id(self), gbar_olds):
      return super().apply_gradients(grads_and_vars, name=name,
                                     skip_gradients_aggregation=skip_gradients_aggregation,
                                     **kwargs)

  def apply_with_gbar_old(self, grads_and_vars: Iterable[Tuple[Any, tf.Variable]],
                          gbar_olds: Sequence[Any], name: Optional[str] = None,
                          skip_gradients_aggregation: bool = False):
    """Applies gradients computed from parameters read together with `gbar_olds`.

    The explicit form of Algorithm 1's Update(g, gbar_old), for tests and simulated delays.

    Args:
      grads_and_vars: (gradient, variable) pairs; gradients dense or `tf.IndexedSlices`.
      gbar_olds: one per pair, as returned by `read_state`: a tensor of the variable's shape (for
        sparse gradients the rows are gathered from it), or `tf.IndexedSlices` holding the gbar
        rows of (at least) every index of the sparse gradient.
      name: name scope, as for `apply_gradients`.
      skip_gradients_aggregation: as for `apply_gradients`.

    Returns:
      The iterations variable, as `apply_gradients`.
    """
    grads_and_vars = list(grads_and_vars)
    gbar_olds = list(gbar_olds)
    if len(gbar_olds) != len(grads_and_vars):
      raise ValueError(f"Got {len(gbar_olds)} gbar_olds for {len(grads_and_vars)} "
                       "(gradient, variable) pairs; pass one per pair.")
    variables = [v for _, v in grads_and_vars]
    with tf.init_scope():
      self.build(variables)
    by_index = {self._var_index(v): g for v, g in zip(variables, gbar_olds)}
    with _pending_gbar_olds(id(self), by_index):
      return super().apply_gradients(grads_and_vars, name=name,
                                     skip_gradients_aggregation=skip_gradients_aggregation)

  def update_step(self, gradient, variable):
    """Applies Algorithm 1's Update to `variable` (called by tf_keras on the variable's device)."""
    index = self._index_dict[self._var_key(variable)]
    gbar, z, z_prime = self._gbar[index], self._z[index], self._z_prime[index]
    gbar_old = _current_gbar_olds(id(self)).get(index)
    alpha = tf.cast(self.learning_rate, variable.dtype)
    if isinstance(gradient, tf.IndexedSlices):
      rows = self._gbar_old_rows(gbar_old, gradient.indices, gbar)
      return adaptive_revision_ops.resource_sparse_apply_adaptive_revision(
          variable, gbar, z, z_prime, alpha, gradient.values, gradient.indices, rows,
          use_max=self.use_max)
    if gbar_old is None:
      # Fallback: read now, so g_bck = 0 (AdaGrad); see the module docstring.
      gbar_old = gbar.read_value()
    elif isinstance(gbar_old, tf.IndexedSlices):
      raise ValueError(f"Variable {variable.name} got a dense gradient but its gbar_old holds "
                       "only some rows; read the whole slot (read_state without indices).")
    return adaptive_revision_ops.resource_apply_adaptive_revision(
        variable, gbar, z, z_prime, alpha, gradient, gbar_old, use_max=self.use_max)

  @staticmethod
  def _gbar_old_rows(gbar_old, indices, gbar):
    """The gbar_old rows at `indices` from a full snapshot, a row snapshot, or (None) gbar now."""
    if gbar_old is None:
      return tf.gather(gbar, indices)
    if not isinstance(gbar_old, tf.IndexedSlices):
      return tf.gather(gbar_old, indices)
    # A row snapshot: find each gradient index among the snapshot's indices.
    have = tf.cast(gbar_old.indices, tf.int64)
    want = tf.cast(indices, tf.int64)
    order = tf.argsort(have, stable=True)
    sorted_have = tf.gather(have, order)
    pos = tf.minimum(tf.searchsorted(sorted_have, want), tf.maximum(tf.size(have) - 1, 0))
    found = tf.gather(sorted_have, pos)
    check = tf.debugging.assert_equal(
        found, want, message="gbar_old (tf.IndexedSlices) has no row for some index of the "
        "sparse gradient; read_state must be given the ids the gradient was computed for")
    with tf.control_dependencies([check]):
      return tf.gather(gbar_old.values, tf.gather(order, pos))

  # --- Serialisation ----------------------------------------------------------------------------

  def get_config(self):
    config = super().get_config()
    alpha = self._serialize_hyperparameter(self._learning_rate)
    config.update({
        "alpha": alpha if isinstance(alpha, dict) else float(alpha),
        "g0": self.g0,
        "use_max": self.use_max,
    })
    return config

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    if isinstance(config.get("alpha"), dict):
      config["alpha"] = keras.optimizers.schedules.deserialize(
          config["alpha"], custom_objects=custom_objects)
    return cls(**config)


# Asynchronous by design (each update revises for the delay it saw): GBAStrategy's buffered modes
# let it apply every gradient on arrival, as its mode="async" does (tf_gba.common.keras_apply).
setattr(AdaptiveRevision, keras_apply.ASYNCHRONOUS, True)
