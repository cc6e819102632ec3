"""Incremental checkpoints of hash tables: the delta of the rows changed since a write number.

A table trains (lookups, Adagrad applies, TTL eviction, admission's pending counts), is exported
whole, trains on (some rows change, some are evicted, one evicted key comes back), and the delta
since the full export is compared with what changed between the two whole exports, computed
here from the exports alone. Then a fresh table restores full + delta and must hold, key by key,
what the trained table holds. The same through tf.train.Checkpoint over two shards.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

from tf_gba.ops import hash_table_ops

DIM = 4
FIELDS = hash_table_ops.EXPORT_FIELDS
PENDING = hash_table_ops.PENDING_FIELDS


def by_key(rows):
  """{key: (values, slots, tags, frequency, last_seen)} and {pending key: (count, last_seen)}."""
  n = {f: np.asarray(rows[f]) for f in rows}
  table = {int(k): tuple(n[f][i].tolist() for f in FIELDS[1:]) for i, k in enumerate(n["keys"])}
  pending = {int(k): (int(n["pending_counts"][i]), int(n["pending_last_seen"][i]))
             for i, k in enumerate(n.get("pending_keys", []))}
  return table, pending


def train(table, keys, step, lr=0.1):
  keys = tf.constant(keys, tf.int64)
  table.lookup(keys, step)
  grads = tf.constant(np.random.RandomState(step).normal(size=(len(keys), DIM)), tf.float32)
  table.apply(keys, grads, "adagrad", learning_rate=lr, iteration=step, epsilon=1e-7)


def shard(**kw):
  return hash_table_ops.HashTableShard(DIM, seed=5, min_frequency=2, ttl_steps=3, **kw)


def test_delta_holds_exactly_the_changes_and_restores_full_plus_delta():
  t = shard()
  t.track_changes(-1)
  for step in range(4):
    train(t, list(range(0, 40)) + [1000 + step], step)  # 1000+: looked up once, pending
    train(t, list(range(0, 40)), step)  # second lookup: rows 0..39 admitted
  full = t.export_delta(-1)
  base = int(full["sequence"])
  before, _ = by_key(full)
  assert set(before) == set(range(40))
  # Later: 0..9 keep training, 10..39 fall past the TTL and are evicted at step 9, then 15
  # comes back; 50..51 are admitted new.
  for step in range(4, 9):
    train(t, list(range(10)), step)
    train(t, list(range(10)), step)
  assert int(t.evict(9)["keys"].shape[0]) == 30
  for step in (9, 10):
    train(t, [15, 50, 51], step)
    train(t, [15, 50, 51], step)
  t.lookup(tf.constant([2000], tf.int64), 10)  # pending: one lookup of two
  after, after_pending = by_key(t.export())
  delta = t.export_delta(base)
  changed, _ = by_key(delta)
  # Reference: rows new since the full export or different from it, and the keys it held that
  # are gone now.
  expected_changed = {k for k in after if k not in before or after[k] != before[k]}
  assert set(changed) == expected_changed == set(range(10)) | {15, 50, 51}
  assert {k: changed[k] for k in changed} == {k: after[k] for k in expected_changed}
  deleted = set(np.asarray(delta["deleted_keys"]).tolist())
  assert deleted == set(before) - set(after) == set(range(10, 40)) - {15}
  # Nothing changed by exporting: the same delta again, and from its own number an empty one.
  again = t.export_delta(base)
  assert by_key(again) == by_key(delta)
  assert set(np.asarray(again["deleted_keys"]).tolist()) == deleted
  empty = t.export_delta(int(delta["sequence"]))
  assert empty["keys"].shape[0] == 0 and empty["deleted_keys"].shape[0] == 0

  fresh = shard()
  fresh.import_delta(full, replace=True)
  fresh.import_delta(delta, replace=False)
  restored, restored_pending = by_key(fresh.export())
  assert restored == after
  assert restored_pending == after_pending and after_pending  # pending counts come back too
  # The restored table trains on its rows exactly as the original.
  train(t, [1, 2, 50], 11)
  train(fresh, [1, 2, 50], 11)
  assert by_key(fresh.export()) == by_key(t.export())


def test_tombstones_only_when_tracked_and_pruned_at_a_full_checkpoint():
  untracked = shard()
  for step in range(2):
    train(untracked, [1, 2, 3], step)
    train(untracked, [1, 2, 3], step)
  untracked.evict(10)
  assert untracked.size()[0] == 0
  assert untracked.export_delta(-1)["deleted_keys"].shape[0] == 0  # nothing kept

  t = shard()
  t.track_changes(-1)
  for step in range(2):
    train(t, [1, 2, 3], step)
    train(t, [1, 2, 3], step)
  start = int(t.export_delta(-1)["sequence"])
  t.evict(10)
  assert sorted(np.asarray(t.export_delta(start)["deleted_keys"]).tolist()) == [1, 2, 3]
  _, bytes_with = t.size()
  # A full checkpoint written at the current number: the removals before it are forgotten.
  seq = int(t.export_delta(-1)["sequence"])
  assert int(t.track_changes(seq)) == seq
  assert t.export_delta(start)["deleted_keys"].shape[0] == 0
  assert int(t.size()[1]) < int(bytes_with)


def test_delta_errors_say_what_to_fix():
  t = shard()
  train(t, [1, 2], 0)
  train(t, [1, 2], 0)
  rows = t.export_delta(-1)
  bad = dict(rows, deleted_keys=tf.constant([1], tf.int64))
  with pytest.raises(tf.errors.InvalidArgumentError, match="also has a row in the delta"):
    shard().import_delta(bad, replace=False)
  with pytest.raises(tf.errors.InvalidArgumentError, match="takes no deleted_keys"):
    shard().import_delta(bad, replace=True)
  sgd = shard()
  sgd.import_delta(rows, replace=True)
  other = dict(rows, slots=tf.zeros([2, 2, DIM]))  # Adam's two slots onto Adagrad rows
  with pytest.raises(tf.errors.InvalidArgumentError, match="restore the full checkpoint"):
    sgd.import_delta(other, replace=False)


def sharded(num_shards):
  t = hash_table_ops.ShardedHashTable(DIM, devices=["/cpu:0"] * num_shards, seed=5, ttl_steps=5)
  t.enable_incremental_checkpoints()
  return t


def save(ckpt, table, path, full):
  table.stage_checkpoint(full=full)
  written = ckpt.write(path)
  table.checkpoint_written()
  return written


def file_bytes(prefix):
  d = os.path.dirname(prefix)
  return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)
             if f.startswith(os.path.basename(prefix) + "."))


def test_checkpoint_full_then_deltas_on_two_shards(tmp_path):
  t = sharded(2)
  ckpt = tf.train.Checkpoint(table=t)
  with pytest.raises(ValueError, match="needs a full checkpoint before it"):
    t.stage_checkpoint(full=False)
  for step in range(3):
    train(t, list(range(200)), step)
  full = save(ckpt, t, str(tmp_path / "full" / "ckpt"), full=True)
  for step in range(3, 6):
    train(t, list(range(10)), step)  # 190 rows fall past the TTL (5) by step 9
  d1 = save(ckpt, t, str(tmp_path / "d1" / "ckpt"), full=False)
  t.evict(9)
  train(t, [5, 300, 301], 9)
  d2 = save(ckpt, t, str(tmp_path / "d2" / "ckpt"), full=False)
  held = by_key(t.export())
  assert set(held[0]) == set(range(10)) | {300, 301}
  # A staged save that is never written loses nothing: the next delta still holds its rows.
  train(t, [7], 10)
  t.stage_checkpoint(full=False)
  t.discard_staged_checkpoint()
  t.stage_checkpoint(full=False)
  assert np.asarray(t.staged_entries["keys"]).tolist() == [7]
  t.discard_staged_checkpoint()
  assert file_bytes(d1) < file_bytes(full) / 5

  for num_shards in (2, 1):
    r = sharded(num_shards)
    restore = tf.train.Checkpoint(table=r)
    for path in (full, d1, d2):
      restore.read(path).assert_consumed()
    r.checkpoint_restored()
    assert by_key(r.export()) == held
    # The next delta of the restored table starts from the restore.
    train(r, [5], 11)
    r.stage_checkpoint(full=False)
    staged = r.staged_entries
    assert np.asarray(staged["keys"]).tolist() == [5]
    assert int(staged["delta"]) == 1
