"""AutoGraph left out of tf_gba's own step code, kept for the user's functions it calls.

AutoGraph converts every function a traced step calls that is not TensorFlow's own: it reads the
function's source, rewrites it and compiles the result, once per process. For tf_gba's step code
(`GBAStrategy.run`, the ops' wrappers), which branches on Python values only, that changes
nothing and costs about 2 CPU-seconds in each process that traces a step (a training job, each
test module). `tf.autograph.experimental.do_not_convert` would turn AutoGraph off for everything
below as well, the user's `train_step` included; `framework_function` leaves the caller's AutoGraph
status as it is, and `call_user_function` converts a user function as AutoGraph would have.
"""

from typing import Callable, TypeVar

import tensorflow as tf
from tensorflow.python.autograph.impl import api as _autograph_api  # pylint: disable=g-direct-tensorflow-import

F = TypeVar("F", bound=Callable)


def framework_function(fn: F) -> F:
  """`fn` runs as written inside traced code, under the caller's AutoGraph status: `fn` must not
  branch or loop on tensors (AutoGraph would otherwise turn such Python control flow into graph
  control flow)."""
  _autograph_api.autograph_artifact(fn)
  return fn


def call_user_function(fn: Callable, *args, **kwargs):
  """Calls a user function from a `framework_function`, converted by AutoGraph where the caller's
  status asks for it (inside `tf.function`), as a call from converted code would be."""
  ctx = tf.__internal__.autograph.control_status_ctx()
  return tf.__internal__.autograph.tf_convert(fn, ctx, convert_by_default=False)(*args, **kwargs)
