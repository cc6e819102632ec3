"""Tests of the AdaptiveRevision kernels against NumPy references written here (SPEC section 2).

The references are Algorithm 1 of McMahan & Streeter (2014), transcribed line by line, and an
independent AdaGrad. Delay patterns are scripted as sequences of Read and Update events, the way
the paper simulates them with an update queue.
"""

import threading

import numpy as np
import pytest

import tf_gba  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is used)
import tensorflow as tf

from tf_gba.ops import adaptive_revision_ops as ar_ops

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
# Relative tolerance per dtype: the kernels compute half/bfloat16 in float, so what remains is the
# rounding of the stored results (2^-11, 2^-8) and of the inputs.
RTOL = {tf.float16: 4e-3, tf.bfloat16: 3e-2, tf.float32: 2e-5, tf.float64: 1e-11}


# ------------------------------------------------------------------------------------------------
# NumPy references.

def ref_update(state, alpha, g, gbar_old, use_max=True):
  """Algorithm 1's Update(g, gbar_old), per coordinate, in float64. Returns the new state."""
  x, gbar, z, zp = (np.array(state[k], np.float64) for k in ("x", "gbar", "z", "zp"))
  g = np.asarray(g, np.float64)
  g_bck = gbar - np.asarray(gbar_old, np.float64)
  eta_old = alpha / np.sqrt(zp)
  z = z + g * g + 2.0 * g * g_bck
  zp = np.maximum(z, zp) if use_max else z
  eta = alpha / np.sqrt(zp)
  x = x - eta * g
  x = x + (eta_old - eta) * g_bck
  gbar = gbar + g
  return {"x": x, "gbar": gbar, "z": z, "zp": zp}


def ref_adagrad(x0, grads_fn, steps, alpha, g0):
  """Plain AdaGrad: accumulator starts at G0, x -= alpha g / sqrt(accumulator)."""
  x = np.array(x0, np.float64)
  acc = np.full_like(x, g0)
  for t in range(steps):
    g = grads_fn(t, x)
    acc += g * g
    x = x - alpha * g / np.sqrt(acc)
  return x, acc


# ------------------------------------------------------------------------------------------------
# Delay patterns (paper section 3), as event lists [("r", i) | ("u", i)].

def constant_pattern(n, d):
  """Every update (but the first d) is applied after exactly d others since its read."""
  events = []
  for i in range(n):
    events.append(("r", i))
    if i >= d:
      events.append(("u", i - d))
  events += [("u", i) for i in range(max(0, n - d), n)]
  return events


def minibatch_pattern(n, d):
  """2d + 1 reads, then their 2d + 1 updates (footnote 5)."""
  b = 2 * d + 1
  events = []
  for start in range(0, n, b):
    block = range(start, min(n, start + b))
    events += [("r", i) for i in block] + [("u", i) for i in block]
  return events


def random_pattern(n, d, seed):
  """Delays uniform in {0, ..., 2d}; not InOrder."""
  rng = np.random.default_rng(seed)
  delays = rng.integers(0, 2 * d + 1, size=n)
  events, pending = [], []
  for t in range(n):
    events.append(("r", t))
    pending.append((t + delays[t], t))
    pending.sort()
    while pending and pending[0][0] <= t:
      events.append(("u", pending.pop(0)[1]))
  events += [("u", i) for _, i in pending]
  return events


def check_pattern(events, n):
  reads = [i for k, i in events if k == "r"]
  updates = [i for k, i in events if k == "u"]
  assert sorted(reads) == list(range(n)) and sorted(updates) == list(range(n))
  for k, i in events:
    if k == "u":
      assert events.index(("r", i)) < events.index(("u", i))


