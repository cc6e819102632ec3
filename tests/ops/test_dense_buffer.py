"""Dense gradient buffer against a NumPy reference of SPEC section 1 (Eq. 1, divide by M)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_gba.ops import gba_ops

DTYPES = [(tf.float16, 2e-3), (tf.bfloat16, 2e-2), (tf.float32, 1e-6), (tf.float64, 1e-12)]


def reference(pushes, m, iota, decay="threshold", alpha=0.5, normalize="num_aggregate",
              count_dropped=True, initial_step=0):
  """Replays pushes of (token, gradient) and returns, per push, (ready, aggregate, step)."""
  alpha = float(np.float32(alpha))  # the op's decay_alpha attribute is a float32
  k, acc, entries, kept, out = initial_step, None, 0, 0, []
  for token, g in pushes:
    s = k - token
    if not np.all(np.isfinite(g)):
      f = 0.0
    elif s <= iota:
      f = 1.0
    elif decay == "threshold":
      f = 0.0
    else:
      f = alpha ** (s - iota)
    term = f * g.astype(np.float64) if f else np.zeros(g.shape)
    acc = term if acc is None else acc + term
    kept += f != 0
    entries += (f != 0) or count_dropped
    if entries == m:
      div = m if normalize == "num_aggregate" else max(1, kept)
      out.append((True, acc / div, k + 1))
      k, acc, entries, kept = k + 1, None, 0, 0
    else:
      out.append((False, None, k))
  return out


def run_pushes(buf, pushes, dtype):
  got = []
  for ticket, (token, g) in enumerate(pushes):
    ready, agg, step = buf.push(token, ticket, tf.constant(g, dtype))
    got.append((bool(ready), tf.cast(agg, tf.float64).numpy(), int(step)))
  return got


def assert_matches(got, want, tol):
  assert len(got) == len(want)
  for i, ((r1, a1, s1), (r2, a2, s2)) in enumerate(zip(got, want)):
    assert (r1, s1) == (r2, s2), f"push {i}: got ready={r1} step={s1}, want ready={r2} step={s2}"
    if r2:
      np.testing.assert_allclose(a1, a2, rtol=tol, atol=tol, err_msg=f"push {i}")


def scripted_pushes(rng, n, shape, max_lag, m):
  """Tokens as a real job produces them: around floor(i / M), some workers lagging."""
  pushes = []
  for i in range(n):
    token = max(0, i // m - int(rng.integers(0, max_lag + 1)))
    pushes.append((token, rng.normal(size=shape)))
  return pushes


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_threshold_decay_every_dtype(dtype, tol):
  rng = np.random.default_rng(0)
  m, iota = 4, 2
  pushes = scripted_pushes(rng, 40, (3, 5), max_lag=5, m=m)
  pushes = [(t, g.astype(dtype.as_numpy_dtype).astype(np.float64)) for t, g in pushes]
  buf = gba_ops.DenseBuffer([3, 5], dtype, gba_ops.BufferConfig(m, staleness_threshold=iota))
  want = reference(pushes, m, iota)
  assert any(r for r, _, _ in want) and any(
      (k - t) > iota for (t, _), (_, _, k) in zip(pushes, want)), "script must drop something"
  assert_matches(run_pushes(buf, pushes, dtype), want, tol)
  stats = buf.stats()
  steps_before = [0] + [k for _, _, k in want[:-1]]
  dropped = sum(1 for (t, _), k in zip(pushes, steps_before) if k - t > iota)
  assert stats.dropped == dropped
  assert stats.aggregations == sum(r for r, _, _ in want)
  assert stats.pushes == len(pushes)


def test_stale_gradients_dropped_and_divisor_is_m():
  # M=2, iota=0: at step 1 a push with token 0 (staleness 1) is dropped but still fills a place;
  # the aggregate is the kept gradient divided by M=2, not by 1.
  buf = gba_ops.DenseBuffer([2], tf.float64, gba_ops.BufferConfig(2, staleness_threshold=0))
  buf.push(0, 0, tf.constant([1.0, 1.0], tf.float64))
  ready, agg, step = buf.push(0, 1, tf.constant([3.0, 5.0], tf.float64))
  assert bool(ready) and int(step) == 1
  np.testing.assert_array_equal(agg.numpy(), [2.0, 3.0])
  buf.push(0, 2, tf.constant([100.0, 100.0], tf.float64))  # staleness 1 > 0: dropped
  ready, agg, step = buf.push(1, 3, tf.constant([4.0, 6.0], tf.float64))
  assert bool(ready) and int(step) == 2
  np.testing.assert_array_equal(agg.numpy(), [2.0, 3.0])
  stats = buf.stats()
  assert stats.dropped == 1 and stats.staleness_max == 1
  np.testing.assert_array_equal(stats.histogram[:3], [3, 1, 0])


@pytest.mark.parametrize("options", [
    dict(decay="exponential", decay_alpha=0.5),
    dict(decay="exponential", decay_alpha=0.9, normalize="kept"),
    dict(normalize="kept"),
    dict(count_dropped=False),
])
def test_decay_rules_and_options(options):
  rng = np.random.default_rng(1)
  m, iota = 3, 1
  pushes = scripted_pushes(rng, 36, (7,), max_lag=4, m=m)
  config = gba_ops.BufferConfig(m, staleness_threshold=iota, **options)
  buf = gba_ops.DenseBuffer([7], tf.float64, config)
  ref_args = {k: v for k, v in options.items() if k != "decay_alpha"}
  if "decay_alpha" in options:
    ref_args["alpha"] = options["decay_alpha"]
  want = reference(pushes, m, iota, **ref_args)
  assert_matches(run_pushes(buf, pushes, tf.float64), want, 1e-12)


def test_exponential_weight_values():
  # f = alpha ** max(0, s - iota): with iota=0, alpha=0.5, staleness 2 -> weight 0.25.
  config = gba_ops.BufferConfig(1, staleness_threshold=0, decay="exponential",
                                decay_alpha=0.5)
  buf = gba_ops.DenseBuffer([1], tf.float64, config, initial_step=2)
  ready, agg, _ = buf.push(0, 0, tf.constant([8.0], tf.float64))
  assert bool(ready)
  np.testing.assert_array_equal(agg.numpy(), [2.0])


def test_initial_step_and_set_step():
  buf = gba_ops.DenseBuffer([1], tf.float32, gba_ops.BufferConfig(1, staleness_threshold=0),
                            initial_step=5)
  ready, agg, step = buf.push(4, 0, tf.constant([1.0]))  # staleness 1 > 0: dropped
  assert bool(ready) and int(step) == 6
  np.testing.assert_array_equal(agg.numpy(), [0.0])
  buf.set_step(2)
  _, agg, step = buf.push(2, 1, tf.constant([3.0]))
  assert int(step) == 3
  np.testing.assert_array_equal(agg.numpy(), [3.0])


def test_duplicate_ticket_is_ignored():
  buf = gba_ops.DenseBuffer([2], tf.float32, gba_ops.BufferConfig(2))
  buf.push(0, 7, tf.constant([1.0, 1.0]))
  ready, _, _ = buf.push(0, 7, tf.constant([1.0, 1.0]))  # the same push delivered twice
  assert not bool(ready)
  ready, agg, _ = buf.push(0, 8, tf.constant([3.0, 3.0]))
  assert bool(ready)
  np.testing.assert_array_equal(agg.numpy(), [2.0, 2.0])
  assert buf.stats().duplicates == 1 and buf.stats().pushes == 2


def test_nonfinite_dropped_and_counted():
  buf = gba_ops.DenseBuffer([2], tf.float32, gba_ops.BufferConfig(2))
  buf.push(0, 0, tf.constant([np.nan, 1.0]))
  ready, agg, _ = buf.push(0, 1, tf.constant([4.0, 2.0]))
  assert bool(ready)
  np.testing.assert_array_equal(agg.numpy(), [2.0, 1.0])  # NaN push has weight 0, M stays 2
  stats = buf.stats()
  assert stats.nonfinite == 1 and stats.dropped == 1


def test_nonfinite_late_in_a_large_gradient_leaves_the_sum_intact():
  # The kernel checks and adds block by block; a NaN far into the gradient must undo the blocks
  # already added. Integer values keep the undo exact.
  n = 200_003
  buf = gba_ops.DenseBuffer([n], tf.float32, gba_ops.BufferConfig(4))
  first = np.arange(n, dtype=np.float32) % 97
  bad = np.full(n, 5.0, np.float32)
  bad[-2] = np.inf
  buf.push(0, 0, tf.constant(first))
  buf.push(0, 1, tf.constant(bad))
  buf.push(0, 2, tf.constant(first))
  ready, agg, _ = buf.push(0, 3, tf.zeros([n]))
  assert bool(ready)
  np.testing.assert_array_equal(agg.numpy() * 4, 2 * first)
  assert buf.stats().nonfinite == 1


def test_empty_variable():
  buf = gba_ops.DenseBuffer([0, 3], tf.float32, gba_ops.BufferConfig(1))
  ready, agg, _ = buf.push(0, 0, tf.zeros([0, 3]))
  assert bool(ready) and agg.shape == (0, 3)


def _errors_cases():
  def shape_mismatch():
    buf = gba_ops.DenseBuffer([3], tf.float32, gba_ops.BufferConfig(2))
    return lambda: buf.push(0, 0, tf.zeros([4]))

  def dtype_mismatch():
    buf = gba_ops.DenseBuffer([3], tf.float32, gba_ops.BufferConfig(2))
    return lambda: buf.push(0, 0, tf.zeros([3], tf.float64))

  def negative_token():
    buf = gba_ops.DenseBuffer([3], tf.float32, gba_ops.BufferConfig(2))
    return lambda: buf.push(-1, 0, tf.zeros([3]))

  def nonfinite_error():
    buf = gba_ops.DenseBuffer([1], tf.float32, gba_ops.BufferConfig(2, nonfinite="error"))
    return lambda: buf.push(0, 0, tf.constant([np.inf]))

  return [(shape_mismatch, "does not match the buffer's shape"),
          (dtype_mismatch, "does not match the buffer's dtype"),
          (negative_token, "token must be >= 0"),
          (nonfinite_error, "NaN or Inf")]


@pytest.mark.parametrize("make,message", _errors_cases())
@pytest.mark.parametrize("in_function", [False, True])
def test_bad_inputs_have_actionable_errors(make, message, in_function):
  fn = make()
  if in_function:
    fn = tf.function(fn)
  with pytest.raises(tf.errors.InvalidArgumentError, match=message):
    fn()


def test_bad_num_aggregate_in_kernel_and_python():
  with pytest.raises(ValueError, match="num_aggregate"):
    gba_ops.BufferConfig(0)
  with pytest.raises(tf.errors.InvalidArgumentError, match="must be >= 1"):
    gba_ops._ops().gba_dense_buffer_create(dtype=tf.float32, shape=[1], num_aggregate=0,
                                           shared_name="bad_m_dense")
  with pytest.raises(ValueError, match="decay must be"):
    gba_ops.BufferConfig(1, decay="linear")


def test_checkpoint_round_trip(tmp_path):
  buf = gba_ops.DenseBuffer([1], tf.float32, gba_ops.BufferConfig(1))
  for i in range(3):
    buf.push(i, i, tf.constant([1.0]))
  ckpt = tf.train.Checkpoint(buf=buf)
  path = ckpt.save(str(tmp_path / "ck"))
  buf.set_step(0)
  ckpt.restore(path)
  assert buf.stats().global_step == 3
