"""Admission and eviction of hash table rows against a Python reference (SPEC section 6).

The reference below simulates a table from the SPEC's rules alone: a key's pending training-lookup
count until it reaches min_frequency, its row's frequency and last_seen, Adagrad's row update in
float32, and eviction (TTL, then the lowest frequency beyond max_rows, ties to the oldest
last_seen, then to the smallest key) per shard, each shard keeping its share of max_rows. A
recorded key stream is replayed through both, and every lookup's rows, every eviction's removed
keys, the surviving rows (value, accumulator, counters), the pending counts and the counters are
compared exactly.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_gba.ops import hash_table_ops

MASK = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
DIM, SEED, LR, EPS, ACC0 = 3, 11, 0.25, 1e-7, 0.1


def mix64_ref(z):
  z &= MASK
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
  return z ^ (z >> 31)


def initial_row_ref(key, a=-0.05, b=0.05):
  """The uniform initializer's row of (SEED, key): a + (b - a) * u_{j+1}, in float64 from the
  float32 bounds the op's attributes hold."""
  a, b = float(np.float32(a)), float(np.float32(b))
  base = mix64_ref((int(key) & MASK) + mix64_ref(SEED))
  return np.array([a + (b - a) * (mix64_ref(base + (j + 1) * GAMMA) >> 11) * 2.0**-53
                   for j in range(DIM)], np.float32)


class RefShard:
  """One shard's rows, pending counts and counters, from the SPEC's rules."""

  def __init__(self, min_frequency, ttl_steps, max_rows):
    self.min_frequency, self.ttl, self.max_rows = min_frequency, ttl_steps, max_rows
    self.rows = {}     # key -> [value, accumulator, frequency, last_seen]
    self.pending = {}  # key -> [count, last_seen]
    self.admitted = self.filtered = self.evicted = 0

  @property
  def drops_missing(self):
    return self.min_frequency > 1 or self.ttl > 0 or self.max_rows > 0

  def _insert(self, key):
    self.rows[key] = [initial_row_ref(key), np.full(DIM, ACC0, np.float32), 0, -1]
    self.admitted += 1
    return self.rows[key]

  def lookup(self, key, step):
    if key in self.rows:
      row = self.rows[key]
    elif self.min_frequency > 1:
      p = self.pending.setdefault(key, [0, step])
      p[0] += 1
      p[1] = step
      if p[0] < self.min_frequency:
        return np.zeros(DIM, np.float32)
      del self.pending[key]
      row = self._insert(key)
      row[2] = self.min_frequency - 1
    else:
      row = self._insert(key)
    row[2] += 1
    row[3] = step
    return row[0].copy()

  def apply(self, key, grad):
    if key not in self.rows:
      if self.drops_missing:
        self.filtered += 1
        return
      self._insert(key)
    row = self.rows[key]
    row[1] = row[1] + grad * grad
    row[0] = row[0] - np.float32(LR) * grad / np.sqrt(row[1] + np.float32(EPS))

  def evict(self, step):
    out = []
    if self.ttl:
      out += [k for k, r in self.rows.items() if step - r[3] > self.ttl]
      self.pending = {k: p for k, p in self.pending.items() if step - p[1] <= self.ttl}
    left = sorted((r[2], r[3], k) for k, r in self.rows.items() if k not in out)
    if self.max_rows and len(left) > self.max_rows:
      out += [k for _, _, k in left[:len(left) - self.max_rows]]
    for k in out:
      del self.rows[k]
    self.evicted += len(out)
    return sorted(out)