# A small problem whose gradients depend on the (stale) parameters that were read:
# f_i(x) = 0.5 * h_i * (x - c_i)^2 per coordinate.
class Problem:

  def __init__(self, n, shape, seed, num_rows=None, ids_per_step=3):
    rng = np.random.default_rng(seed)
    self.shape = shape
    self.h = rng.uniform(0.5, 2.0, size=(n,) + shape)
    self.c = rng.normal(size=(n,) + shape)
    self.x0 = rng.normal(size=shape)
    if num_rows is not None:   # sparse: each step touches ids_per_step rows (duplicates allowed)
      self.ids = rng.integers(0, num_rows, size=(n, ids_per_step))
      self.h = self.h[:, :ids_per_step]
      self.c = self.c[:, :ids_per_step]

  def grad(self, i, x_read):
    return self.h[i] * (x_read - self.c[i])


def simulate_numpy(problem, events, alpha, g0, use_max=True, sparse=False):
  state = {"x": problem.x0.copy(), "gbar": np.zeros(problem.shape),
           "z": np.full(problem.shape, g0), "zp": np.full(problem.shape, g0)}
  reads = {}
  for kind, i in events:
    if kind == "r":
      idx = problem.ids[i] if sparse else slice(None)
      reads[i] = (state["x"][idx].copy(), state["gbar"][idx].copy())
      continue
    x_read, gbar_old = reads.pop(i)
    g = problem.grad(i, x_read)
    if not sparse:
      state = ref_update(state, alpha, g, gbar_old, use_max)
      continue
    # Duplicate ids in one update: summed, with the gbar_old they share.
    rows = {}
    for k, row in enumerate(problem.ids[i]):
      if row in rows:
        rows[row] = (rows[row][0] + g[k], rows[row][1])
      else:
        rows[row] = (g[k], gbar_old[k])
    for row, (g_row, gbar_old_row) in rows.items():
      sub = {key: state[key][row] for key in state}
      new = ref_update(sub, alpha, g_row, gbar_old_row, use_max)
      for key in state:
        state[key][row] = new[key]
  return state


def make_vars(x0, g0, dtype):
  x0 = np.asarray(x0)
  return (tf.Variable(x0, dtype=dtype), tf.Variable(np.zeros_like(x0), dtype=dtype),
          tf.Variable(np.full_like(x0, g0), dtype=dtype),
          tf.Variable(np.full_like(x0, g0), dtype=dtype))


def simulate_tf(problem, events, alpha, g0, use_max=True, sparse=False, dtype=tf.float64,
                index_dtype=tf.int64):
  x, gbar, z, zp = make_vars(problem.x0, g0, dtype)
  reads = {}
  for kind, i in events:
    if kind == "r":
      if sparse:
        ids = tf.constant(problem.ids[i], index_dtype)
        reads[i] = (tf.gather(x, ids), tf.gather(gbar, ids))
      else:
        # tf.identity shares the buffer; the kernels copy on write, so the snapshot stays valid.
        reads[i] = (tf.identity(x), tf.identity(gbar))
      continue
    x_read, gbar_old = reads.pop(i)
    g = tf.constant(problem.grad(i, x_read.numpy().astype(np.float64)), dtype)
    if sparse:
      ar_ops.resource_sparse_apply_adaptive_revision(
          x, gbar, z, zp, alpha, g, tf.constant(problem.ids[i], index_dtype), gbar_old,
          use_max=use_max)
    else:
      ar_ops.resource_apply_adaptive_revision(x, gbar, z, zp, alpha, g, gbar_old,
                                              use_max=use_max)
  return {"x": x.numpy(), "gbar": gbar.numpy(), "z": z.numpy(), "zp": zp.numpy()}


def assert_state_close(got, want, rtol, atol=None):
  for key in ("x", "gbar", "z", "zp"):
    w = np.asarray(want[key], np.float64)
    a = atol if atol is not None else rtol * max(1.0, float(np.max(np.abs(w))))
    np.testing.assert_allclose(np.asarray(got[key], np.float64), w, rtol=rtol, atol=a,
                               err_msg=key)


# ------------------------------------------------------------------------------------------------
# Single updates, every dtype.

