"""A step's dense reads of one parameter server's variables, sent to the worker as one tensor.

Under ParameterServerStrategy every variable a worker's step reads is a tensor the parameter
server sends on its own: one `RecvTensor` call that it serves, per variable and step. For DeepFM
that is one call per DNN kernel and bias, and the server's gRPC threads were half of its CPU
(docs/step_cost.md). `GBAStrategy` creates its variables as `PackableVariable`s, and inside a step
(`step_scope`) the first dense read of a variable on a parameter server reads every such variable
of that server at once there, concatenated into one tensor that the worker splits. Each read is
then served from its part of that tensor. The gradient pushes are packed the same way
(`tf_gba.optimizers.gba`), so a step costs each server one transfer each way for its dense
variables.

What a served read keeps of a plain one:
* its value: the same read of the same variable, in the same place of the step (after the step's
  token, before any update of the step);
* its gradient: every served read records itself on the tapes active at that moment as the
  `ReadVariableOp` of its variable would (`record_operation` with the variable's handle as input),
  so a tape opened after the pack was built still gets the gradient, and nothing else of the pack
  is on any tape: a variable that is also gathered (an embedding table) gets only its gathered
  rows' gradient, never a dense zero beside them, and keeps its per-ID staleness.

Which variables a pack holds: the trainable variables of that server and dtype, of at most
`MAX_ELEMENTS` elements (a large tensor gains little from sharing a transfer), that no step has
gathered (`sparse_read`, as `tf.gather` and embedding lookups do) and that were read densely in
the last step whose pack held them. A step traced before a small table's first gather may still
carry that table whole (at most `MAX_ELEMENTS`); later traces leave it out.

A pack serves a step's reads until the step updates what it holds: `close()` at the entry of
`apply_gradients` (tf_gba's optimizers, and tf_keras' through `keras_apply`), and any `assign*`
of a variable a pack may hold, end it, so a read after an update reads the variable itself.
Reads in another graph than the step's (a `tf.cond` branch, a loop's body inside the step) are
plain reads.
"""

import contextlib
import threading
import weakref
from typing import Callable, Dict, List, Optional

import tensorflow as tf
# TF internal (no public equivalent): the wrapper ParameterServerStrategy puts around each
# variable, the way a variable read records itself on tapes, and the raw read op.
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import ps_values
from tensorflow.python.eager import record
from tensorflow.python.ops import gen_resource_variable_ops
from tensorflow.python.ops import resource_variable_ops

MAX_ELEMENTS = 1 << 16

_local = threading.local()


class Registry:
  """The packable variables of one strategy (weakly: a model deleted leaves its packs)."""

  def __init__(self):
    self._variables: List[weakref.ref] = []
    self._lock = threading.Lock()

  def add(self, variable: "PackableVariable") -> None:
    with self._lock:
      self._variables = [r for r in self._variables if r() is not None]
      self._variables.append(weakref.ref(variable))

  def members(self, device: str, dtype: tf.DType) -> List["PackableVariable"]:
    with self._lock:
      alive = [r() for r in self._variables]
    return [v for v in alive if v is not None and v.device == device and v.dtype == dtype
            and v.packable()]


class _StepReads:
  """The packs of one traced step: per (device, dtype), each member's part on the worker."""

  def __init__(self, registry: Registry):
    self.registry = registry
    self.graph = tf.compat.v1.get_default_graph()
    self.parts: Dict[tuple, Dict[int, tf.Tensor]] = {}
    self.members: Dict[tuple, List["PackableVariable"]] = {}
    self.served = set()
    self.closed = False

  def serve(self, variable: "PackableVariable") -> tf.Tensor:
    key = (variable.device, variable.dtype)
    if key not in self.parts:
      members = self.registry.members(*key)
      self.members[key] = members
      self.parts[key] = _pack(members)
    part = self.parts[key][id(variable)]
    self.served.add(id(variable))
    inner = variable.get()
    # As `BaseResourceVariable._read_variable_op` does: the tapes and the function watch the
    # variable, and the read is recorded with the variable's handle as its input.
    resource_variable_ops.variable_accessed(inner)
    value = tf.identity(part)
    record.record_operation("ReadVariableOp", [value], [inner.handle],
                            backward_function=lambda x: [x], forward_function=lambda x: [x])
    return value

  def end(self) -> None:
    # A member no read took is left out of later traces' packs until it is read densely again.
    for members in self.members.values():
      for v in members:
        if id(v) not in self.served:
          v._gba_unread = True  # pylint: disable=protected-access


