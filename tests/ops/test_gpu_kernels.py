"""GPU kernels against the CPU kernels, on the same inputs, for every dtype the ops declare.

Needs a CUDA GPU and op libraries built with their CUDA kernels (`make cuda-build`, then
TF_GBA_OPS_DIR=build/cuda/tf_gba/ops; docs/building.md). tests/conftest.py hides GPUs unless
CUDA_VISIBLE_DEVICES is set, so run these with it:

  CUDA_VISIBLE_DEVICES=0 TF_GBA_OPS_DIR=build/cuda/tf_gba/ops pytest -m gpu tests/ops/test_gpu_kernels.py

Every test is skipped ("needs a CUDA GPU") where TensorFlow sees no GPU. Soft device placement is
turned off, so an op without a GPU kernel fails instead of quietly running on the CPU.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_gba.ops import adaptive_revision_ops as ar_ops
from tf_gba.ops import gba_ops
from tf_gba.ops import loader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not tf.config.list_physical_devices("GPU"), reason="needs a CUDA GPU"),
]

GPU, CPU = "/device:GPU:0", "/device:CPU:0"

# Tolerances between the devices: the kernels add in the same order in the accumulation type
# (float for half and bfloat16) and are built without FMA contraction, so they normally agree
# exactly; the tolerance only absorbs one rounding of the stored dtype.
DTYPES = [(tf.float16, 1e-3), (tf.bfloat16, 1e-2), (tf.float32, 1e-6), (tf.float64, 1e-12)]
DTYPE_IDS = [d.name for d, _ in DTYPES]


def _gpu_kernel_registered(op_name):
  from tensorflow.python.framework import kernels  # pylint: disable=g-import-not-at-top
  return any(k.device_type == "GPU" for k in kernels.get_registered_kernels_for_op(op_name).kernel)


@pytest.fixture(autouse=True)
def _strict_placement():
  loader.load_all()
  soft = tf.config.get_soft_device_placement()
  tf.config.set_soft_device_placement(False)
  yield
  tf.config.set_soft_device_placement(soft)


@pytest.fixture
def gba_gpu_kernels():
  for op in ("GBA>DenseBufferPush", "GBA>SparseBufferPush"):
    if not _gpu_kernel_registered(op):
      pytest.skip(f"{op} has no GPU kernel: the op library was built without CUDA "
                  "(make cuda-build; docs/building.md)")


def _values(shape, seed, dtype):
  rng = np.random.default_rng(seed)
  return rng.normal(size=shape).astype(dtype.as_numpy_dtype)


def _as_f64(t):
  return np.asarray(t.numpy()).astype(np.float64)  # converted on the host: no op placement


def _assert_same(got, want, tol):
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------------
# Dense buffer: checked accumulate (NaN/Inf detection), decay, final scaling by 1/M.

DENSE_CONFIGS = [
    gba_ops.BufferConfig(num_aggregate=3, staleness_threshold=1),
    gba_ops.BufferConfig(num_aggregate=4, staleness_threshold=0, decay="exponential",
                         decay_alpha=0.5, normalize="kept"),
    gba_ops.BufferConfig(num_aggregate=2, count_dropped=False),
]


def _dense_pushes(shape, dtype, seed):
  """(token, gradient) pairs: fresh, stale (decayed or dropped) and non-finite gradients."""
  pushes = []
  for i in range(14):
    g = _values(shape, seed + i, dtype)
    if i == 5 and g.size:
      g.flat[g.size // 2] = np.nan
    if i == 9 and g.size:
      g.flat[-1] = np.inf
    token = max(0, i // 3 - (3 if i % 4 == 3 else 0))  # every fourth push is stale
    pushes.append((token, g))
  return pushes


def _run_dense(device, shape, dtype, config, pushes):
  buf = gba_ops.DenseBuffer(shape, dtype, config, device=device)
  out = []
  with tf.device(device):
    for ticket, (token, g) in enumerate(pushes):
      ready, agg, step = buf.push(token, ticket, tf.constant(g, dtype))
      out.append((bool(ready), _as_f64(agg) if bool(ready) else None, int(step)))
  assert buf.resource_handle.device.endswith(device[len("/device:"):])
  return out, buf.stats()


@pytest.mark.parametrize("dtype,tol", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("config", DENSE_CONFIGS, ids=["threshold", "exp-kept", "no-count"])
@pytest.mark.parametrize("shape", [(0,), (7, 5), (70001,)], ids=["empty", "small", "large"])
def test_dense_push_matches_cpu(gba_gpu_kernels, shape, config, dtype, tol):
  pushes = _dense_pushes(shape, dtype, seed=len(shape) * 100)
  gpu_out, gpu_stats = _run_dense(GPU, shape, dtype, config, pushes)
  cpu_out, cpu_stats = _run_dense(CPU, shape, dtype, config, pushes)
  assert [(r, s) for r, _, s in gpu_out] == [(r, s) for r, _, s in cpu_out]
  for (_, g, _), (_, c, _) in zip(gpu_out, cpu_out):
    if c is not None:
      _assert_same(g, c, tol)
  assert gpu_stats.as_dict() == cpu_stats.as_dict()


@pytest.mark.parametrize("dtype,tol", DTYPES, ids=DTYPE_IDS)
def test_dense_nonfinite_error_matches_cpu(gba_gpu_kernels, dtype, tol):
  del tol
  config = gba_ops.BufferConfig(num_aggregate=2, nonfinite="error")
  g = np.ones((4, 3), dtype.as_numpy_dtype)
  g[1, 2] = np.nan
  messages = []
  for device in (GPU, CPU):
    buf = gba_ops.DenseBuffer((4, 3), dtype, config, device=device)
    with tf.device(device), pytest.raises(tf.errors.InvalidArgumentError) as err:
      buf.push(0, 0, tf.constant(g, dtype))
    messages.append(err.value.message.split(" [Op:")[0])
    assert buf.stats().pushes == 0
  assert "contains NaN or Inf" in messages[0]
  assert messages[0] == messages[1]


# ------------------------------------------------------------------------------------------------
# Sparse buffer: per-id weights on the host, weighted rows accumulated and scaled on the GPU.

SPARSE_CONFIGS = [
    gba_ops.BufferConfig(num_aggregate=3, staleness_threshold=0),
    gba_ops.BufferConfig(num_aggregate=2, staleness_threshold=0, decay="exponential",
                         decay_alpha=0.25, normalize="kept"),
]


def _sparse_pushes(num_rows, row_shape, dtype, index_dtype, seed):
  rng = np.random.default_rng(seed)
  pushes = []
  for i in range(12):
    n = int(rng.integers(0, 9))
    ids = rng.integers(0, num_rows, size=n).astype(index_dtype.as_numpy_dtype)
    if n >= 2:
      ids[1] = ids[0]  # a duplicate within one push: summed, counted once
    rows = _values((n,) + tuple(row_shape), seed + i, dtype)
    if i == 7 and rows.size:
      rows.flat[0] = np.nan
    token = max(0, i // 3 - (2 if i % 5 == 4 else 0))
    pushes.append((token, ids, rows))
  return pushes


def _run_sparse(device, num_rows, row_shape, dtype, index_dtype, config, pushes):
  buf = gba_ops.SparseBuffer(num_rows, row_shape, dtype, config, device=device)
  out = []
  with tf.device(device):
    for ticket, (token, ids, rows) in enumerate(pushes):
      ready, agg_ids, agg_rows, step = buf.push(token, ticket, tf.constant(ids, index_dtype),
                                                tf.constant(rows, dtype))
      out.append((bool(ready), agg_ids.numpy().tolist(), _as_f64(agg_rows), int(step)))
    step, tags = buf.export_state()
  return out, buf.stats(), (int(step), tags.numpy().tolist())


@pytest.mark.parametrize("dtype,tol", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("config", SPARSE_CONFIGS, ids=["threshold", "exp-kept"])
@pytest.mark.parametrize("row_shape", [(4,), (3, 5), (0,)], ids=["row4", "row3x5", "empty-row"])
def test_sparse_push_matches_cpu(gba_gpu_kernels, row_shape, config, index_dtype, dtype, tol):
  pushes = _sparse_pushes(20, row_shape, dtype, index_dtype, seed=7)
  gpu = _run_sparse(GPU, 20, row_shape, dtype, index_dtype, config, pushes)
  cpu = _run_sparse(CPU, 20, row_shape, dtype, index_dtype, config, pushes)
  gpu_out, gpu_stats, gpu_state = gpu
  cpu_out, cpu_stats, cpu_state = cpu
  assert [(r, i, s) for r, i, _, s in gpu_out] == [(r, i, s) for r, i, _, s in cpu_out]
  for (_, _, g, _), (_, _, c, _) in zip(gpu_out, cpu_out):
    assert g.shape == c.shape
    _assert_same(g, c, tol)
  assert gpu_stats.as_dict() == cpu_stats.as_dict()
  assert gpu_state == cpu_state


@pytest.mark.parametrize("dtype,tol", DTYPES, ids=DTYPE_IDS)
def test_sparse_pool_growth_matches_cpu(gba_gpu_kernels, dtype, tol):
  """Many new ids per push, so the GPU pool grows (and is reused) across batches."""
  config = gba_ops.BufferConfig(num_aggregate=2)
  rng = np.random.default_rng(3)
  pushes = []
  for i in range(6):
    ids = rng.permutation(5000)[:1000 * (i % 3 + 1)].astype(np.int64)
    pushes.append((i // 2, ids, _values((ids.size, 16), 50 + i, dtype)))
  gpu_out = _run_sparse(GPU, 5000, (16,), dtype, tf.int64, config, pushes)[0]
  cpu_out = _run_sparse(CPU, 5000, (16,), dtype, tf.int64, config, pushes)[0]
  for (gr, gi, g, gs), (cr, ci, c, cs) in zip(gpu_out, cpu_out):
    assert (gr, gi, gs) == (cr, ci, cs)
    _assert_same(g, c, tol)


# ------------------------------------------------------------------------------------------------
# AdaptiveRevision dense apply.

@pytest.mark.parametrize("dtype,tol", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("use_max", [True, False], ids=["max", "no-max"])
def test_adaptive_revision_dense_matches_cpu(dtype, tol, use_max):
  if not _gpu_kernel_registered("GBA>ResourceApplyAdaptiveRevision"):
    pytest.skip("GBA>ResourceApplyAdaptiveRevision has no GPU kernel registered in this build "
                "(docs/building.md)")
  shape = (33, 17)
  rng = np.random.default_rng(11)
  x0 = rng.normal(size=shape)
  grads = [rng.normal(size=shape) for _ in range(5)]
  states = {}
  for device in (GPU, CPU):
    with tf.device(device):
      x = tf.Variable(x0, dtype=dtype)
      gbar = tf.Variable(np.zeros(shape), dtype=dtype)
      z = tf.Variable(np.full(shape, 2.0), dtype=dtype)
      zp = tf.Variable(np.full(shape, 2.0), dtype=dtype)
      snapshots = [tf.identity(gbar)]
      for step, g in enumerate(grads):
        gbar_old = snapshots[max(0, step - 2)]  # a delay of two steps
        ar_ops.resource_apply_adaptive_revision(x, gbar, z, zp, 0.1, tf.constant(g, dtype),
                                                gbar_old, use_max=use_max)
        snapshots.append(tf.identity(gbar))
      states[device] = [_as_f64(v) for v in (x, gbar, z, zp)]
  for got, want in zip(states[GPU], states[CPU]):
    _assert_same(got, want, tol)


@pytest.mark.parametrize("dtype,tol", DTYPES, ids=DTYPE_IDS)
def test_adaptive_revision_bad_accumulator_matches_cpu(dtype, tol):
  del tol
  if not _gpu_kernel_registered("GBA>ResourceApplyAdaptiveRevision"):
    pytest.skip("GBA>ResourceApplyAdaptiveRevision has no GPU kernel registered in this build "
                "(docs/building.md)")
  messages = []
  for device in (GPU, CPU):
    with tf.device(device):
      zp0 = np.ones(10)
      zp0[6] = 0.0
      x = tf.Variable(np.ones(10), dtype=dtype)
      gbar = tf.Variable(np.zeros(10), dtype=dtype)
      z = tf.Variable(np.ones(10), dtype=dtype)
      zp = tf.Variable(zp0, dtype=dtype)
      with pytest.raises(tf.errors.InvalidArgumentError) as err:
        ar_ops.resource_apply_adaptive_revision(x, gbar, z, zp, 0.1, tf.ones(10, dtype),
                                                tf.zeros(10, dtype))
      messages.append(err.value.message.split(" [Op:")[0])
      np.testing.assert_array_equal(_as_f64(x), np.ones(10))  # nothing was updated
  assert "flat index 6" in messages[0]
  assert messages[0] == messages[1]
