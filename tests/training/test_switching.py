"""Switching modes from a checkpoint, as users do it: same binary, same flags, another --mode.

One chain of runs on real local clusters, each continuing the previous run's checkpoint in another
mode with the same learning rate, optimizer and global batch:

  sync -> gba (2 PS) -> hop_bw -> sync -> bsp -> hop_bs -> gba -> async (bare Adam) -> sync

so every mode is entered from sync or gba and left into one of them. At each switch the global step
carries over. At the two switches where the layout changes (sync: every variable whole, on
MultiWorkerMirroredStrategy workers; gba: the embedding split over 2 parameter servers, plus the
GBA wrapper's tokens and row tags), the checkpoint is restored in the new layout by the code the
binary runs and written straight back; the two checkpoints are then compared tensor by tensor, over
every key they hold.
"""

import dataclasses
import os
import shutil

import numpy as np
import pytest

import tf_gba  # noqa: F401  (Keras 2 before TensorFlow; the worker function runs without conftest)
import tensorflow as tf  # noqa: E402

from tf_gba.distribute import collective_cluster
from tf_gba.training import runner
from tf_gba.training import sync_job
from tf_gba.training.config import TrainConfig

CHAIN = ("sync", "gba", "hop_bw", "sync", "bsp", "hop_bs", "gba", "async", "sync")
WORKERS, LOCAL_BATCH, STEPS = 2, 32, 8   # every mode: 8 worker steps of 32 = 256 examples
# The GBA wrapper's own state, absent from a plain-Adam checkpoint (sync, bare async).
GBA_STATE = "model/optimizer/gba/"
# What a parameter-server run keeps beside the model: GBA's buffers and tokens, the shared data
# list's position and the straggler position. A checkpoint written back by sync has none of it.
RUN_STATE = (GBA_STATE, "data_position/", "straggler_position/")


def _config(mode, model_dir, **extra):
  # vocab 8,000 x dim 8 x 4 B per field: the shared table is split over both parameter servers.
  values = dict(mode=mode, model="deepfm", data="synthetic",
                data_options="num_examples=4000,vocab_size=8000", num_ps=2,
                num_workers=WORKERS, local_batch_size=LOCAL_BATCH, steps=STEPS, log_every=4,
                eval_examples=512, learning_rate=0.01, model_dir=model_dir, stragglers="none",
                async_staleness_stats=(mode != "async"), export_dir="")
  values.update(extra)
  return TrainConfig(**values)


def resave_sync_worker(config: dict, out: str) -> dict:
  """In a MultiWorkerMirroredStrategy worker: the sync job's restore, written straight back."""
  cfg = TrainConfig(**config)
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  model, _, restored_from = sync_job.build_and_restore(cfg, strategy)
  tf.train.Checkpoint(model=model).write(out)
  return {"restored_from": restored_from}


def resave_sync(cfg: TrainConfig, out: str) -> str:
  [result] = collective_cluster.run_collective_cluster(
      f"{os.path.abspath(__file__)}:resave_sync_worker", num_workers=1,
      kwargs={"config": dataclasses.asdict(cfg), "out": out}, timeout_s=180,
      env={"CUDA_VISIBLE_DEVICES": ""})
  assert result["restored_from"] == tf.train.latest_checkpoint(cfg.model_dir)
  return out


def resave_ps(cfg: TrainConfig, out: str) -> dict:
  """The parameter-server job's restore (2 PS), written straight back; and how it is sharded."""
  with runner._cluster(cfg) as (resolver, _):  # pylint: disable=protected-access
    strategy = runner.make_strategy(cfg, resolver)
    job = runner._Job(cfg, strategy)  # pylint: disable=protected-access
    assert job.restored_from == tf.train.latest_checkpoint(cfg.model_dir)
    shards = {v.device for v in job.model.trainable_variables if "/part_" in v.name}
    tokens = int(job.optimizer._token_source().count().numpy())  # pylint: disable=protected-access
    step = int(job.optimizer.iterations.numpy())
    tf.train.Checkpoint(model=job.model).write(out)
  return {"path": out, "shard_devices": shards, "tokens": tokens, "step": step}


