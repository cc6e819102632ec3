"""tf_gba.training.delta_checkpoints on real checkpoint files, in one process: where the deltas
go, their order, the removal of older full checkpoints' deltas, and a delta cut short ending the
chain at the one before it (it and the ones after it removed)."""

import os

import numpy as np
import tensorflow as tf

from tf_gba.ops import hash_table_ops
from tf_gba.training import delta_checkpoints
from tf_gba.training import preflight

DIM = 3


def _table():
  t = hash_table_ops.ShardedHashTable(DIM, devices=["/cpu:0"] * 2, seed=2)
  t.enable_incremental_checkpoints()
  return t


def _train(table, keys, step):
  keys = tf.constant(keys, tf.int64)
  table.lookup(keys, step)
  table.apply(keys, tf.fill([len(keys), DIM], 0.5), "sgd", learning_rate=0.1, iteration=step)


def _rows(table):
  rows = {f: v.numpy() for f, v in table.export().items()}
  order = np.argsort(rows["keys"])
  return {f: rows[f][order].tolist() for f in hash_table_ops.EXPORT_FIELDS}


def test_chain_order_pruning_and_a_delta_cut_short(tmp_path):
  model_dir = str(tmp_path)
  table = _table()
  ckpt = tf.train.Checkpoint(table=table)
  manager = tf.train.CheckpointManager(ckpt, model_dir, max_to_keep=2)
  _train(table, list(range(50)), 0)
  full = delta_checkpoints.save_full(manager, [table], model_dir, 1)
  held = []
  for step in (2, 3, 10):  # 10 after 3: the order is by step, not by name
    _train(table, [step, 100 + step], step)
    delta_checkpoints.write_delta(ckpt, [table], model_dir, full, step)
    held.append(_rows(table))
  paths = delta_checkpoints.deltas_after(model_dir, full)
  assert paths == [os.path.join(model_dir, "deltas", "ckpt-1", f"delta-{s}") for s in (2, 3, 10)]

  def restore_into(fresh):
    restore = tf.train.Checkpoint(table=fresh)
    restore.read(full).expect_partial()  # the manager also saves its save_counter
    return delta_checkpoints.restore_deltas(
        model_dir, full, lambda p: restore.read(p).expect_partial(), preflight.UNREADABLE,
        logged.append)

  logged = []
  fresh = _table()
  assert restore_into(fresh) == paths[-1] and logged == []
  assert _rows(fresh) == held[-1]

  # The second delta cut short (its data file truncated, as a full disk leaves it).
  data = [f for f in os.listdir(os.path.dirname(paths[1]))
          if f.startswith("delta-3.data")]
  assert data
  with open(os.path.join(os.path.dirname(paths[1]), data[0]), "r+b") as f:
    f.truncate(10)
  fresh = _table()
  assert restore_into(fresh) == paths[0]
  assert _rows(fresh) == held[0]
  assert len(logged) == 1 and "delta-3 is unreadable" in logged[0], logged
  assert f"resuming from {paths[0]}" in logged[0]
  assert delta_checkpoints.deltas_after(model_dir, full) == [paths[0]]  # 3 and 10 removed

  # A new full checkpoint: the deltas of the older one go, the older full one stays.
  full2 = delta_checkpoints.save_full(manager, [table], model_dir, 11)
  assert os.listdir(os.path.join(model_dir, "deltas")) == []
  assert os.path.exists(full + ".index") and os.path.exists(full2 + ".index")
  _train(table, [7], 12)
  delta = delta_checkpoints.write_delta(ckpt, [table], model_dir, full2, 12)
  assert delta_checkpoints.deltas_after(model_dir, full2) == [delta]
  assert delta_checkpoints.deltas_after(model_dir, full) == []