class RefTable:
  """RefShards keyed by mix64(key) mod P, each with its share of max_rows."""

  def __init__(self, shards, min_frequency=0, ttl_steps=0, max_rows=0):
    budgets = [max_rows // shards + (i < max_rows % shards) if max_rows else 0
               for i in range(shards)]
    self.shards = [RefShard(min_frequency, ttl_steps, b) for b in budgets]

  def of(self, key):
    return self.shards[mix64_ref(key) % len(self.shards)]

  def lookup(self, keys, step):
    return np.stack([self.of(k).lookup(k, step) for k in keys])

  def apply(self, keys, grads):
    summed = {}
    for k, g in zip(keys, grads):  # duplicates summed first, in order of appearance
      summed[k] = summed[k] + g if k in summed else g.copy()
    for k, g in summed.items():
      self.of(k).apply(k, g)

  def evict(self, step):
    return sorted(sum((s.evict(step) for s in self.shards), []))

  def counters(self):
    return {"rows": sum(len(s.rows) for s in self.shards),
            "pending": sum(len(s.pending) for s in self.shards),
            "admitted": sum(s.admitted for s in self.shards),
            "filtered": sum(s.filtered for s in self.shards),
            "evicted": sum(s.evicted for s in self.shards)}


def _stream(steps=48, universe=40, batch=9, seed=0):
  """Per step: a batch of keys (Zipf-like over `universe`, repeats allowed) and its gradients."""
  rng = np.random.default_rng(seed)
  keys = rng.integers(-2**62, 2**62, size=universe)
  weights = 1.0 / np.arange(1, universe + 1)
  weights /= weights.sum()
  out = []
  for _ in range(steps):
    batch_keys = [int(k) for k in rng.choice(keys, size=batch, p=weights)]
    grads = (rng.integers(-8, 8, size=(batch, DIM)) / 8).astype(np.float32)
    out.append((batch_keys, grads))
  return out


def _check_against(table, ref):
  export = table.export()
  keys = export["keys"].numpy()
  order = np.argsort(keys)
  want_keys = sorted(k for s in ref.shards for k in s.rows)
  np.testing.assert_array_equal(keys[order], want_keys)
  want = [ref.of(k).rows[k] for k in want_keys]
  if want_keys:
    np.testing.assert_array_equal(export["values"].numpy()[order], np.stack([w[0] for w in want]))
    np.testing.assert_array_equal(export["slots"].numpy()[order][:, 0],
                                  np.stack([w[1] for w in want]))
  np.testing.assert_array_equal(export["frequency"].numpy()[order], [w[2] for w in want])
  np.testing.assert_array_equal(export["last_seen"].numpy()[order], [w[3] for w in want])
  pending = {int(k): (int(c), int(s)) for k, c, s in zip(export["pending_keys"].numpy(),
                                                          export["pending_counts"].numpy(),
                                                          export["pending_last_seen"].numpy())}
  assert pending == {k: tuple(p) for s in ref.shards for k, p in s.pending.items()}
  assert table.counters() == ref.counters()


@pytest.mark.parametrize("shards,min_frequency,ttl_steps,max_rows,interval", [
    (1, 3, 0, 0, 4),     # admission only
    (1, 0, 6, 0, 4),     # time-to-live only
    (1, 0, 0, 12, 3),    # budget only
    (2, 2, 8, 13, 5),    # all three, the budget split 7 + 6 over two shards
])
def test_recorded_stream_matches_reference(shards, min_frequency, ttl_steps, max_rows, interval):
  table = hash_table_ops.ShardedHashTable(DIM, devices=[""] * shards, seed=SEED,
                                          min_frequency=min_frequency, ttl_steps=ttl_steps,
                                          max_rows=max_rows)
  ref = RefTable(shards, min_frequency, ttl_steps, max_rows)
  evicted_total = 0
  stream = _stream()
  for step, (keys, grads) in enumerate(stream):
    got = table.lookup(tf.constant(keys, tf.int64), step).numpy()
    want = ref.lookup(keys, step)
    np.testing.assert_array_equal(got, want)
    table.apply(tf.constant(keys, tf.int64), grads, "adagrad", learning_rate=LR, epsilon=EPS,
                iteration=step, initial_accumulator=ACC0)
    ref.apply(keys, grads)
    if (step + 1) % interval == 0 or step + 1 == len(stream):  # and once at the end
      removed = sorted(int(k) for s in table.shards
                       for k in s.evict(step + 1)["keys"].numpy())
      want = ref.evict(step + 1)
      assert removed == want
      evicted_total += len(want)
  _check_against(table, ref)
  counters = table.counters()
  # The stream exercises what the case configures.
  assert counters["evicted"] == evicted_total
  assert (counters["evicted"] > 0) == bool(ttl_steps or max_rows)
  # Every apply follows its own lookup here: only keys not yet admitted are filtered.
  assert (counters["filtered"] > 0) == (min_frequency > 1)
  assert counters["rows"] == counters["admitted"] - counters["evicted"]
  if max_rows:
    per_shard = [int(s.size()[0]) for s in table.shards]
    assert all(n <= b for n, b in zip(per_shard, [s.max_rows for s in ref.shards]))


