"""tf_gba.common.autograph: tf_gba's step code runs as written, the user's functions it calls are
converted exactly where AutoGraph would have converted them."""

import pytest
import tensorflow as tf

from tf_gba.common import autograph


def user_step(x):
  # A Python branch on a tensor: it traces only through AutoGraph (tf.cond).
  if x > 0:
    return x * 2.0
  return -x


@autograph.framework_function
def framework_step(x):
  return autograph.call_user_function(user_step, x) + 1.0


@autograph.framework_function
def framework_branch(x):
  if x > 0:
    return x
  return -x


@pytest.mark.parametrize("value,expected", [(3.0, 7.0), (-2.0, 3.0)])
def test_a_user_function_is_converted_under_a_framework_function(value, expected):
  traced = tf.function(framework_step)
  # Both branches live in the graph: one trace answers either sign.
  assert float(traced(tf.constant(value))) == expected
  assert float(traced(tf.constant(-value))) == (-value * 2.0 + 1.0 if value < 0 else value + 1.0)


def test_a_framework_function_itself_is_not_converted():
  with pytest.raises(TypeError, match="Python bool|tf.Tensor"):
    tf.function(framework_branch)(tf.constant(1.0))


def test_the_callers_autograph_switch_is_respected():
  # autograph=False: the user function is called as written, as TensorFlow's own Strategy.run
  # would call it (its Python branch on a tensor then fails to trace).
  with pytest.raises(TypeError, match="Python bool|tf.Tensor"):
    tf.function(framework_step, autograph=False)(tf.constant(1.0))
  # Eagerly, no conversion is needed: the branch is taken on the value.
  assert float(framework_step(tf.constant(-4.0))) == 5.0


def test_the_marked_function_keeps_its_identity():
  assert framework_branch.__name__ == "framework_branch"
  assert float(framework_branch(tf.constant(-1.5))) == 1.5