def _pack(members: List["PackableVariable"]) -> Dict[int, tf.Tensor]:
  """Reads `members` on their server as one tensor; returns each one's part on this device."""
  with record.stop_recording():
    with tf.device(members[0].device):
      reads = [gen_resource_variable_ops.read_variable_op(v.get().handle, v.dtype)
               for v in members]
      packed = tf.concat([tf.reshape(r, [-1]) for r in reads], 0) if len(reads) > 1 else reads[0]
    packed = tf.stop_gradient(packed)
    if len(members) == 1:
      return {id(members[0]): packed}
    parts = tf.split(packed, [v.shape.num_elements() for v in members])
    return {id(v): tf.reshape(p, v.shape) for v, p in zip(members, parts)}


def _current() -> Optional[_StepReads]:
  return getattr(_local, "step", None)


@contextlib.contextmanager
def step_scope(registry: Optional[Registry]):
  """Within a step function being traced: dense reads are served from packs."""
  previous = _current()
  step = None
  if registry is not None and not tf.executing_eagerly():
    step = _StepReads(registry)
  _local.step = step
  try:
    yield
  finally:
    _local.step = previous
    if step is not None:
      step.end()


def close() -> None:
  """The step writes from here on: later reads in it read the variables themselves."""
  step = _current()
  if step is not None:
    step.closed = True


class PackableVariable(ps_values.CachingVariable):
  """ParameterServerStrategy's variable wrapper, whose dense reads inside a step come from packs."""

  def __init__(self, v, registry: Registry):
    super().__init__(v)
    self._gba_gathered = False
    self._gba_unread = False
    registry.add(self)

  def packable(self) -> bool:
    shape = self._v.shape
    return (self._v.trainable and not self._gba_gathered and not self._gba_unread
            and shape.is_fully_defined() and shape.num_elements() <= MAX_ELEMENTS
            and self._v.dtype.is_floating)

  def _served_or(self, plain: Callable[[], tf.Tensor]) -> tf.Tensor:
    step = _current()
    if (step is None or step.closed or distribute_utils.caching_scope_local.in_caching_scope()
        or tf.compat.v1.get_default_graph() is not step.graph):
      return plain()
    if self._gba_unread and not self._gba_gathered:
      self._gba_unread = False  # read densely after all: in the next trace's pack
    if not self.packable():
      return plain()
    return step.serve(self)

  def value(self):
    return self._served_or(super().value)

  def read_value(self):
    return self._served_or(super().read_value)

  def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
    plain = lambda: super(PackableVariable, self)._dense_var_to_tensor(dtype, name, as_ref)  # pylint: disable=g-long-lambda
    if as_ref or (dtype is not None and tf.as_dtype(dtype) != self.dtype):
      return plain()
    return self._served_or(plain)

  def sparse_read(self, indices, name=None):
    self._gba_gathered = True
    return super().sparse_read(indices, name=name)

  def _closing(self) -> None:
    # An update of what a pack may hold ends the step's packs; a metric's or a counter's does not.
    if self._v.trainable:
      close()

  def assign(self, *args, **kwargs):
    self._closing()
    return super().assign(*args, **kwargs)

  def assign_add(self, *args, **kwargs):
    self._closing()
    return super().assign_add(*args, **kwargs)

  def assign_sub(self, *args, **kwargs):
    self._closing()
    return super().assign_sub(*args, **kwargs)


def packing_creator(create_var_creator: Callable, registry: Registry) -> Callable:
  """Wraps ParameterServerStrategy's `extended._create_var_creator`: its single-replica
  `CachingVariable`s become `PackableVariable`s of `registry`; anything else is unchanged."""

  def packing_var_creator(next_creator, **kwargs):
    creator = create_var_creator(next_creator, **kwargs)

    def create(**kw):
      v = creator(**kw)
      if type(v) is ps_values.CachingVariable:  # pylint: disable=unidiomatic-typecheck
        return PackableVariable(v.get(), registry)
      return v

    return create

  return packing_var_creator
