"""Many concurrent workers on one hash table: no lookup or update lost, none applied twice."""

import threading

import numpy as np
import tensorflow as tf

from tf_gba.ops import gba_ops
from tf_gba.ops import hash_table_ops

THREADS, ROUNDS, DIM = 8, 300, 3


def _run_threads(target):
  errors = []

  def guarded(i):
    try:
      target(i)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=guarded, args=(i,)) for i in range(THREADS)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors


def test_concurrent_lookups_and_applies_are_exact():
  # Zero initial rows and SGD with lr 1 on gradients of ones: a row ends at -(number of applies
  # that contained its key), exactly, and its frequency is the number of lookups that did.
  table = hash_table_ops.ShardedHashTable(DIM, devices=["", ""], initializer="zeros")
  rng = np.random.default_rng(0)
  universe = rng.integers(-2**62, 2**62, size=64)
  batches = [[rng.choice(universe, size=12, replace=False) for _ in range(ROUNDS)]
             for _ in range(THREADS)]

  def worker(i):
    for keys in batches[i]:
      k = tf.constant(keys, tf.int64)
      table.lookup(k, 1)
      table.apply(k, tf.ones([len(keys), DIM]), "sgd", learning_rate=1.0)

  _run_threads(worker)
  counts = {}
  for per_thread in batches:
    for keys in per_thread:
      for k in keys:
        counts[int(k)] = counts.get(int(k), 0) + 1
  exported = table.export()
  got_keys = exported["keys"].numpy()
  assert sorted(got_keys.tolist()) == sorted(counts)
  want = np.array([counts[int(k)] for k in got_keys])
  np.testing.assert_array_equal(exported["frequency"].numpy(), want)
  np.testing.assert_array_equal(exported["values"].numpy(),
                                -np.repeat(want[:, None], DIM, axis=1).astype(np.float32))


def test_concurrent_keyed_pushes_lose_nothing():
  # Every push carries every key once (shuffled), so each aggregate row is the mean over M
  # pushes; with integer rows and M a power of two, sum of aggregates * M equals the total pushed.
  m, num_keys, pushes_each = 8, 30, 100
  shard = hash_table_ops.HashTableShard(DIM)
  config = gba_ops.BufferConfig(m, staleness_threshold=gba_ops.NEVER_STALE)
  buf = gba_ops.SparseBuffer(0, [DIM], tf.float32, config, keyed=True)
  rng = np.random.default_rng(1)
  keys = rng.integers(-2**62, 2**62, size=num_keys)
  order = [[rng.permutation(num_keys) for _ in range(pushes_each)] for _ in range(THREADS)]
  vals = rng.integers(-9, 9, size=(THREADS, pushes_each, num_keys, DIM)).astype(np.float32)
  got = [[] for _ in range(THREADS)]

  def pusher(i):
    for n in range(pushes_each):
      ready, out_keys, rows, _ = buf.push_keyed(0, i * pushes_each + n,
                                                tf.constant(keys[order[i][n]]),
                                                tf.constant(vals[i, n]), shard.resource_handle)
      if bool(ready):
        got[i].append((out_keys.numpy(), rows.numpy()))

  _run_threads(pusher)
  aggs = sum(got, [])
  assert len(aggs) == THREADS * pushes_each // m == buf.stats().aggregations
  total = {int(k): np.zeros(DIM) for k in keys}
  for i in range(THREADS):
    for n in range(pushes_each):
      for j, idx in enumerate(order[i][n]):
        total[int(keys[idx])] += vals[i, n, j]
  summed = {int(k): np.zeros(DIM) for k in keys}
  for out_keys, rows in aggs:
    for k, r in zip(out_keys, rows):
      summed[int(k)] += r.astype(np.float64) * m
  for k in total:
    np.testing.assert_array_equal(summed[k], total[k])
  # Every aggregation tagged every key with its step in the table.
  tags = shard.export()["tags"].numpy()
  np.testing.assert_array_equal(tags, np.full(num_keys, len(aggs) - 1))


def test_eviction_during_lookups_and_applies_loses_nothing():
  # As above, while a thread keeps evicting down to a budget of 16 rows of the 64 keys: every
  # lookup is counted exactly once, in a surviving row's frequency or in a removed row's, and
  # every gradient row is applied exactly once (-1 in a surviving or removed row's value) or
  # dropped as filtered (its row was evicted between the lookup and the apply).
  table = hash_table_ops.ShardedHashTable(DIM, devices=["", ""], initializer="zeros",
                                          max_rows=16)
  rng = np.random.default_rng(2)
  universe = rng.integers(-2**62, 2**62, size=64)
  batches = [[rng.choice(universe, size=12, replace=False) for _ in range(ROUNDS)]
             for _ in range(THREADS)]
  removed = []
  done = threading.Event()

  def evictor():
    while not done.is_set():
      for shard in table.shards:
        out = shard.evict()
        removed.append((out["keys"].numpy(), out["values"].numpy(), out["frequency"].numpy()))

  evicting = threading.Thread(target=evictor)
  evicting.start()

  def worker(i):
    for keys in batches[i]:
      k = tf.constant(keys, tf.int64)
      table.lookup(k, 1)
      table.apply(k, tf.ones([len(keys), DIM]), "sgd", learning_rate=1.0)

  try:
    _run_threads(worker)
  finally:
    done.set()
    evicting.join()
  lookups = {}
  for per_thread in batches:
    for keys in per_thread:
      for k in keys:
        lookups[int(k)] = lookups.get(int(k), 0) + 1
  exported = table.export()
  counted = {k: 0 for k in lookups}
  applied = {k: 0.0 for k in lookups}
  for k, v, f in zip(exported["keys"].numpy(), exported["values"].numpy(),
                     exported["frequency"].numpy()):
    counted[int(k)] += int(f)
    applied[int(k)] -= float(v[0])
  for keys, values, freqs in removed:
    for k, v, f in zip(keys, values, freqs):
      counted[int(k)] += int(f)
      applied[int(k)] -= float(v[0])
  assert counted == lookups
  # Each row's elements moved together.
  np.testing.assert_array_equal(exported["values"].numpy(),
                                np.repeat(exported["values"].numpy()[:, :1], DIM, axis=1))
  counters = table.counters()
  total_applies = sum(lookups.values())
  assert sum(applied.values()) + counters["filtered"] == total_applies
  assert all(0 <= applied[k] <= lookups[k] for k in lookups)
  assert counters["evicted"] == sum(len(k) for k, _, _ in removed) > 0
  assert counters["rows"] == counters["admitted"] - counters["evicted"] == len(exported["keys"])