def _tensors(path):
  reader = tf.train.load_checkpoint(path)
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if k != "_CHECKPOINTABLE_OBJECT_GRAPH" and not k.startswith("save_counter")}


def assert_same_checkpoint(saved_path, resaved_path):
  """Every tensor the two checkpoints share is equal; they differ only by the GBA state."""
  saved, resaved = _tensors(saved_path), _tensors(resaved_path)
  only = set(saved) ^ set(resaved)
  assert all(k.startswith(RUN_STATE) for k in only), sorted(only)
  shared = sorted(set(saved) & set(resaved))
  assert sum(not k.startswith(RUN_STATE) for k in shared) >= 10, shared
  for key in shared:
    np.testing.assert_array_equal(resaved[key], saved[key], err_msg=key)
  return shared


def run_chain(root, modes, config=_config):
  """Runs `modes` in order, each starting from a copy of the previous run's model_dir:
  [(mode, model_dir, summary)]."""
  runs, previous = [], None
  for i, mode in enumerate(modes):
    model_dir = str(root / f"{i}_{mode}")
    if previous:
      shutil.copytree(previous, model_dir)
      os.remove(os.path.join(model_dir, "summary.json"))
    summary = runner.run(config(mode, model_dir))
    runs.append((mode, model_dir, summary))
    previous = model_dir
  return runs


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
  """Runs CHAIN; each run starts from a copy of the previous run's model_dir."""
  root = tmp_path_factory.mktemp("switching")
  return root, run_chain(root, CHAIN)


def test_every_mode_continues_the_global_step(chain):
  _, runs = chain
  step = 0
  for mode, _, summary in runs:
    # Defaults for 2 workers: BSP b2 = max(1, round(2 / 5)) = 1; Hop-BW N - b3 = 2 - 1 = 1.
    m = 1 if mode in ("async", "bsp", "hop_bw") else WORKERS
    assert summary["mode"] == mode
    assert summary["start_global_step"] == step, (mode, summary["start_global_step"], step)
    # Hop-BW's gradients of an older version take no place in a step; steps released from its
    # barrier at the end of an epoch push nothing.
    released = sum(w.get("released_steps", 0) for w in summary["per_worker"])
    counted = STEPS - summary["ignored_gradients"] - released
    assert summary["global_step"] == step + counted // m, mode
    assert 0.0 < summary["eval_auc"] < 1.0 and np.isfinite(summary["eval_logloss"])
    step = summary["global_step"]
  # Restored tokens match the step: the first GBA run after sync drops nothing as "stale".
  assert runs[1][2]["dropped_batches"] == 0 and runs[1][2]["max_staleness"] <= WORKERS


def test_sync_checkpoint_restores_into_sharded_gba_tensor_by_tensor(chain):
  root, runs = chain
  mode, sync_dir, sync_summary = runs[0]
  assert mode == "sync"
  target = dataclasses.replace(_config("gba", sync_dir))
  resaved = resave_ps(target, str(root / "resaved_gba" / "ckpt"))
  assert len(resaved["shard_devices"]) == 2, "the embedding must be split over both PS"
  # Tokens aligned with the step: fetch i gets floor(i / M), so k steps = k * M fetches.
  assert resaved["step"] == sync_summary["global_step"]
  assert resaved["tokens"] == resaved["step"] * WORKERS
  shared = assert_same_checkpoint(tf.train.latest_checkpoint(sync_dir), resaved["path"])
  assert any("embeddings" in k for k in shared)


def test_gba_checkpoint_restores_into_sync_tensor_by_tensor(chain):
  root, runs = chain
  mode, gba_dir, _ = runs[6]
  assert mode == "gba"
  saved = tf.train.latest_checkpoint(gba_dir)
  assert any(k.startswith(GBA_STATE) for k in _tensors(saved)), "a GBA checkpoint has row tags"
  resaved = resave_sync(_config("sync", gba_dir), str(root / "resaved_sync" / "ckpt"))
  assert_same_checkpoint(saved, resaved)
