"""Switching Sync <-> GBA with a hash-embedding model (--embedding=hash), through checkpoints.

One chain of runs on real local clusters, each continuing the previous run's checkpoint in another
mode with the same flags: sync (every worker holds the whole table) -> gba (the table split over 2
parameter servers by key) -> sync. At each switch the table the next mode restores, written straight
back by the code the binary runs, holds exactly the keys and rows (values, slots, tags, frequencies,
last-seen steps) of the checkpoint it restored, in whatever order its shards keep them; and the
global step carries over.
"""

import numpy as np
import pytest

import tf_gba  # noqa: F401  (Keras 2 before TensorFlow; the worker function runs without conftest)
import tensorflow as tf  # noqa: E402

from tests.training import test_switching as switching  # the resave helpers
from tf_gba.ops import hash_table_ops

CHAIN = ("sync", "gba", "sync")
WORKERS, LOCAL_BATCH, STEPS = 2, 32, 8


def _config(mode, model_dir):
  return switching._config(mode, model_dir, embedding="hash")  # pylint: disable=protected-access


def _table(path):
  """The hash table's checkpoint entries in `path`, rows ordered by key."""
  reader = tf.train.load_checkpoint(path)
  names = {k.rsplit("/", 1)[1]: k for k in reader.get_variable_to_shape_map()
           if k.rsplit("/", 2)[-2:-1] == [".ATTRIBUTES"] and "table" in k}
  assert set(hash_table_ops.EXPORT_FIELDS) <= set(names), sorted(names)
  rows = {f: reader.get_tensor(names[f]) for f in hash_table_ops.EXPORT_FIELDS}
  order = np.argsort(rows["keys"])
  return {f: v[order] for f, v in rows.items()}


def _assert_same_table(saved_path, resaved_path):
  saved, resaved = _table(saved_path), _table(resaved_path)
  assert len(saved["keys"]) > 100
  for f in hash_table_ops.EXPORT_FIELDS:
    np.testing.assert_array_equal(resaved[f], saved[f], err_msg=f)
  return saved


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
  root = tmp_path_factory.mktemp("hash_switching")
  return root, switching.run_chain(root, CHAIN, _config)


def test_the_global_step_and_the_table_carry_over(chain):
  _, runs = chain
  step = 0
  rows = 0
  for mode, _, summary in runs:
    assert summary["mode"] == mode and summary["embedding"] == "hash"
    assert summary["start_global_step"] == step, (mode, summary["start_global_step"], step)
    assert summary["global_step"] == step + STEPS // WORKERS, mode  # sync and GBA: M = N
    assert 0.0 < summary["eval_auc"] < 1.0
    table = summary["hash_tables"]["categorical_embedding"]
    # Every run looks up new batches: the table only grows (no eviction configured).
    assert table["rows"] >= rows, mode
    rows, step = table["rows"], summary["global_step"]


def test_sync_table_restores_into_two_parameter_servers_row_by_row(chain):
  root, runs = chain
  mode, sync_dir, _ = runs[0]
  assert mode == "sync"
  resaved = switching.resave_ps(_config("gba", sync_dir), str(root / "resaved_gba" / "ckpt"))
  saved = _assert_same_table(tf.train.latest_checkpoint(sync_dir), resaved["path"])
  # Sync's Adam is LazyAdam on the rows, as under GBA: two slots per row.
  assert saved["slots"].shape[1] == 2


def test_gba_table_restores_into_sync_row_by_row(chain):
  root, runs = chain
  mode, gba_dir, _ = runs[1]
  assert mode == "gba"
  saved_path = tf.train.latest_checkpoint(gba_dir)
  resaved = switching.resave_sync(_config("sync", gba_dir), str(root / "resaved_sync" / "ckpt"))
  saved = _assert_same_table(saved_path, resaved)
  # GBA tagged the rows it aggregated: the tags came through the switch.
  assert saved["tags"].max() >= 0