def test_admission_zero_rows_until_kth_lookup_and_find_reads_zero():
  table = hash_table_ops.ShardedHashTable(DIM, seed=SEED, min_frequency=3)
  k = tf.constant([5, 9], tf.int64)
  for step in range(2):
    np.testing.assert_array_equal(table.lookup(k, step).numpy(), np.zeros((2, DIM)))
    np.testing.assert_array_equal(table.find(k).numpy(), np.zeros((2, DIM)))
  table.apply(k, np.ones((2, DIM), np.float32), "sgd", learning_rate=1.0)
  assert table.counters() == {"rows": 0, "pending": 2, "admitted": 0, "filtered": 2,
                              "evicted": 0}
  # The third lookup admits: the initial row, frequency 3 (all its training lookups).
  np.testing.assert_array_equal(table.lookup(k, 2).numpy(),
                                np.stack([initial_row_ref(5), initial_row_ref(9)]))
  export = table.export()
  np.testing.assert_array_equal(export["frequency"].numpy(), [3, 3])
  assert export["pending_keys"].numpy().size == 0
  assert table.counters()["admitted"] == 2


def test_evicted_key_returns_to_its_initial_row_and_zero_slots():
  table = hash_table_ops.ShardedHashTable(DIM, seed=SEED, ttl_steps=2, min_frequency=2)
  k = tf.constant([77], tf.int64)
  table.lookup(k, 0)
  table.lookup(k, 1)
  table.apply(k, np.full((1, DIM), 0.5, np.float32), "adagrad", learning_rate=LR,
              initial_accumulator=ACC0)
  trained = table.export()["values"].numpy()[0]
  assert not np.array_equal(trained, initial_row_ref(77))
  removed = table.shards[0].evict(4)  # 4 - 1 > 2
  np.testing.assert_array_equal(removed["keys"].numpy(), [77])
  np.testing.assert_array_equal(removed["values"].numpy()[0], trained)
  assert table.size() == 0
  # Back: admission again (zero row at its first lookup), then its initial row, slots at Adagrad's
  # initial accumulator, tag -1, frequency counted from zero.
  np.testing.assert_array_equal(table.lookup(k, 5).numpy(), np.zeros((1, DIM)))
  np.testing.assert_array_equal(table.lookup(k, 6).numpy()[0], initial_row_ref(77))
  export = table.export()
  np.testing.assert_array_equal(export["slots"].numpy()[0, 0], np.full(DIM, ACC0, np.float32))
  np.testing.assert_array_equal(export["tags"].numpy(), [-1])
  np.testing.assert_array_equal(export["frequency"].numpy(), [2])
  assert table.counters()["evicted"] == 1 and table.counters()["admitted"] == 2


def test_eviction_frees_whole_blocks():
  table = hash_table_ops.ShardedHashTable(DIM, max_rows=1000)
  keys = np.arange(40_000, dtype=np.int64)
  table.lookup(tf.constant(keys), 0)
  before = table.allocated_bytes()
  table.evict()
  assert table.size() == 1000
  # 40,000 rows span 3 blocks of 16,384; 1,000 rows fit in one, and the index shrinks to fit.
  assert table.allocated_bytes() < before / 3 + 1
  # The largest keys survive: equal frequency and last_seen, ties to the smallest key go first.
  np.testing.assert_array_equal(np.sort(table.export()["keys"].numpy()), keys[-1000:])


