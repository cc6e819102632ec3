"""Admission counts in a counting Bloom filter (`admission_filter_cells`) against a reference.

The reference below follows the documented rules alone: a key's cells are three indices of its own
mixed stream; a training lookup of a key without a row raises, of its cells, those at their
minimum by one (conservative update, saturating at 255) and admits the key when that minimum plus
one reaches min_frequency; an eviction halves every cell when more than half are in use or, with
ttl_steps, when the last halving is ttl_steps or more steps back. A recorded key stream is replayed through both, and every lookup's
admission, the filter's cells, the rows' frequencies and the counters are compared exactly.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_gba.ops import hash_table_ops

MASK = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
SALT = 0xA0761D6478BD642F
DIM, SEED = 2, 5


def mix64_ref(z):
  z &= MASK
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
  return z ^ (z >> 31)


def cells_ref(key, cells):
  h = mix64_ref((int(key) & MASK) ^ SALT)
  return [mix64_ref(h + (j + 1) * GAMMA) % cells for j in range(3)]


class RefFilterShard:
  """One shard's admission: the filter, the rows' frequencies, admitted and pending."""

  def __init__(self, cells, min_frequency, ttl_steps):
    self.cells = np.zeros(cells, np.int64)
    self.k, self.ttl = min_frequency, ttl_steps
    self.frequency = {}  # key -> frequency of its row
    self.last_seen = {}  # key -> step of its row's latest lookup
    self.decayed_at = 0

  def lookup(self, key, step):
    """True when the key has a row after this lookup."""
    if key in self.frequency:
      self.frequency[key] += 1
      self.last_seen[key] = step
      return True
    idx = cells_ref(key, len(self.cells))
    low = min(self.cells[i] for i in idx)
    if low < 255:
      for i in set(idx):
        if self.cells[i] == low:
          self.cells[i] = low + 1
    count = min(low + 1, 255)
    if count < self.k:
      return False
    self.frequency[key] = count
    self.last_seen[key] = step
    return True

  def evict(self, step):
    if self.ttl:
      for key in [k for k, seen in self.last_seen.items() if step - seen > self.ttl]:
        del self.frequency[key], self.last_seen[key]
    due = self.ttl and step - self.decayed_at >= self.ttl
    if due or 2 * np.count_nonzero(self.cells) > len(self.cells):
      self.cells //= 2
      self.decayed_at = step


def _stream(steps=30, universe=300, batch=40, seed=3):
  rng = np.random.default_rng(seed)
  # Zipf-like: a few keys often, most rarely; distinct per step, as the layer deduplicates.
  weights = 1.0 / np.arange(1, universe + 1)
  keys = rng.permutation(universe).astype(np.int64) * 7919 - 10**6
  return [np.unique(rng.choice(keys, size=batch, p=weights / weights.sum()))
          for _ in range(steps)]


@pytest.mark.parametrize("cells,min_frequency,ttl_steps", [(64, 2, 0), (61, 3, 4), (2000, 2, 3)])
def test_recorded_stream_matches_reference(cells, min_frequency, ttl_steps):
  table = hash_table_ops.ShardedHashTable(DIM, devices=["", ""], seed=SEED,
                                          min_frequency=min_frequency, ttl_steps=ttl_steps,
                                          admission_filter_cells=cells)
  refs = [RefFilterShard(cells, min_frequency, ttl_steps) for _ in range(2)]
  shard_of = lambda k: mix64_ref(int(k)) % 2  # pylint: disable=unnecessary-lambda-assignment
  for step, keys in enumerate(_stream()):
    rows = table.lookup(tf.constant(keys), step).numpy()
    for key, row in zip(keys.tolist(), rows):
      has_row = refs[shard_of(key)].lookup(key, step)
      # A zero row until admission, the key's initial row (nonzero, uniform) from then on.
      assert bool(np.any(row != 0.0)) == has_row, (step, key)
    table.evict(step + 1)
    for ref in refs:
      ref.evict(step + 1)
  for shard, ref in zip(table.shards, refs):
    np.testing.assert_array_equal(shard.export_filter().numpy().astype(np.int64), ref.cells)
    counters = dict(zip(hash_table_ops.COUNTER_FIELDS, shard.counters().numpy().tolist()))
    assert counters["pending"] == int(np.count_nonzero(ref.cells))
    exported = shard.export()
    got = dict(zip(exported["keys"].numpy().tolist(), exported["frequency"].numpy().tolist()))
    assert got and got == ref.frequency
    assert counters["rows"] == len(ref.frequency)
    if not ttl_steps:
      assert counters["admitted"] == len(ref.frequency)
  # No pending count is kept per key: the pending fields stay empty.
  assert table.export()["pending_keys"].shape[0] == 0


def test_small_filter_admits_early_and_memory_is_fixed():
  # 20,000 distinct keys seen once into 1,024 cells: the filter saturates and false positives
  # admit keys at their first lookup; exact counts would hold 20,000 pending keys.
  table = hash_table_ops.ShardedHashTable(DIM, min_frequency=2, admission_filter_cells=1024)
  exact = hash_table_ops.ShardedHashTable(DIM, min_frequency=2)
  keys = np.arange(20000, dtype=np.int64) * 3 + 1
  before = table.allocated_bytes()
  table.lookup(tf.constant(keys[:100]), 0)
  # The first keys into an empty filter: none admitted at its first lookup.
  assert table.size() == 0
  table.lookup(tf.constant(keys[100:]), 1)
  exact.lookup(tf.constant(keys), 0)
  assert exact.size() == 0 and exact.counters()["pending"] == 20000
  assert table.size() > 0  # early admissions, as documented
  assert table.counters()["pending"] <= 1024
  # The filter's cells are allocated with the table: counting keys allocates nothing more but
  # the rows of early admissions.
  assert before >= 1024
  assert exact.allocated_bytes() > 20000 * 16


def test_checkpoint_same_shards_exact_other_shards_cellwise_max(tmp_path):
  table = hash_table_ops.ShardedHashTable(DIM, devices=["", ""], seed=SEED, min_frequency=3,
                                          admission_filter_cells=97)
  for step in range(3):
    table.lookup(tf.constant(np.arange(40, dtype=np.int64) * (step + 1)), step)
  path = tf.train.Checkpoint(t=table).write(str(tmp_path / "ckpt"))
  entries = {n.rsplit("/", 1)[1]: n for n, _ in tf.train.list_variables(path)
             if n.startswith("t/.ATTRIBUTES/")}
  assert "admission_filter" in entries and "pending_keys" not in entries
  # The save evicted first (and so halved the filters, more than half of whose cells were in
  # use): the checkpoint holds every shard's filter as it is now.
  saved = tf.train.load_variable(path, entries["admission_filter"])
  assert saved.shape == (2, 97)
  np.testing.assert_array_equal(saved, table.export_filters().numpy())

  same = hash_table_ops.ShardedHashTable(DIM, devices=["", ""], seed=SEED, min_frequency=3,
                                         admission_filter_cells=97)
  tf.train.Checkpoint(t=same).read(path).assert_consumed()
  np.testing.assert_array_equal(same.export_filters().numpy(), saved)
  np.testing.assert_array_equal(np.sort(same.export()["keys"].numpy()),
                                np.sort(table.export()["keys"].numpy()))

  other = hash_table_ops.ShardedHashTable(DIM, devices=["", "", ""], seed=SEED, min_frequency=3,
                                          admission_filter_cells=97)
  tf.train.Checkpoint(t=other).read(path).assert_consumed()
  merged = saved.max(axis=0)
  for row in other.export_filters().numpy():
    np.testing.assert_array_equal(row, merged)

  wrong = hash_table_ops.ShardedHashTable(DIM, devices=["", ""], seed=SEED, min_frequency=3,
                                          admission_filter_cells=50)
  with pytest.raises(tf.errors.InvalidArgumentError, match="restore with the value"):
    tf.train.Checkpoint(t=wrong).read(path).assert_consumed()


def test_bad_filter_options_get_one_line():
  with pytest.raises(ValueError, match="admission is off"):
    hash_table_ops.ShardedHashTable(DIM, admission_filter_cells=10)
  with pytest.raises(ValueError, match="admission_filter_cells must be an integer >= 0"):
    hash_table_ops.ShardedHashTable(DIM, min_frequency=2, admission_filter_cells=-1)
