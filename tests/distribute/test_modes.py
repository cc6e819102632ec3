"""Each parameter-server mode's aggregation rule against a NumPy reference on a scripted push order.

The script fixes every push's token (for Hop-BW: the version its worker read) and gradient, so the
buffers' decisions are deterministic. The references below restate SPEC section 1 ("Baselines")
directly; they share nothing with `tf_gba.distribute.modes`, which maps a mode to a buffer
configuration.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_gba.distribute import modes
from tf_gba.ops import gba_ops

N = 4            # workers
IOTA = 1         # GBA's staleness threshold in these scripts
B2 = 3           # BSP's b2 (not N, to see that it is used)
B3 = 1           # Hop-BW's backup workers


def _script(seed, num_pushes=40, shape=(3,)):
  """(token, gradient) pairs: tokens wander around a rising version, some far behind."""
  rng = np.random.default_rng(seed)
  tokens = np.maximum(0, np.arange(num_pushes) // N - rng.integers(0, 4, num_pushes))
  grads = rng.normal(size=(num_pushes,) + shape).astype(np.float32)
  return tokens, grads


# ---- references ---------------------------------------------------------------------------------

def reference_dense(mode, tokens, grads):
  """Global steps applied, as (push index that completed it, aggregate), by the SPEC's rules."""
  k, held, counted, out = 0, [], 0, []
  for i, (token, g) in enumerate(zip(tokens, grads)):
    s = k - token
    if mode == "async":
      out.append((i, g.astype(np.float64)))
      k += 1
      continue
    if mode == "gba":
      m, weight, counts = N, float(s <= IOTA), True
    elif mode == "bsp":
      m, weight, counts = B2, 1.0, True
    elif mode == "hop_bs":
      m, weight, counts = N, 1.0, True
    elif mode == "hop_bw":
      # Only gradients of the current version; the others do not take a place.
      m, weight, counts = N - B3, float(s == 0), s == 0
    if counts:
      held.append(weight * g.astype(np.float64))
      counted += 1
    if counted == m:
      out.append((i, np.sum(held, axis=0) / m))
      k, held, counted = k + 1, [], 0
  return out


def _run_dense(mode, tokens, grads):
  m = modes.num_aggregate_for(mode, N, gba_num_aggregate=N, bsp_aggregate=B2, hop_bw_backup=B3)
  config = modes.buffer_config_for(mode, gba_ops.BufferConfig(num_aggregate=N,
                                                              staleness_threshold=IOTA), m)
  buf = gba_ops.DenseBuffer(grads.shape[1:], tf.float32, config)
  out = []
  for i, (token, g) in enumerate(zip(tokens, grads)):
    ready, aggregate, _ = buf.push(int(token), i, tf.constant(g))
    if bool(ready):
      out.append((i, aggregate.numpy()))
  return out, buf.stats()