def test_checkpoint_evicts_first_and_carries_pending_counts(tmp_path):
  table = hash_table_ops.ShardedHashTable(DIM, devices=["", ""], seed=SEED, min_frequency=2,
                                          ttl_steps=3)
  table.lookup(tf.constant([1, 2, 3], tf.int64), 0)  # pending
  table.lookup(tf.constant([1, 2], tf.int64), 1)     # rows
  table.lookup(tf.constant([3, 4, 5], tf.int64), 4)  # 3 admitted; 4, 5 pending
  table.lookup(tf.constant([5], tf.int64), 5)        # 5 admitted
  for shard in table.shards:  # as under GBA, every shard applies each global step: its step is 6
    shard.apply(tf.zeros([0], tf.int64), tf.zeros([0, DIM]), "sgd", learning_rate=1.0,
                iteration=5)
  path = tf.train.Checkpoint(t=table).write(str(tmp_path / "ckpt"))
  # Saving evicted at step 6: rows 1 and 2 (last seen at 1); pending 4 (seen at 4) stays.
  assert sorted(table.export()["keys"].numpy().tolist()) == [3, 5]
  restored = hash_table_ops.ShardedHashTable(DIM, devices=["", "", ""], seed=SEED,
                                             min_frequency=2, ttl_steps=3)
  tf.train.Checkpoint(t=restored).read(path).assert_consumed()
  got = restored.export()
  assert sorted(got["keys"].numpy().tolist()) == [3, 5]
  assert dict(zip(got["pending_keys"].numpy().tolist(),
                  got["pending_counts"].numpy().tolist())) == {4: 1}
  # Key 4's count went with it: its next lookup admits it.
  np.testing.assert_array_equal(restored.lookup(tf.constant([4], tf.int64), 6).numpy()[0],
                                initial_row_ref(4))


def test_bad_options_get_one_line():
  with pytest.raises(ValueError, match="ttl_steps must be an integer >= 0"):
    hash_table_ops.ShardedHashTable(DIM, ttl_steps=-1)
  with pytest.raises(ValueError, match="below the number of shards"):
    hash_table_ops.ShardedHashTable(DIM, devices=["", "", ""], max_rows=2)
  with pytest.raises(ValueError, match="eviction_interval must be an integer >= 1"):
    hash_table_ops.ShardedHashTable(DIM, eviction_interval=0)


def test_checkpoint_entries_of_a_table_without_admission_are_the_rows_only(tmp_path):
  # So a checkpoint written before admission existed, or by a table without it, restores into a
  # table that only evicts; a table with admission adds its pending counts.
  def entries(path):
    return {n.rsplit("/", 1)[1] for n, _ in tf.train.list_variables(path)
            if n.startswith("t/.ATTRIBUTES/")}

  table = hash_table_ops.ShardedHashTable(DIM, seed=SEED)
  table.lookup(tf.constant([1, 2, 3], tf.int64), 0)
  path = tf.train.Checkpoint(t=table).write(str(tmp_path / "plain"))
  assert entries(path) == set(hash_table_ops.EXPORT_FIELDS)
  evicting = hash_table_ops.ShardedHashTable(DIM, seed=SEED, ttl_steps=5, max_rows=2)
  tf.train.Checkpoint(t=evicting).read(path).assert_consumed()
  # Restored as saved: eviction runs at its interval and before the next save, not on restore.
  assert sorted(evicting.export()["keys"].numpy().tolist()) == [1, 2, 3]
  admitting = hash_table_ops.ShardedHashTable(DIM, seed=SEED, min_frequency=2)
  admitting.lookup(tf.constant([1], tf.int64), 0)
  path = tf.train.Checkpoint(t=admitting).write(str(tmp_path / "admitting"))
  assert entries(path) == set(hash_table_ops.EXPORT_FIELDS + hash_table_ops.PENDING_FIELDS)
