"""A hash table's initial rows with stock TensorFlow ops only (SPEC section 6).

The same values, bit for bit, as the table op's `InitialRow` (custom_ops/gba/cc/kernels/
hash_table.h): a key's first row is a function of (seed, key) only, from splitmix64's
counter-based stream, so a process without tf_gba's op libraries (TF Serving) computes the row of
a key the table never saw. uint64 add, multiply, xor and shifts wrap modulo 2**64 in TensorFlow as
in C++; every float step is the C++ one's, in float64, and the last one rounds to float32 the same
way.

Example:

  rows = initial_rows(tf.constant([3, -1], tf.int64), dim=8, seed=1)   # [2, 8] float32
"""

import numpy as np
import tensorflow as tf

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment


def _u64(value: int) -> tf.Tensor:
  return tf.constant(np.uint64(value & _MASK64), tf.uint64)


def _mix64_int(z: int) -> int:
  """splitmix64's finaliser on a Python int (for the seed, a constant)."""
  z &= _MASK64
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
  return z ^ (z >> 31)


def mix64(z: tf.Tensor) -> tf.Tensor:
  """splitmix64's finaliser of a uint64 tensor, elementwise."""
  shift = lambda x, n: tf.bitwise.right_shift(x, _u64(n))  # pylint: disable=unnecessary-lambda-assignment
  z = tf.bitwise.bitwise_xor(z, shift(z, 30)) * _u64(0xBF58476D1CE4E5B9)
  z = tf.bitwise.bitwise_xor(z, shift(z, 27)) * _u64(0x94D049BB133111EB)
  return tf.bitwise.bitwise_xor(z, shift(z, 31))


def _uniforms(keys: tf.Tensor, seed: int, count: int) -> tf.Tensor:
  """[n, count] float64: the uniforms 1..count of every key's stream (KeyUniform)."""
  base = mix64(tf.bitcast(keys, tf.uint64) + _u64(_mix64_int(seed)))  # KeyStreamBase
  steps = tf.constant(np.array([(i * _GOLDEN_GAMMA) & _MASK64 for i in range(1, count + 1)],
                               np.uint64))
  bits = tf.bitwise.right_shift(mix64(base[:, None] + steps[None, :]), _u64(11))
  return tf.cast(bits, tf.float64) * (2.0 ** -53)  # 53 bits: exact in float64


def initial_rows(keys, dim: int, seed: int = 0, initializer: str = "uniform",
                 init_a: float = -0.05, init_b: float = 0.05) -> tf.Tensor:
  """[n, dim] float32: the initial row of every key of the int64 vector `keys`.

  Args:
    keys: int64 keys, a vector.
    dim, seed, initializer, init_a, init_b: the table's (see `hash_table_ops.HashTableShard`):
      uniform in [init_a, init_b), normal with mean init_a and stddev init_b, or zeros.
  """
  keys = tf.convert_to_tensor(keys, tf.int64)
  if initializer == "zeros":
    return tf.zeros([tf.size(keys), dim], tf.float32)
  # The op's attributes are float32, widened to double in C++.
  a, b = float(np.float32(init_a)), float(np.float32(init_b))
  if initializer == "uniform":
    values = a + (b - a) * _uniforms(keys, seed, dim)
  elif initializer == "normal":
    u = _uniforms(keys, seed, 2 * dim)
    u1, u2 = u[:, 0::2], u[:, 1::2]  # the uniforms 2j+1 and 2j+2 (Box-Muller)
    z = tf.sqrt(-2.0 * tf.math.log1p(-u1)) * tf.cos((2.0 * np.pi) * u2)
    values = a + b * z
  else:
    raise ValueError(f"initializer must be 'uniform', 'normal' or 'zeros', got {initializer!r}.")
  return tf.cast(values, tf.float32)
