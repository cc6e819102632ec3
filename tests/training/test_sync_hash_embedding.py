"""`--mode=sync --embedding=hash` on 4 real worker processes (MultiWorkerMirroredStrategy).

Every worker holds the whole table. After training, each worker's table (keys, values, Adam's m
and v, tags, frequency, last_seen) is the same, key by key, on all four; frequencies and last_seen
are those of the union of the four workers' batches of each step, recomputed here from the same
data shards; a rerun restores the table from the sync checkpoint and goes on counting, and a
--hash_max_rows budget evicts the same rows everywhere, those the eviction rule names.
"""

import dataclasses
import os

import tf_gba  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads Keras)
import numpy as np
import pytest
import tensorflow as tf

from tf_gba import data as data_lib
from tf_gba import models as models_lib
from tf_gba.distribute import collective_cluster
from tf_gba.models.embedding import FieldKeys
from tf_gba.ops import hash_table_ops
from tf_gba.training.config import TrainConfig

_TARGET = "tf_gba.training.sync_job:run_worker"
_ENV = {"CUDA_VISIBLE_DEVICES": ""}
WORKERS, BATCH = 4, 16
LAYER = "categorical_embedding"
FIELDS = hash_table_ops.EXPORT_FIELDS


def _config(model_dir, **overrides) -> TrainConfig:
  values = dict(mode="sync", model="deepfm", data="synthetic", data_options="num_examples=2000",
                embedding="hash", num_workers=WORKERS, local_batch_size=BATCH,
                steps=3 * WORKERS, log_every=3, eval_examples=256, learning_rate=0.01,
                model_dir=str(model_dir), stragglers="none", export_dir="")
  values.update(overrides)
  return TrainConfig(**values)


def _run(cfg: TrainConfig, tables_dir):
  return collective_cluster.run_collective_cluster(
      _TARGET, num_workers=cfg.num_workers,
      kwargs={"config": dataclasses.asdict(cfg), "tables_dir": str(tables_dir)},
      timeout_s=300, env=_ENV)


def _tables(tables_dir, num_workers=WORKERS):
  """Each worker's table as it wrote it, ordered by key."""
  out = []
  for task in range(num_workers):
    with np.load(os.path.join(tables_dir, f"worker_{task}.npz")) as z:
      out.append({f: z[f"{LAYER}/{f}"] for f in FIELDS})
  return out


def _step_keys(cfg: TrainConfig, global_steps: int):
  """[step] -> the set of keys of the four workers' batches at that step (their data shards,
  read here as each worker reads its own)."""
  tf.random.set_seed(None)  # the workers set no global seed: the same shuffle order here
  options = cfg.data_kwargs()
  info = data_lib.data_info(cfg.data, **options)
  model = models_lib.build_model(cfg.model, info, embedding_dim=cfg.embedding_dim, seed=cfg.seed,
                                 embedding="hash")
  keys_of = next(layer for layer in model.layers if isinstance(layer, FieldKeys))
  iterators = [iter(data_lib.make_dataset(
      cfg.data, split="train", batch_size=cfg.local_batch_size, num_shards=cfg.num_workers,
      shard_index=i, day=cfg.day, repeat=True, shuffle_seed=cfg.seed, **options))
               for i in range(cfg.num_workers)]
  steps = []
  for _ in range(global_steps):
    union = set()
    for it in iterators:
      features, _ = next(it)
      union.update(int(k) for k in keys_of(features).numpy().flat)
    steps.append(union)
  return steps


def _counts(steps, first_step=0, counts=None):
  """{key: [frequency, last_seen]} after one training lookup of each step's union."""
  counts = {k: list(v) for k, v in (counts or {}).items()}
  for i, union in enumerate(steps):
    for k in union:
      c = counts.setdefault(k, [0, 0])
      c[0] += 1
      c[1] = first_step + i
  return counts