def _random_state(rng, shape):
  return {"x": rng.normal(size=shape), "gbar": rng.normal(size=shape),
          "z": rng.uniform(0.5, 3.0, size=shape), "zp": rng.uniform(0.5, 3.0, size=shape)}


def _rounded(values, dtype):
  # The inputs as the kernel sees them: rounded to the dtype, then widened for the reference.
  return tf.cast(tf.constant(values, dtype), tf.float64).numpy()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("use_max", [True, False])
def test_dense_single_update_every_dtype(dtype, use_max):
  rng = np.random.default_rng(1)
  shape = (4, 3)
  state = {k: _rounded(v, dtype) for k, v in _random_state(rng, shape).items()}
  state["z"] = np.maximum(state["z"], state["zp"])  # keeps z > 0 after the update (use_max=False)
  g = _rounded(rng.normal(size=shape) * 0.3, dtype)
  gbar_old = _rounded(state["gbar"] - np.abs(rng.normal(size=shape)) * 0.2, dtype)
  alpha = float(_rounded(0.3, dtype))
  x, gbar, z, zp = (tf.Variable(state[k], dtype=dtype) for k in ("x", "gbar", "z", "zp"))
  ar_ops.resource_apply_adaptive_revision(x, gbar, z, zp, alpha, tf.constant(g, dtype),
                                          tf.constant(gbar_old, dtype), use_max=use_max)
  want = ref_update(state, alpha, g, gbar_old, use_max)
  got = {"x": x.numpy(), "gbar": gbar.numpy(), "z": z.numpy(), "zp": zp.numpy()}
  for v in (x, gbar, z, zp):
    assert v.dtype == dtype
  assert_state_close(got, want, RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64], ids=lambda d: d.name)
def test_sparse_single_update_every_dtype(dtype, index_dtype):
  rng = np.random.default_rng(2)
  shape = (6, 2)
  state = {k: _rounded(v, dtype) for k, v in _random_state(rng, shape).items()}
  ids = np.array([4, 0, 2])
  g = _rounded(rng.normal(size=(3, 2)) * 0.3, dtype)
  gbar_old = _rounded(state["gbar"][ids] - 0.1, dtype)
  alpha = float(_rounded(0.2, dtype))
  x, gbar, z, zp = (tf.Variable(state[k], dtype=dtype) for k in ("x", "gbar", "z", "zp"))
  ar_ops.resource_sparse_apply_adaptive_revision(
      x, gbar, z, zp, alpha, tf.constant(g, dtype), tf.constant(ids, index_dtype),
      tf.constant(gbar_old, dtype))
  want = {k: v.copy() for k, v in state.items()}
  for k, row in enumerate(ids):
    new = ref_update({key: state[key][row] for key in state}, alpha, g[k], gbar_old[k])
    for key in want:
      want[key][row] = new[key]
  got = {"x": x.numpy(), "gbar": gbar.numpy(), "z": z.numpy(), "zp": zp.numpy()}
  assert_state_close(got, want, RTOL[dtype])
  untouched = [r for r in range(6) if r not in ids]
  np.testing.assert_array_equal(x.numpy()[untouched], tf.cast(
      tf.constant(state["x"][untouched], dtype), dtype).numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64], ids=lambda d: d.name)
def test_sparse_empty_input_is_a_noop(dtype, index_dtype):
  x, gbar, z, zp = make_vars(np.arange(6.0).reshape(3, 2), 1.0, dtype)
  before = [v.numpy().copy() for v in (x, gbar, z, zp)]
  ar_ops.resource_sparse_apply_adaptive_revision(
      x, gbar, z, zp, 0.1, tf.zeros([0, 2], dtype), tf.zeros([0], index_dtype),
      tf.zeros([0, 2], dtype))

  @tf.function
  def graph_apply():
    ar_ops.resource_sparse_apply_adaptive_revision(
        x, gbar, z, zp, 0.1, tf.zeros([0, 2], dtype), tf.zeros([0], index_dtype),
        tf.zeros([0, 2], dtype))

  graph_apply()
  for b, v in zip(before, (x, gbar, z, zp)):
    np.testing.assert_array_equal(v.numpy(), b)


