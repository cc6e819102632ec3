"""A keyed sparse buffer (hash rows) judges rows exactly as the partitioned buffer does.

Same event sequence (tokens, ids, rows) to a partitioned SparseBuffer (ids are row numbers) and to
a keyed one (ids mapped to arbitrary int64 keys, tags kept in a hash table's rows): every push's
output, every statistic and every final tag must be equal (SPEC sections 1 and 6). The NumPy
reference of the rule itself is tests/ops/test_sparse_buffer.py's; here a zero-staleness sequence
is also checked against the Sync mean written out below.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_gba.ops import gba_ops
from tf_gba.ops import hash_table_ops

NUM_ROWS, DIM = 12, 3


def _key(i):
  return int(i) * 7919 - 2**40  # any injective map onto int64 keys


@pytest.mark.parametrize("decay,sparse_normalize,normalize", [
    ("threshold", "num_aggregate", "num_aggregate"), ("threshold", "per_id", "num_aggregate"),
    ("exponential", "num_aggregate", "kept"), ("threshold", "per_id", "kept")])
def test_keyed_buffer_equals_partitioned_buffer(decay, sparse_normalize, normalize):
  m = 3
  config = gba_ops.BufferConfig(m, staleness_threshold=1, decay=decay,
                                sparse_normalize=sparse_normalize, normalize=normalize)
  part = gba_ops.SparseBuffer(NUM_ROWS, [DIM], tf.float32, config)
  keyed = gba_ops.SparseBuffer(0, [DIM], tf.float32, config, keyed=True)
  table = hash_table_ops.HashTableShard(DIM)
  rng = np.random.default_rng(3)
  step = 0
  for n in range(60):
    ids = rng.integers(0, NUM_ROWS, size=rng.integers(0, 6))  # empty pushes and duplicates too
    rows = rng.normal(size=(len(ids), DIM)).astype(np.float32)
    token = max(0, step - int(rng.integers(0, 4)))
    r1, ids1, rows1, step1 = part.push(token, n, tf.constant(ids, tf.int64), tf.constant(rows))
    keys = np.array([_key(i) for i in ids], np.int64)
    r2, keys2, rows2, step2 = keyed.push_keyed(token, n, tf.constant(keys, tf.int64),
                                               tf.constant(rows), table.resource_handle)
    assert bool(r1) == bool(r2) and int(step1) == int(step2)
    assert [_key(i) for i in ids1.numpy()] == keys2.numpy().tolist()
    np.testing.assert_array_equal(rows1.numpy(), rows2.numpy())
    step = int(step1)
  assert step >= 15
  s1, s2 = part.stats(), keyed.stats()
  assert (s1.dropped, s1.staleness_sum, s1.aggregations) == (s2.dropped, s2.staleness_sum,
                                                             s2.aggregations)
  assert s1.staleness_max > 1  # the sequence did exercise the decay (iota = 1)
  np.testing.assert_array_equal(s1.histogram, s2.histogram)
  _, tags = part.export_state()
  exported = table.export()
  table_tags = dict(zip(exported["keys"].numpy().tolist(), exported["tags"].numpy().tolist()))
  for i, tag in enumerate(tags.numpy()):
    assert table_tags.get(_key(i), -1) == tag


def test_zero_staleness_equals_sync_mean_for_hash_rows():
  # Every entry of step k carries token k: GBA's aggregate must be the all-reduce Sync's mean,
  # sum over the M replicas of each key's row divided by M (absent rows counting as zero).
  m = 4
  keyed = gba_ops.SparseBuffer(0, [DIM], tf.float32, gba_ops.BufferConfig(m), keyed=True)
  table = hash_table_ops.HashTableShard(DIM)
  rng = np.random.default_rng(5)
  ticket = 0
  for k in range(5):
    batches = []
    for _ in range(m):
      keys = rng.integers(-2**62, 2**62, size=0) if rng.random() < 0.2 else rng.choice(
          [11, -3, 2**50, 7, 8], size=3)
      batches.append((keys, rng.normal(size=(len(keys), DIM)).astype(np.float32)))
    want = {}
    for keys, rows in batches:
      for key, row in zip(keys, rows):
        want[int(key)] = want.get(int(key), 0.0) + row.astype(np.float64)
    for keys, rows in batches:
      ready, out_keys, out_rows, _ = keyed.push_keyed(k, ticket, tf.constant(keys, tf.int64),
                                                      tf.constant(rows), table.resource_handle)
      ticket += 1
    assert bool(ready)
    got = dict(zip(out_keys.numpy().tolist(), out_rows.numpy()))
    assert sorted(got) == sorted(want)
    for key, total in want.items():
      np.testing.assert_allclose(got[key], total / m, rtol=1e-6, atol=1e-7)
  assert keyed.stats().dropped == 0


def test_keyed_and_partitioned_pushes_refuse_the_other_kind():
  config = gba_ops.BufferConfig(2)
  part = gba_ops.SparseBuffer(4, [DIM], tf.float32, config)
  keyed = gba_ops.SparseBuffer(0, [DIM], tf.float32, config, keyed=True)
  table = hash_table_ops.HashTableShard(DIM)
  with pytest.raises(tf.errors.InvalidArgumentError, match="is not keyed"):
    part.push_keyed(0, 0, tf.constant([1], tf.int64), tf.ones([1, DIM]), table.resource_handle)
  with pytest.raises(tf.errors.InvalidArgumentError, match="is keyed"):
    keyed.push(0, 1, tf.constant([1], tf.int64), tf.ones([1, DIM]))
  wide = hash_table_ops.HashTableShard(DIM + 1)
  with pytest.raises(tf.errors.InvalidArgumentError, match="do not match"):
    keyed.push_keyed(0, 2, tf.constant([1], tf.int64), tf.ones([1, DIM]), wide.resource_handle)
  with pytest.raises(ValueError, match="num_rows must be 0"):
    gba_ops.SparseBuffer(3, [DIM], tf.float32, config, keyed=True)
