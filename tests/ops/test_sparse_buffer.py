"""Sparse (embedding) buffer against a NumPy reference of SPEC section 1, per-ID staleness.

The reference decides every weight at aggregation time from the tags as they were before the
aggregation, the way the SPEC states it; the kernel decides at push time. They must agree.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_gba.ops import gba_ops


def reference(pushes, num_rows, m, iota, decay="threshold", alpha=0.5, normalize="num_aggregate",
              sparse_normalize="num_aggregate"):
  """pushes: (token, ids, rows). Returns per push (ready, ids, rows, step) and the final tags.

  Per-ID staleness max(0, tag + 1 - token); a row's divisor is M (entries without the row count
  as zero rows; with normalize="kept", M minus the entries that dropped the row) or, with
  sparse_normalize="per_id", c(id) (with "kept": the entries that kept the row).
  """
  alpha = float(np.float32(alpha))
  tags = -np.ones(num_rows, np.int64)
  k, batch, out = 0, [], []
  for token, ids, rows in pushes:
    summed = {}
    for i, r in zip(ids, rows):  # duplicates within one push are summed first
      summed[int(i)] = summed.get(int(i), 0.0) + np.asarray(r, np.float64)
    finite = all(np.all(np.isfinite(r)) for r in rows)
    batch.append((token, summed, finite))
    if len(batch) < m:
      out.append((False, np.zeros(0, np.int64), None, k))
      continue
    agg_ids, agg_rows = [], []
    for i in sorted(set().union(*[d.keys() for _, d, _ in batch])):
      c, kept, num = 0, 0, 0.0
      for tok, d, ok in batch:
        if i not in d:
          continue
        c += 1
        s = max(0, tags[i] + 1 - tok)
        if not ok:
          w = 0.0
        elif s <= iota:
          w = 1.0
        else:
          w = 0.0 if decay == "threshold" else alpha ** (s - iota)
        kept += w != 0
        num = num + w * d[i]
      if kept:
        agg_ids.append(i)
        if sparse_normalize == "per_id":
          divisor = c if normalize == "num_aggregate" else kept
        else:
          divisor = m if normalize == "num_aggregate" else m - (c - kept)
        agg_rows.append(num / divisor)
    for i in agg_ids:  # tags change only after every weight of this batch was decided
      tags[i] = k
    out.append((True, np.array(agg_ids, np.int64), np.array(agg_rows), k + 1))
    k, batch = k + 1, []
  return out, tags


def run(buf, pushes, dtype=tf.float64, index_dtype=tf.int64):
  got = []
  for ticket, (token, ids, rows) in enumerate(pushes):
    ready, out_ids, out_rows, step = buf.push(
        token, ticket, tf.constant(ids, index_dtype),
        tf.constant(np.asarray(rows).reshape((len(ids),) + tuple(buf._row_shape)), dtype))
    assert out_ids.dtype == index_dtype
    # The kernel emits ids in first-push order; the reference in sorted order.
    order = np.argsort(out_ids.numpy(), kind="stable")
    got.append((bool(ready), out_ids.numpy().astype(np.int64)[order],
                tf.cast(out_rows, tf.float64).numpy()[order], int(step)))
  return got


def assert_matches(got, want, tol):
  for n, ((r1, i1, v1, s1), (r2, i2, v2, s2)) in enumerate(zip(got, want)):
    assert (r1, s1) == (r2, s2), f"push {n}"
    np.testing.assert_array_equal(i1, i2, err_msg=f"push {n}")
    if r2 and len(i2):
      np.testing.assert_allclose(v1.reshape(v2.shape), v2, rtol=tol, atol=tol,
                                 err_msg=f"push {n}")


def scripted(rng, n, num_rows, dim, m, max_lag, max_ids=6):
  pushes = []
  for p in range(n):
    token = max(0, p // m - int(rng.integers(0, max_lag + 1)))
    k = int(rng.integers(0, max_ids + 1))
    ids = rng.integers(0, num_rows, k)  # duplicates likely with small num_rows
    pushes.append((token, ids, rng.normal(size=(k, dim))))
  return pushes


@pytest.mark.parametrize("dtype,tol", [(tf.float16, 3e-3), (tf.bfloat16, 3e-2),
                                       (tf.float32, 1e-6), (tf.float64, 1e-12)])
@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64])
@pytest.mark.parametrize("sparse_normalize", gba_ops.SPARSE_NORMALIZATIONS)
def test_per_id_staleness_every_dtype(dtype, tol, index_dtype, sparse_normalize):
  rng = np.random.default_rng(3)
  num_rows, dim, m, iota = 12, 3, 3, 1
  pushes = scripted(rng, 60, num_rows, dim, m, max_lag=4)
  pushes = [(t, i, r.astype(dtype.as_numpy_dtype).astype(np.float64)) for t, i, r in pushes]
  want, tags = reference(pushes, num_rows, m, iota, sparse_normalize=sparse_normalize)
  buf = gba_ops.SparseBuffer(num_rows, [dim], dtype,
                             gba_ops.BufferConfig(m, iota, sparse_normalize=sparse_normalize))
  assert_matches(run(buf, pushes, dtype, index_dtype), want, tol)
  step, got_tags = buf.export_state()
  np.testing.assert_array_equal(got_tags.numpy(), tags)
  assert int(step) == 20
  assert buf.stats().dropped > 0, "the script must drop some (push, id) pairs"


def test_exponential_decay_and_kept_normalisation():
  rng = np.random.default_rng(4)
  pushes = scripted(rng, 40, 8, 2, 4, max_lag=5)
  for kwargs in (dict(decay="exponential", alpha=0.5),
                 dict(decay="exponential", alpha=0.8, normalize="kept"),
                 dict(decay="threshold", alpha=0.5, normalize="kept"),
                 dict(decay="exponential", alpha=0.5, sparse_normalize="per_id"),
                 dict(decay="threshold", alpha=0.5, normalize="kept", sparse_normalize="per_id")):
    want, tags = reference(pushes, 8, 4, 0, **kwargs)
    config = gba_ops.BufferConfig(4, 0, decay=kwargs["decay"], decay_alpha=kwargs["alpha"],
                                  normalize=kwargs.get("normalize", "num_aggregate"),
                                  sparse_normalize=kwargs.get("sparse_normalize",
                                                              "num_aggregate"))
    buf = gba_ops.SparseBuffer(8, [2], tf.float64, config)
    assert_matches(run(buf, pushes), want, 1e-12)
    np.testing.assert_array_equal(buf.export_state()[1].numpy(), tags)


def _hand_pushes(buf):
  p = lambda tok, tick, ids, vals: buf.push(tok, tick, tf.constant(ids, tf.int64),
                                            tf.constant(vals, tf.float32, [len(ids), 1]))
  out = []
  for tick, (tok, ids, vals) in enumerate([
      (0, [1, 1, 2], [1.0, 2.0, 5.0]), (0, [2], [7.0]),    # step 0
      (0, [2, 3], [4.0, 8.0]), (1, [4], [9.0]),           # step 1
      (1, [2], [100.0]), (2, [3], [6.0]),                 # step 2
      (2, [4], [10.0]), (2, [2], [20.0])]):               # step 3
    ready, out_ids, rows, step = p(tok, tick, ids, vals)
    if bool(ready):
      out.append((int(step), out_ids.numpy().tolist(), rows.numpy()[:, 0].tolist()))
  return out


# M = 2, iota = 0; per-ID staleness s = max(0, tag + 1 - token), tags start at -1.
#   Step 0: A (token 0) ids [1, 1, 2] rows [1, 2, 5]; B (token 0) id 2 row 7. Every tag is -1:
#     s = 0. Sums: id 1 -> 1 + 2 = 3, id 2 -> 5 + 7 = 12. Tags 1, 2 -> 0.
#   Step 1: C (token 0) ids [2, 3]: id 2 was updated in step 0, after version 0 was read:
#     s = 0 + 1 - 0 = 1 > 0 -> dropped (its dense staleness, 1 - 0, is 1 as well); id 3: s = 0.
#     D (token 1) id 4: s = 0. Tags 3, 4 -> 1; id 2 keeps tag 0.
#   Step 2: E (token 1) id 2: s = 0 + 1 - 1 = 0 (unchanged since version 1) -> kept although the
#     dense staleness is 1. F (token 2) id 3: s = 1 + 1 - 2 = 0. Tags 2, 3 -> 2.
#   Step 3: G (token 2) id 4: s = 1 + 1 - 2 = 0 -> kept. H (token 2) id 2: s = 2 + 1 - 2 = 1 ->
#     dropped, exactly the dense staleness 3 - 2 of a row updated in the step before.
def test_hand_worked_example_default_divisor_is_m():
  buf = gba_ops.SparseBuffer(5, [1], tf.float32, gba_ops.BufferConfig(2, 0))
  assert _hand_pushes(buf) == [(1, [1, 2], [1.5, 6.0]),   # 3 / 2, 12 / 2
                               (2, [3, 4], [4.0, 4.5]),   # 8 / 2, 9 / 2
                               (3, [2, 3], [50.0, 3.0]),  # 100 / 2, 6 / 2
                               (4, [4], [5.0])]           # 10 / 2
  np.testing.assert_array_equal(buf.export_state()[1].numpy(), [-1, 0, 2, 2, 3])
  stats = buf.stats()
  assert stats.dropped == 2 and stats.aggregations == 4


def test_hand_worked_example_per_id_divisor():
  buf = gba_ops.SparseBuffer(5, [1], tf.float32,
                             gba_ops.BufferConfig(2, 0, sparse_normalize="per_id"))
  assert _hand_pushes(buf) == [(1, [1, 2], [3.0, 6.0]),   # c(1) = 1, c(2) = 2
                               (2, [3, 4], [8.0, 9.0]),   # id 2 all dropped: left out
                               (3, [2, 3], [100.0, 6.0]),
                               (4, [4], [10.0])]
  np.testing.assert_array_equal(buf.export_state()[1].numpy(), [-1, 0, 2, 2, 3])


def test_row_updated_every_step_has_the_dense_staleness():
  # Row 0 is in every push, so it is updated in every aggregation: a push with token t arriving
  # at step k must then be judged by k - t, like a dense variable. With iota = 1 a lag of 1 is
  # kept and a lag of 2 is dropped.
  buf = gba_ops.SparseBuffer(1, [1], tf.float64, gba_ops.BufferConfig(1, 1))
  push = lambda tok, tick: buf.push(tok, tick, tf.constant([0], tf.int64),
                                    tf.constant([[1.0]], tf.float64))
  for k in range(3):
    assert bool(push(k, k)[0])                     # s = 0, step k -> k + 1
  ready, ids, _, step = push(2, 3)                 # step 3, token 2: s = 1 <= 1
  assert bool(ready) and ids.numpy().tolist() == [0] and int(step) == 4
  ready, ids, _, step = push(2, 4)                 # step 4, token 2: s = 2 > 1
  assert bool(ready) and ids.numpy().tolist() == [] and int(step) == 5
  stats = buf.stats()
  assert stats.dropped == 1 and stats.staleness_max == 2


def test_bad_sparse_normalize():
  with pytest.raises(ValueError, match="sparse_normalize must be one of"):
    gba_ops.BufferConfig(2, sparse_normalize="mean")


def test_empty_pushes_fill_the_batch():
  buf = gba_ops.SparseBuffer(4, [2], tf.float32, gba_ops.BufferConfig(2))
  empty = (tf.zeros([0], tf.int64), tf.zeros([0, 2]))
  assert not bool(buf.push(0, 0, *empty)[0])
  ready, ids, rows, step = buf.push(0, 1, *empty)
  assert bool(ready) and ids.shape == (0,) and rows.shape == (0, 2) and int(step) == 1


def test_nonfinite_rows_dropped_and_duplicates_ignored():
  buf = gba_ops.SparseBuffer(3, [1], tf.float32, gba_ops.BufferConfig(2))
  buf.push(0, 0, tf.constant([0], tf.int64), tf.constant([[np.nan]]))
  buf.push(0, 0, tf.constant([0], tf.int64), tf.constant([[5.0]]))  # duplicate ticket
  ready, ids, rows, _ = buf.push(0, 1, tf.constant([0, 1], tf.int64), tf.constant([[2.0], [4.0]]))
  assert bool(ready)
  np.testing.assert_array_equal(ids.numpy(), [0, 1])
  # Divisor M = 2 for both rows (the NaN push holds one of the two places).
  np.testing.assert_array_equal(rows.numpy()[:, 0], [1.0, 2.0])
  s = buf.stats()
  assert (s.nonfinite, s.duplicates, s.dropped) == (1, 1, 1)


def test_import_state_validates_and_restores(tmp_path):
  buf = gba_ops.SparseBuffer(3, [1], tf.float32, gba_ops.BufferConfig(1))
  buf.push(0, 0, tf.constant([2], tf.int64), tf.constant([[1.0]]))
  ckpt = tf.train.Checkpoint(buf=buf)
  path = ckpt.save(str(tmp_path / "ck"))
  buf.import_state(0, [-1, -1, -1])
  ckpt.restore(path)
  step, tags = buf.export_state()
  assert int(step) == 1
  np.testing.assert_array_equal(tags.numpy(), [-1, -1, 0])
  with pytest.raises(tf.errors.InvalidArgumentError, match="another shard layout"):
    buf.import_state(1, [-1, -1])
  with pytest.raises(tf.errors.InvalidArgumentError, match="must be in"):
    buf.import_state(1, [-1, 5, -1])


def _error_cases():
  def out_of_range():
    buf = gba_ops.SparseBuffer(4, [2], tf.float32, gba_ops.BufferConfig(2))
    return lambda: buf.push(0, 0, tf.constant([4], tf.int64), tf.zeros([1, 2]))

  def negative_id():
    buf = gba_ops.SparseBuffer(4, [2], tf.float32, gba_ops.BufferConfig(2))
    return lambda: buf.push(0, 0, tf.constant([-1], tf.int32), tf.zeros([1, 2]))

  def values_shape():
    buf = gba_ops.SparseBuffer(4, [2], tf.float32, gba_ops.BufferConfig(2))
    return lambda: buf.push(0, 0, tf.constant([1, 2], tf.int64), tf.zeros([2, 3]))

  def dtype_mismatch():
    buf = gba_ops.SparseBuffer(4, [2], tf.float32, gba_ops.BufferConfig(2))
    return lambda: buf.push(0, 0, tf.constant([1], tf.int64), tf.zeros([1, 2], tf.float16))

  def negative_token():
    buf = gba_ops.SparseBuffer(4, [2], tf.float32, gba_ops.BufferConfig(2))
    return lambda: buf.push(-3, 0, tf.constant([1], tf.int64), tf.zeros([1, 2]))

  def nonfinite_error():
    buf = gba_ops.SparseBuffer(4, [1], tf.float32, gba_ops.BufferConfig(2, nonfinite="error"))
    return lambda: buf.push(0, 0, tf.constant([1], tf.int64), tf.constant([[np.nan]]))

  return [(out_of_range, "out of range"), (negative_id, "out of range"),
          (values_shape, "must have shape"), (dtype_mismatch, "does not match the buffer's dtype"),
          (negative_token, "token must be >= 0"), (nonfinite_error, "NaN or Inf")]


@pytest.mark.parametrize("make,message", _error_cases())
@pytest.mark.parametrize("in_function", [False, True])
def test_bad_inputs_have_actionable_errors(make, message, in_function):
  fn = make()
  if in_function:
    fn = tf.function(fn)
  with pytest.raises(tf.errors.InvalidArgumentError, match=message):
    fn()
