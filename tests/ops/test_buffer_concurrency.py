"""Many concurrent pushers: no push lost, none applied twice (aggregate sums are exact)."""

import threading

import numpy as np
import tensorflow as tf

from tf_gba.ops import gba_ops

# M a power of two: dividing integer sums by M is exact in float64, so the checks are exact.
PUSHERS, PUSHES_EACH, M = 8, 2000, 8


def _run_threads(target):
  errors = []

  def guarded(i):
    try:
      target(i)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=guarded, args=(i,)) for i in range(PUSHERS)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors


def test_dense_buffer_under_concurrent_pushes():
  # Integer-valued float64 gradients: every partial sum is exact, so "sum of aggregates * M ==
  # sum of everything pushed" holds bit for bit only if no push is lost or counted twice.
  config = gba_ops.BufferConfig(M, staleness_threshold=gba_ops.NEVER_STALE)
  buf = gba_ops.DenseBuffer([64], tf.float64, config)
  rng = np.random.default_rng(0)
  grads = rng.integers(-50, 50, size=(PUSHERS, PUSHES_EACH, 64)).astype(np.float64)
  aggregates = [[] for _ in range(PUSHERS)]

  def pusher(i):
    for n in range(PUSHES_EACH):
      ready, agg, _ = buf.push(0, i * PUSHES_EACH + n, tf.constant(grads[i, n]))
      if bool(ready):
        aggregates[i].append(agg.numpy())

  _run_threads(pusher)
  total = PUSHERS * PUSHES_EACH
  all_aggs = sum(aggregates, [])
  stats = buf.stats()
  assert len(all_aggs) == total // M == stats.aggregations
  assert stats.pushes == total and stats.pending == total % M
  np.testing.assert_array_equal(np.sum(all_aggs, axis=0) * M, grads.sum(axis=(0, 1)))


def test_sparse_buffer_under_concurrent_pushes():
  # Every push carries every id once (shuffled) plus a few duplicates, so c(id) = M in every
  # batch and sum over aggregates of row * M must equal the per-id total pushed, exactly.
  num_rows, dim, pushes_each = 40, 2, PUSHES_EACH // 4
  config = gba_ops.BufferConfig(M, staleness_threshold=gba_ops.NEVER_STALE)
  buf = gba_ops.SparseBuffer(num_rows, [dim], tf.float64, config)
  rng = np.random.default_rng(1)
  ids = np.stack([np.concatenate([rng.permutation(num_rows), rng.integers(0, num_rows, 3)])
                  for _ in range(PUSHERS * pushes_each)]).reshape(PUSHERS, pushes_each, -1)
  vals = rng.integers(-9, 9, size=ids.shape + (dim,)).astype(np.float64)
  got = [[] for _ in range(PUSHERS)]

  def pusher(i):
    for n in range(pushes_each):
      ready, out_ids, rows, _ = buf.push(0, i * pushes_each + n, tf.constant(ids[i, n]),
                                         tf.constant(vals[i, n]))
      if bool(ready):
        got[i].append((out_ids.numpy(), rows.numpy()))

  _run_threads(pusher)
  total = PUSHERS * pushes_each
  assert total % M == 0
  aggs = sum(got, [])
  assert len(aggs) == total // M == buf.stats().aggregations
  assert buf.stats().pushes == total
  want = np.zeros((num_rows, dim))
  np.add.at(want, ids.reshape(-1), vals.reshape(-1, dim))
  have = np.zeros((num_rows, dim))
  for out_ids, rows in aggs:
    np.testing.assert_array_equal(np.sort(out_ids), np.arange(num_rows))
    have[out_ids] += rows * M
  np.testing.assert_array_equal(have, want)
