"""Python wrappers of the AdaptiveRevision update ops (SPEC section 2, McMahan & Streeter 2014).

Both ops apply Algorithm 1's Update in place to four resource variables, x (`var`), `gbar`, `z`
and `zprime` (z'), holding their exclusive locks so that each coordinate's update is atomic:

    g_bck   = gbar - gbar_old
    eta_old = alpha / sqrt(z')
    z       = z + g*g + 2*g*g_bck
    z'      = max(z, z')  if use_max  else  z
    eta     = alpha / sqrt(z')
    x       = x - eta*g + (eta_old - eta)*g_bck
    gbar    = gbar + g

`gbar_old` is the value of `gbar` the worker read together with the parameters it computed `g`
from. With `gbar_old == gbar` (no delay) this is AdaGrad with accumulator `z`. Initialise `gbar`
to 0 and `z`, `z'` to G0 > 0 (`tf_gba.optimizers.AdaptiveRevision` does).

The op library is loaded on first use, so importing this module needs no compiled library.

Example:

  >>> x = tf.Variable([1.0, 2.0]); gbar = tf.Variable([0.0, 0.0])
  >>> z = tf.Variable([1.0, 1.0]); zp = tf.Variable([1.0, 1.0])
  >>> gbar_old = tf.identity(gbar)          # the Read, with the parameters
  >>> resource_apply_adaptive_revision(x, gbar, z, zp, 0.1, [0.5, -1.0], gbar_old)
"""

from typing import Any, Optional

import tensorflow as tf

from tf_gba.common import autograph
from tf_gba.ops import loader

# The updates are applied to variables in place and output nothing: no gradient.
loader.no_gradient("GBA>ResourceApplyAdaptiveRevision", "GBA>ResourceSparseApplyAdaptiveRevision")


@autograph.framework_function
def _ops():
  return loader.load_op_library("adaptive_revision")


def _handle_and_dtype(var: Any):
  """Returns (resource handle, dtype) of a resource variable, or (handle, None) of a handle."""
  if isinstance(var, tf.Variable) or hasattr(var, "handle"):
    return var.handle, tf.as_dtype(var.dtype)
  handle = tf.convert_to_tensor(var)
  if handle.dtype != tf.resource:
    raise TypeError("AdaptiveRevision ops update resource variables in place: pass a "
                    f"tf.Variable or its .handle, got a tensor of dtype {handle.dtype.name}.")
  return handle, None


def _handles(var, gbar, z, zprime):
  handles, dtypes = zip(*(_handle_and_dtype(v) for v in (var, gbar, z, zprime)))
  dtype = next((d for d in dtypes if d is not None), None)
  return handles, dtype


def _cast_alpha(alpha, dtype, reference):
  # alpha is a hyper-parameter: like tf_keras optimizers, cast it to the variable's dtype rather
  # than make callers match half/bfloat16 by hand. The other inputs are not cast (a dtype mismatch
  # there is a bug the op reports).
  if dtype is None:
    dtype = tf.convert_to_tensor(reference).dtype
  if not tf.is_tensor(alpha) and not isinstance(alpha, tf.Variable):
    # A Python number goes straight to the dtype: tf.cast would round it through float32 first.
    return tf.convert_to_tensor(alpha, dtype), dtype
  return tf.cast(alpha, dtype), dtype


def resource_apply_adaptive_revision(var, gbar, z, zprime, alpha, grad, gbar_old,
                                     use_max: bool = True, name: Optional[str] = None):
  """Applies one AdaptiveRevision update to every coordinate of a dense variable.

  Args:
    var: the parameters x: a resource `tf.Variable` (or its handle).
    gbar: variable of var's shape and dtype, the sum of the gradients applied so far.
    z: variable, the accumulator of Algorithm 1 (initially G0 > 0).
    zprime: variable, z', the accumulator the learning rate alpha / sqrt(z') uses (initially G0).
    alpha: learning-rate scale, a scalar (cast to var's dtype).
    grad: the gradient, var's shape and dtype.
    gbar_old: the snapshot of `gbar` read with the parameters `grad` was computed from.
    use_max: True for AdaptiveRevision (z' = max(z, z'), non-increasing learning rates); False
      for the paper's AdaptiveRevision* (z' = z).
    name: optional op name.

  Returns:
    The update op in graph mode, None in eager mode.

  Raises:
    tf.errors.InvalidArgumentError: shapes that do not match var, a non-scalar alpha, or an
      accumulator z' that is (or, with use_max=False, would become) non-positive. Nothing is
      updated then.
  """
  handles, dtype = _handles(var, gbar, z, zprime)
  alpha, dtype = _cast_alpha(alpha, dtype, grad)
  return _ops().gba_resource_apply_adaptive_revision(
      *handles, alpha=alpha, grad=tf.convert_to_tensor(grad, dtype_hint=dtype),
      gbar_old=tf.convert_to_tensor(gbar_old, dtype_hint=dtype), use_max=use_max, name=name)


def resource_sparse_apply_adaptive_revision(var, gbar, z, zprime, alpha, grad_rows, indices,
                                            gbar_old_rows, use_max: bool = True,
                                            name: Optional[str] = None):
  """Applies one AdaptiveRevision update to the rows `indices` of a variable (embedding table).

  Only the given rows are read and written. Duplicate indices are summed first, like the
  `IndexedSlices` gradient of a gather: each distinct row gets one update with the summed
  gradient rows. Their `gbar_old_rows` must be identical (gathered from one snapshot, as they are
  when gathered with the same indices); otherwise the op fails and updates nothing. An empty
  `indices` is a no-op.

  Args:
    var: the parameters x, a resource variable of rank >= 1.
    gbar: variable of var's shape and dtype, the sum of the gradients applied so far.
    z: variable, the accumulator (initially G0 > 0).
    zprime: variable, z' (initially G0).
    alpha: learning-rate scale, a scalar (cast to var's dtype).
    grad_rows: gradient rows, shape [N] + var.shape[1:].
    indices: int32 or int64 vector of N row indices in [0, var.shape[0]).
    gbar_old_rows: the gbar rows at `indices` read with the parameters, grad_rows' shape.
    use_max: True: AdaptiveRevision; False: AdaptiveRevision* (z' = z).
    name: optional op name.

  Returns:
    The update op in graph mode, None in eager mode.

  Raises:
    tf.errors.InvalidArgumentError: mismatched shapes, an index out of range, duplicate indices
      with different gbar_old rows, a non-scalar alpha or a non-positive accumulator. Nothing is
      updated then.
  """
  handles, dtype = _handles(var, gbar, z, zprime)
  alpha, dtype = _cast_alpha(alpha, dtype, grad_rows)
  return _ops().gba_resource_sparse_apply_adaptive_revision(
      *handles, alpha=alpha, grad_rows=tf.convert_to_tensor(grad_rows, dtype_hint=dtype),
      indices=tf.convert_to_tensor(indices, dtype_hint=tf.int64),
      gbar_old_rows=tf.convert_to_tensor(gbar_old_rows, dtype_hint=dtype), use_max=use_max,
      name=name)