def _assert_counts(table, counts):
  np.testing.assert_array_equal(table["keys"], sorted(counts))
  np.testing.assert_array_equal(table["frequency"], [counts[k][0] for k in sorted(counts)])
  np.testing.assert_array_equal(table["last_seen"], [counts[k][1] for k in sorted(counts)])


def _assert_same_tables(tables):
  for task, table in enumerate(tables[1:], 1):
    for f in FIELDS:
      np.testing.assert_array_equal(table[f], tables[0][f], err_msg=f"worker {task}: {f}")


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
  root = tmp_path_factory.mktemp("sync_hash")
  cfg = _config(root / "model")
  return cfg, _run(cfg, root / "tables_1"), _tables(root / "tables_1"), root


def test_four_workers_hold_the_same_table_key_by_key(first_run):
  cfg, results, tables, _ = first_run
  assert [r["global_step"] for r in results] == [3] * WORKERS
  assert len({r["weights_digest"] for r in results}) == 1
  assert len({r["tables_digest"] for r in results}) == 1
  _assert_same_tables(tables)
  table = tables[0]
  assert table["slots"].shape[1:] == (2, cfg.embedding_dim + 1)  # LazyAdam's m and v
  assert np.all(np.isfinite(table["values"])) and np.any(table["slots"] != 0)
  # Counted from the all-gathered keys: each step's union of the four batches, once.
  _assert_counts(table, _counts(_step_keys(cfg, 3)))
  report = results[0]["hash_tables"][LAYER]
  assert report["rows"] == len(table["keys"]) and report["rows_per_shard"] == [report["rows"]]
  assert report["row_bytes"] == (cfg.embedding_dim + 1) * 3 * 4 and report["evicted"] == 0
  assert 0.0 <= results[0]["eval_auc"] <= 1.0


def test_the_count_reference_can_tell_one_worker_from_all(first_run):
  cfg, _, tables, _ = first_run
  one = _counts([s for s in _step_keys(dataclasses.replace(cfg, num_workers=1), 3)])
  assert sorted(one) != tables[0]["keys"].tolist()


def test_rerun_restores_the_table_and_a_budget_evicts_the_same_rows_everywhere(first_run):
  cfg, first, tables, root = first_run
  max_rows = len(tables[0]["keys"]) - 50
  again = dataclasses.replace(cfg, steps=2 * WORKERS, hash_max_rows=max_rows)
  results = _run(again, root / "tables_2")
  second = _tables(root / "tables_2")
  for r in results:
    assert r["restored_from"] == first[0]["checkpoint"]
    assert r["restored_digest"] == first[0]["weights_digest"]
    assert r["start_global_step"] == 3 and r["global_step"] == 5
  assert len({r["tables_digest"] for r in results}) == 1
  _assert_same_tables(second)
  # The rerun reads the same shards from their start again, at global steps 3 and 4, on top of
  # the restored counts; the save then keeps the max_rows most frequent rows (ties: the latest
  # last_seen, then the largest key).
  counts = _counts(_step_keys(cfg, 2), first_step=3, counts=_counts(_step_keys(cfg, 3)))
  kept = sorted(counts, key=lambda k: (counts[k][0], counts[k][1], k))[-max_rows:]
  assert len(counts) > max_rows
  _assert_counts(second[0], {k: counts[k] for k in kept})
  report = results[0]["hash_tables"][LAYER]
  assert report["rows"] == max_rows and report["evicted"] == len(counts) - max_rows
  # Rows of keys the rerun did not look up are as the first run left them.
  untouched = np.isin(second[0]["keys"], list(set(tables[0]["keys"].tolist()) -
                                              set().union(*_step_keys(cfg, 2))))
  assert untouched.any()
  before = {int(k): i for i, k in enumerate(tables[0]["keys"])}
  idx = [before[int(k)] for k in second[0]["keys"][untouched]]
  for f in ("values", "slots"):
    np.testing.assert_array_equal(second[0][f][untouched], tables[0][f][idx])
