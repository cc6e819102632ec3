"""Every custom op declares that it has no gradient, and choice attributes are checked by TF."""

import numpy as np
import pytest
import tensorflow as tf

from tf_gba.ops import adaptive_revision_ops  # noqa: F401  (registers its ops' gradients)
from tf_gba.ops import gba_ops
from tf_gba.ops import hash_table_ops  # noqa: F401
from tf_gba.ops import loader
from tf_gba.ops import version_barrier  # noqa: F401
from tf_gba.ops import worker_clock  # noqa: F401
from tensorflow.python.framework import ops as tf_ops


@pytest.mark.parametrize("area", loader.AREAS)
def test_every_op_of_the_library_is_registered_without_gradient(area):
  names = loader.op_names(area)
  assert names, f"the {area} library registers no op"
  missing = []
  for name in names:
    try:
      # tf.no_gradient registers None; an op never registered raises LookupError.
      assert tf_ops._gradient_registry.lookup(name) is None, name
    except LookupError:
      missing.append(name)
  assert not missing, f"ops without a tf.no_gradient registration: {missing}"


def test_tape_through_a_push_gives_none_instead_of_failing():
  buf = gba_ops.DenseBuffer([3], tf.float32, gba_ops.BufferConfig(1))
  g = tf.constant([1.0, 2.0, 3.0])
  with tf.GradientTape() as tape:
    tape.watch(g)
    ready, agg, _ = buf.push(0, 0, g * 2.0)
    loss = tf.reduce_sum(agg)
  assert bool(ready)
  np.testing.assert_allclose(agg.numpy(), [2.0, 4.0, 6.0])
  assert tape.gradient(loss, g) is None


@pytest.mark.parametrize("attr,value", [("decay", "linear"), ("normalize", "mean"),
                                        ("nonfinite", "ignore")])
def test_choice_attrs_are_checked_by_tensorflow(attr, value):
  kwargs = gba_ops.BufferConfig(2).attrs()
  kwargs[attr] = value
  with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=value):
    loader.load_op_library("gba").gba_dense_buffer_create(
        dtype=tf.float32, shape=[2], shared_name=f"bad_{attr}", **kwargs)


@pytest.mark.parametrize("attr,value", [("decay", "linear"), ("normalize", "mean"),
                                        ("nonfinite", "ignore"), ("sparse_normalize", "sum")])
def test_wrapper_rejects_bad_choices_with_value_error(attr, value):
  with pytest.raises(ValueError, match=f"{attr} must be one of"):
    gba_ops.BufferConfig(2, **{attr: value})