@pytest.mark.parametrize("mode", modes.MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_dense_rule_matches_reference(mode, seed):
  tokens, grads = _script(seed)
  # Hop-BW's tokens are versions: a worker reads the global step, which is never ahead of the
  # buffer; keep the script consistent with that by clipping to the reference's version.
  if mode == "hop_bw":
    tokens = _versions_read(tokens)
  want = reference_dense(mode, tokens, grads)
  got, stats = _run_dense(mode, tokens, grads)
  assert [i for i, _ in got] == [i for i, _ in want]
  for (_, a), (_, b) in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  assert stats.aggregations == len(want)
  if mode in ("async", "bsp", "hop_bs"):
    assert stats.dropped == 0
  if mode == "hop_bw":
    k = 0
    ignored = 0
    counted = 0
    for token in tokens:
      if token == k:
        counted += 1
        if counted == N - B3:
          k, counted = k + 1, 0
      else:
        ignored += 1
    assert stats.dropped == ignored > 0


def _versions_read(tokens):
  """Hop-BW script: each push's version is min(scripted token, current global step)."""
  k, counted, out = 0, 0, []
  for token in tokens:
    v = min(int(token), k)
    out.append(v)
    if v == k:
      counted += 1
      if counted == N - B3:
        k, counted = k + 1, 0
  return np.array(out)


def test_modes_differ_on_the_same_script():
  """The rules are not accidentally the same: the five modes give five different results."""
  tokens, grads = _script(3)
  results = {}
  for mode in modes.MODES:
    t = _versions_read(tokens) if mode == "hop_bw" else tokens
    got, _ = _run_dense(mode, t, grads)
    results[mode] = np.concatenate([a for _, a in got]) if got else np.zeros(0)
  for a in modes.MODES:
    for b in modes.MODES:
      if a < b:
        assert results[a].shape != results[b].shape or not np.allclose(results[a], results[b]), (
            a, b)


# ---- embeddings ---------------------------------------------------------------------------------

def reference_sparse_hop_bw(pushes, num_rows, dim):
  """Hop-BW on embedding rows: a push of an older version is ignored whole (takes no place).

  A row's sum is divided by the step's N - b3 places (the default embedding divisor, M).
  """
  k, counted, rows, out = 0, 0, {}, []
  for i, (token, ids, values) in enumerate(pushes):
    if token != k:
      continue
    counted += 1
    for idx, v in zip(ids, values):
      rows[idx] = rows.get(idx, np.zeros(dim)) + v
    if counted == N - B3:
      out.append((i, {idx: rows[idx] / (N - B3) for idx in rows}))
      k, counted, rows = k + 1, 0, {}
  return out


def test_sparse_hop_bw_matches_reference():
  rng = np.random.default_rng(5)
  num_rows, dim = 10, 2
  pushes = []
  k_script = 0
  for i in range(30):
    ids = rng.integers(0, num_rows, size=rng.integers(1, 5))
    token = max(0, i // N - int(rng.integers(0, 3)))
    pushes.append((token, ids, rng.normal(size=(len(ids), dim)).astype(np.float32)))
  # Versions as Hop-BW reads them (never ahead of the current step).
  versions = _versions_read(np.array([p[0] for p in pushes]))
  pushes = [(int(v), ids, vals) for v, (_, ids, vals) in zip(versions, pushes)]
  want = reference_sparse_hop_bw(pushes, num_rows, dim)
  assert want
  config = modes.buffer_config_for("hop_bw", gba_ops.BufferConfig(num_aggregate=N), N - B3)
  buf = gba_ops.SparseBuffer(num_rows, [dim], tf.float32, config)
  got = []
  for i, (token, ids, values) in enumerate(pushes):
    ready, out_ids, out_rows, _ = buf.push(token, i, tf.constant(ids, tf.int64),
                                           tf.constant(values))
    if bool(ready):
      got.append((i, dict(zip(out_ids.numpy().tolist(), out_rows.numpy()))))
  assert [i for i, _ in got] == [i for i, _ in want]
  for (_, a), (_, b) in zip(got, want):
    assert set(a) == set(b)
    for idx in a:
      np.testing.assert_allclose(a[idx], b[idx], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["gba", "hop_bw"])
def test_stale_push_gba_per_id_vs_hop_bw_whole(mode):
  """GBA keeps the rows of a stale push that did not change since it was read; Hop-BW drops all."""
  config = modes.buffer_config_for(mode, gba_ops.BufferConfig(num_aggregate=1,
                                                              staleness_threshold=0), 1)
  buf = gba_ops.SparseBuffer(4, [1], tf.float32, config)
  # Steps 0 and 1 update row 0: its tag becomes 1.
  buf.push(0, 0, tf.constant([0], tf.int64), tf.constant([[1.0]]))
  buf.push(1, 1, tf.constant([0], tf.int64), tf.constant([[1.0]]))
  # A push read at version 0 (two steps ago) with rows 0 (changed since: s = 1 + 1 - 0 = 2) and
  # 2 (never: s = 0).
  ready, ids, rows, step = buf.push(0, 2, tf.constant([0, 2], tf.int64),
                                    tf.constant([[5.0], [3.0]]))
  if mode == "gba":
    assert bool(ready) and int(step) == 3
    assert dict(zip(ids.numpy().tolist(), rows.numpy()[:, 0].tolist())) == {2: 3.0}
  else:
    assert not bool(ready) and int(step) == 2   # ignored: no place taken, nothing applied
    assert buf.stats().dropped == 2


@pytest.mark.parametrize("mode", modes.MODES)
@pytest.mark.parametrize("sparse_normalize", gba_ops.SPARSE_NORMALIZATIONS)
def test_every_mode_keeps_the_embedding_divisor(mode, sparse_normalize):
  config = gba_ops.BufferConfig(num_aggregate=N, sparse_normalize=sparse_normalize)
  assert modes.buffer_config_for(mode, config, 2).sparse_normalize == sparse_normalize


def test_buffer_config_for_rejects_unknown_mode():
  with pytest.raises(ValueError, match="mode must be one of"):
    modes.buffer_config_for("sync", gba_ops.BufferConfig(num_aggregate=2), 2)
  with pytest.raises(ValueError, match="mode must be one of"):
    modes.num_aggregate_for("hogwild", 4)