# ------------------------------------------------------------------------------------------------
# No delay == AdaGrad (independent reference).

@pytest.mark.parametrize("use_max", [True, False])
def test_no_delay_is_adagrad_dense(use_max):
  n, shape, alpha, g0 = 25, (5,), 0.4, 1.0
  problem = Problem(n, shape, seed=3)
  got = simulate_tf(problem, constant_pattern(n, 0), alpha, g0, use_max=use_max)
  want_x, want_acc = ref_adagrad(problem.x0, problem.grad, n, alpha, g0)
  np.testing.assert_allclose(got["x"], want_x, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(got["z"], want_acc, rtol=1e-12)
  np.testing.assert_allclose(got["zp"], want_acc, rtol=1e-12)


def test_no_delay_is_adagrad_sparse():
  n, rows, alpha, g0 = 30, 6, 0.3, 1.0
  problem = Problem(n, (rows, 2), seed=4, num_rows=rows, ids_per_step=3)
  got = simulate_tf(problem, constant_pattern(n, 0), alpha, g0, sparse=True)
  # AdaGrad on the dense equivalent: the gradient of step i scattered (summed) into its rows.
  x = problem.x0.copy()
  acc = np.full_like(x, g0)
  for i in range(n):
    g = np.zeros_like(x)
    np.add.at(g, problem.ids[i], problem.grad(i, x[problem.ids[i]]))
    acc += g * g
    x = x - alpha * g / np.sqrt(acc)
  np.testing.assert_allclose(got["x"], x, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(got["z"], acc, rtol=1e-12)


# ------------------------------------------------------------------------------------------------
# Delay patterns of the paper, dense and sparse, against the Algorithm 1 reference.

PATTERNS = {
    "constant": lambda n, d: constant_pattern(n, d),
    "minibatch": lambda n, d: minibatch_pattern(n, d),
    "random": lambda n, d: random_pattern(n, d, seed=d),
}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("delay", [1, 4])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_delay_patterns_match_reference(pattern, delay, sparse):
  n, alpha, g0 = 40, 0.3, 1.0
  events = PATTERNS[pattern](n, delay)
  check_pattern(events, n)
  if sparse:
    problem = Problem(n, (5, 2), seed=5 + delay, num_rows=5, ids_per_step=3)
  else:
    problem = Problem(n, (4,), seed=5 + delay)
  want = simulate_numpy(problem, events, alpha, g0, sparse=sparse)
  got = simulate_tf(problem, events, alpha, g0, sparse=sparse)
  assert_state_close(got, want, 1e-10)
  # With delays the result is not AdaGrad's: the revision did something.
  no_delay = simulate_numpy(problem, constant_pattern(n, 0), alpha, g0, sparse=sparse)
  assert not np.allclose(want["x"], no_delay["x"])


@pytest.mark.parametrize("pattern", ["constant", "minibatch"])
def test_delay_patterns_without_zprime(pattern):
  # Without z', delayed gradients of opposite signs can drive z below 0 (the kernel then refuses
  # the update, see the error tests); G0 = 10 keeps this run clear of that.
  n, alpha, g0, delay = 40, 0.3, 10.0, 3
  problem = Problem(n, (4,), seed=11)
  events = PATTERNS[pattern](n, delay)
  want = simulate_numpy(problem, events, alpha, g0, use_max=False)
  got = simulate_tf(problem, events, alpha, g0, use_max=False)
  assert_state_close(got, want, 1e-10)
  np.testing.assert_array_equal(got["z"], got["zp"])  # z' follows z without use_max


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_constant_delay_every_dtype(dtype, sparse):
  n, alpha, g0 = 12, 0.25, 1.0
  if sparse:
    problem = Problem(n, (4, 2), seed=12, num_rows=4, ids_per_step=2)
  else:
    problem = Problem(n, (3,), seed=12)
  problem.x0 = _rounded(problem.x0, dtype)
  events = constant_pattern(n, 2)
  want = simulate_numpy(problem, events, alpha, g0, sparse=sparse)
  got = simulate_tf(problem, events, alpha, g0, sparse=sparse, dtype=dtype,
                    index_dtype=tf.int32)
  # Rounding of the stored state accumulates over the steps: a few ulps per step.
  rtol = {tf.float16: 3e-2, tf.bfloat16: 2e-1, tf.float32: 1e-5, tf.float64: 1e-11}[dtype]
  assert_state_close(got, want, rtol)


def test_minibatch_without_zprime_is_adagrad_on_minibatch_sums():
  """Footnote 5: with 2D+1 reads then 2D+1 updates and no z', AdaGrad on the minibatch sums."""
  n, alpha, g0, d = 45, 0.3, 1.0, 2
  b = 2 * d + 1
  problem = Problem(n, (4,), seed=13)
  got = simulate_tf(problem, minibatch_pattern(n, d), alpha, g0, use_max=False)

  def minibatch_grad(k, x):  # every gradient of minibatch k is computed at the same x
    return sum(problem.grad(i, x) for i in range(k * b, (k + 1) * b))

  want_x, want_acc = ref_adagrad(problem.x0, minibatch_grad, n // b, alpha, g0)
  np.testing.assert_allclose(got["x"], want_x, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(got["z"], want_acc, rtol=1e-10)
  # With z' (use_max) the learning rate cannot grow back inside a minibatch, so it differs.
  with_max = simulate_tf(problem, minibatch_pattern(n, d), alpha, g0, use_max=True)
  assert not np.allclose(with_max["x"], want_x, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# Duplicates, snapshots, tf.function, concurrency.

def test_sparse_duplicates_are_summed_like_the_dense_update():
  x0 = np.arange(8.0).reshape(4, 2) / 10
  ids = np.array([2, 0, 2, 2])
  g = np.array([[0.1, -0.2], [0.3, 0.1], [0.2, 0.2], [-0.4, 0.5]])
  dense_g = np.zeros_like(x0)
  np.add.at(dense_g, ids, g)

  sparse_vars = make_vars(x0, 1.0, tf.float64)
  dense_vars = make_vars(x0, 1.0, tf.float64)
  for vs in (sparse_vars, dense_vars):  # one earlier update, so that gbar_old != gbar matters
    ar_ops.resource_apply_adaptive_revision(*vs, 0.5, np.full([4, 2], 0.3), np.zeros([4, 2]))
  gbar_old_full = np.zeros_like(x0)   # read before that update
  ar_ops.resource_sparse_apply_adaptive_revision(*sparse_vars, 0.5, g, ids, gbar_old_full[ids])
  ar_ops.resource_apply_adaptive_revision(*dense_vars, 0.5, dense_g, gbar_old_full)
  for s, d in zip(sparse_vars, dense_vars):
    np.testing.assert_allclose(s.numpy(), d.numpy(), rtol=1e-14)


def test_sparse_duplicates_with_different_gbar_old_fail_and_update_nothing():
  vs = make_vars(np.zeros((3, 2)), 1.0, tf.float32)
  with pytest.raises(tf.errors.InvalidArgumentError, match="are both 1 but their gbar_old rows"):
    ar_ops.resource_sparse_apply_adaptive_revision(
        *vs, 0.1, tf.ones([2, 2]), [1, 1], tf.constant([[0.0, 0.0], [0.0, 1.0]]))
  np.testing.assert_array_equal(vs[0].numpy(), np.zeros((3, 2)))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_snapshots_are_not_changed_by_later_updates(sparse):
  x, gbar, z, zp = make_vars(np.zeros((3, 2)), 1.0, tf.float32)
  if sparse:  # puts the variables in copy-on-read mode first
    ar_ops.resource_sparse_apply_adaptive_revision(x, gbar, z, zp, 0.1, tf.ones([1, 2]), [0],
                                                   tf.zeros([1, 2]))
  x_read, gbar_read = tf.identity(x), tf.identity(gbar)
  x_before, gbar_before = x_read.numpy().copy(), gbar_read.numpy().copy()
  if sparse:
    ar_ops.resource_sparse_apply_adaptive_revision(x, gbar, z, zp, 0.1, tf.ones([2, 2]),
                                                   [0, 2], tf.gather(gbar_read, [0, 2]))
  else:
    ar_ops.resource_apply_adaptive_revision(x, gbar, z, zp, 0.1, tf.ones([3, 2]), gbar_read)
  np.testing.assert_array_equal(x_read.numpy(), x_before)
  np.testing.assert_array_equal(gbar_read.numpy(), gbar_before)
  assert not np.array_equal(gbar.numpy(), gbar_before)


def test_inside_tf_function_matches_eager():
  n, alpha, g0 = 20, 0.3, 1.0
  problem = Problem(n, (4,), seed=14)
  events = constant_pattern(n, 3)
  want = simulate_numpy(problem, events, alpha, g0)
  x, gbar, z, zp = make_vars(problem.x0, g0, tf.float64)
  h = tf.constant(problem.h)
  c = tf.constant(problem.c)

  @tf.function
  def read():
    return tf.identity(x), tf.identity(gbar)

  @tf.function
  def update(i, x_read, gbar_old):
    ar_ops.resource_apply_adaptive_revision(x, gbar, z, zp, alpha, h[i] * (x_read - c[i]),
                                            gbar_old)

  reads = {}
  for kind, i in events:
    if kind == "r":
      reads[i] = read()
    else:
      update(tf.constant(i), *reads.pop(i))
  got = {"x": x.numpy(), "gbar": gbar.numpy(), "z": z.numpy(), "zp": zp.numpy()}
  assert_state_close(got, want, 1e-10)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_concurrent_updates_are_atomic(sparse):
  """Threads update concurrently, each with the gbar it read. With a constant gradient c the final
  state is order-independent: gbar = S c and z = G0 + c^2 (S^2 - 2 sum_t r_t), where r_t c is
  the gbar_old of update t, because update t (in apply order) sees gbar = (t - 1) c."""
  threads, per_thread, c, g0 = 4, 30, 0.5, 1.0
  shape = (64, 4)
  x, gbar, z, zp = make_vars(np.zeros(shape), g0, tf.float32)
  rows = np.arange(shape[0])
  reads = [[] for _ in range(threads)]
  barrier = threading.Barrier(threads)

  def work(k):
    barrier.wait()
    for _ in range(per_thread):
      if sparse:
        gbar_old = tf.gather(gbar, rows)
        ar_ops.resource_sparse_apply_adaptive_revision(
            x, gbar, z, zp, 0.1, tf.fill(shape, c), rows, gbar_old)
      else:
        gbar_old = tf.identity(gbar)
        ar_ops.resource_apply_adaptive_revision(x, gbar, z, zp, 0.1, tf.fill(shape, c), gbar_old)
      reads[k].append(gbar_old.numpy())

  ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
  for t in ts:
    t.start()
  for t in ts:
    t.join()
  s = threads * per_thread
  all_reads = np.stack([r for rs in reads for r in rs])          # [S, 64, 4]
  # A read must be consistent: one gbar value for all coordinates of the update it preceded.
  assert np.all(all_reads == all_reads[:, :1, :1])
  np.testing.assert_array_equal(gbar.numpy(), np.full(shape, s * c))
  sum_r = all_reads.sum(axis=0) / c
  np.testing.assert_array_equal(z.numpy(), g0 + c * c * (s * s - 2 * sum_r))
  np.testing.assert_array_equal(zp.numpy(), z.numpy())  # z only grows when every g_bck c >= 0


# ------------------------------------------------------------------------------------------------
# Input validation: each error, eager and inside tf.function; nothing is updated.

def _vars(shape=(3, 2), g0=1.0, dtype=tf.float32):
  return make_vars(np.zeros(shape), g0, dtype)


def _dense(vs, alpha=0.1, grad=None, gbar_old=None, use_max=True):
  shape = vs[0].shape
  grad = tf.ones(shape) if grad is None else grad
  gbar_old = tf.zeros(shape) if gbar_old is None else gbar_old
  return ar_ops.resource_apply_adaptive_revision(*vs, alpha, grad, gbar_old, use_max=use_max)


def _sparse(vs, alpha=0.1, grad=None, indices=None, gbar_old=None, use_max=True):
  indices = tf.constant([0, 2], tf.int64) if indices is None else indices
  grad = tf.ones([2, 2]) if grad is None else grad
  gbar_old = tf.zeros([2, 2]) if gbar_old is None else gbar_old
  return ar_ops.resource_sparse_apply_adaptive_revision(*vs, alpha, grad, indices, gbar_old,
                                                        use_max=use_max)


ERROR_CASES = {
    # name: (make variables, call, message)
    "dense grad shape": (_vars, lambda vs: _dense(vs, grad=tf.ones([3])),
                         r"grad must have the shape of var"),
    "dense gbar_old shape": (_vars, lambda vs: _dense(vs, gbar_old=tf.ones([2, 2])),
                             r"gbar_old must have the shape of var"),
    "slot shape": (lambda: _vars()[:3] + (tf.Variable(tf.ones([3])),),
                   lambda vs: _dense(vs), r"`zprime` must have the shape of var"),
    "alpha not scalar": (_vars, lambda vs: _dense(vs, alpha=tf.constant([0.1, 0.2])),
                         r"alpha must be a scalar"),
    "sparse alpha not scalar": (_vars, lambda vs: _sparse(vs, alpha=tf.constant([0.1])),
                                r"alpha must be a scalar"),
    "indices not vector": (_vars, lambda vs: _sparse(vs, indices=tf.constant([[0, 2]])),
                           r"indices must be a vector"),
    "grad rows count": (_vars, lambda vs: _sparse(vs, grad=tf.ones([3, 2])),
                        r"grad must have one row per index"),
    "grad row shape": (_vars, lambda vs: _sparse(vs, grad=tf.ones([2, 3]),
                                                gbar_old=tf.zeros([2, 3])),
                       r"grad rows must have the shape of a var row"),
    "sparse gbar_old shape": (_vars, lambda vs: _sparse(vs, gbar_old=tf.zeros([2, 1])),
                              r"gbar_old must have the shape of grad"),
    "scalar var sparse": (lambda: _vars(shape=()),
                          lambda vs: _sparse(vs, grad=tf.ones([1]), indices=tf.constant([0]),
                                             gbar_old=tf.zeros([1])),
                          r"rank >= 1"),
}

RUNTIME_ERROR_CASES = {
    "index out of range": (_vars, lambda vs: _sparse(vs, indices=tf.constant([0, 3], tf.int64)),
                           r"indices\[1\] = 3 is not in \[0, 3\)"),
    "negative index": (_vars, lambda vs: _sparse(vs, indices=tf.constant([-1, 0], tf.int32)),
                       r"indices\[0\] = -1 is not in \[0, 3\)"),
    "non-positive accumulator": (lambda: _vars(g0=0.0), lambda vs: _dense(vs),
                                 r"accumulator z' must be positive"),
    "non-positive accumulator sparse": (lambda: _vars(g0=-1.0), lambda vs: _sparse(vs),
                                        r"accumulator z' must be positive"),
    # z = 1 + g^2 + 2 g g_bck = 1 + 1 - 4 < 0 with gbar_old = gbar - (-2)... g_bck = -2.
    "z would become non-positive": (
        _vars, lambda vs: _dense(vs, gbar_old=tf.fill([3, 2], 2.0), use_max=False),
        r"use_max=false .* would make the accumulator"),
    "z would become non-positive sparse": (
        _vars, lambda vs: _sparse(vs, gbar_old=tf.fill([2, 2], 2.0), use_max=False),
        r"use_max=false .* would make the accumulator"),
}


def _assert_unchanged(vs, before):
  for v, b in zip(vs, before):
    np.testing.assert_array_equal(v.numpy(), b)


@pytest.mark.parametrize("case", sorted(ERROR_CASES) + sorted(RUNTIME_ERROR_CASES))
def test_errors_eager(case):
  make, call, message = {**ERROR_CASES, **RUNTIME_ERROR_CASES}[case]
  vs = make()
  before = [v.numpy().copy() for v in vs]
  with pytest.raises(tf.errors.InvalidArgumentError, match=message):
    call(vs)
  _assert_unchanged(vs, before)


@pytest.mark.parametrize("case", sorted(ERROR_CASES) + sorted(RUNTIME_ERROR_CASES))
def test_errors_in_tf_function(case):
  # Static shape errors are reported by the shape function while tracing (ValueError), with the
  # same words; the others by the kernel when the function runs.
  make, call, message = {**ERROR_CASES, **RUNTIME_ERROR_CASES}[case]
  vs = make()
  before = [v.numpy().copy() for v in vs]
  expected = (ValueError, tf.errors.InvalidArgumentError)
  if case in RUNTIME_ERROR_CASES:
    expected = tf.errors.InvalidArgumentError
  with pytest.raises(expected, match=message):

    @tf.function
    def run():
      call(vs)

    run()
  _assert_unchanged(vs, before)


def test_shape_errors_from_the_kernel_in_tf_function():
  """With shapes unknown at trace time the kernel's own OP_REQUIRES reports them."""
  vs = _vars()
  spec = tf.TensorSpec(None, tf.float32)

  @tf.function(input_signature=[spec, spec, spec])
  def dense(alpha, grad, gbar_old):
    ar_ops.resource_apply_adaptive_revision(*vs, alpha, grad, gbar_old)

  with pytest.raises(tf.errors.InvalidArgumentError, match="grad must have the shape of var"):
    dense(0.1, tf.ones([3]), tf.zeros([3, 2]))
  with pytest.raises(tf.errors.InvalidArgumentError, match="alpha must be a scalar"):
    dense(tf.ones([2]), tf.ones([3, 2]), tf.zeros([3, 2]))

  @tf.function(input_signature=[spec, tf.TensorSpec(None, tf.int32), spec])
  def sparse(grad, indices, gbar_old):
    ar_ops.resource_sparse_apply_adaptive_revision(*vs, 0.1, grad, indices, gbar_old)

  with pytest.raises(tf.errors.InvalidArgumentError, match="indices must be a vector"):
    sparse(tf.ones([1, 2]), tf.constant([[0]]), tf.zeros([1, 2]))
  with pytest.raises(tf.errors.InvalidArgumentError, match="gbar_old must have the shape of grad"):
    sparse(tf.ones([1, 2]), tf.constant([0]), tf.zeros([2, 2]))


def test_dtype_mismatch_is_reported():
  x, gbar, z, zp = _vars(dtype=tf.float32)
  zp64 = tf.Variable(tf.ones([3, 2], tf.float64))
  with pytest.raises(tf.errors.InvalidArgumentError, match="`zprime` has dtype double"):
    ar_ops.resource_apply_adaptive_revision(x, gbar, z, zp64.handle, 0.1, tf.ones([3, 2]),
                                            tf.zeros([3, 2]))


def test_rejects_non_resource_inputs():
  with pytest.raises(TypeError, match="pass a tf.Variable or its .handle"):
    ar_ops.resource_apply_adaptive_revision(tf.zeros([2]), tf.zeros([2]), tf.ones([2]),
                                            tf.ones([2]), 0.1, tf.ones([2]), tf.zeros([2]))
