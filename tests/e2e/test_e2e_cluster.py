"""GBA on real TF servers: separate processes on 127.0.0.1 (2 PS, 3 workers), `model.fit`."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

JOB = [sys.executable, "-m", "tests.e2e.gba_fit_job"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_job(tmp_path, name, *flags, timeout=420):
  out = tmp_path / f"{name}.json"
  proc = subprocess.run(JOB + ["--out", str(out), "--model_dir", str(tmp_path / "ckpt"), *flags],
                        cwd=ROOT, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  with open(out) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("gba_e2e")
  return tmp, run_job(tmp, "first", "--epochs", "3", "--steps_per_epoch", "24")


def test_fit_trains_with_sharded_embedding(first_run):
  _, report = first_run
  devices = {d for name, _, d in report["variables"] if "emb" in name}
  assert len(devices) == 2, f"embedding must be sharded over both PS: {report['variables']}"
  losses = report["losses"]
  assert losses[-1] < losses[0] - 0.02, losses


def test_global_step_is_pushes_over_m(first_run):
  _, report = first_run
  last = report["stats"][-1]
  dense = last["dense"]
  assert dense["pushes"] == 3 * 24  # one push per step; fit waits for every closure
  assert dense["global_step"] == dense["pushes"] // 3 == last["global_step"] == 24
  assert dense["duplicates"] == 0
  # Every sparse buffer (one per shard) aggregated as often as the dense leader.
  assert last["sparse"]["aggregations"] == 2 * dense["aggregations"]
  assert report["final_iterations"] == 24


def test_checkpoint_restores_into_fresh_cluster_bit_exact(first_run):
  tmp, first = first_run
  second = run_job(tmp, "second", "--restore", "--epochs", "2", "--steps_per_epoch", "3")
  ckpt = first["saved_to"]
  assert second["restored_from"] == ckpt
  names = dict(tf.train.list_variables(ckpt))
  reader = tf.train.load_checkpoint(ckpt)
  restored = second["restored"]
  # Every model weight and optimizer slot: bit-exact against the checkpoint file.
  model_keys = [k for k in names if k.startswith("model/") and "optimizer" not in k]
  assert model_keys
  saved_weights = sorted(np.asarray(reader.get_tensor(k)).ravel().tolist()
                         for k in model_keys if k.endswith("VARIABLE_VALUE"))
  got_weights = sorted(np.asarray(v).ravel().tolist() for v in restored["model"].values())
  # Sharded variables are saved whole and restored into shards: compare multisets of values.
  np.testing.assert_array_equal(np.sort(np.concatenate([np.ravel(w) for w in saved_weights])),
                                np.sort(np.concatenate([np.ravel(w) for w in got_weights])))
  opt_keys = [k for k in names if k.startswith("model/optimizer/_variables/")]
  saved_opt = np.sort(np.concatenate([np.ravel(reader.get_tensor(k)) for k in opt_keys]))
  got_opt = np.sort(np.concatenate([np.ravel(v) for v in restored["optimizer"]]))
  np.testing.assert_array_equal(saved_opt, got_opt)
  assert restored["iterations"] == reader.get_tensor("model/optimizer/_iterations/.ATTRIBUTES/"
                                                     "VARIABLE_VALUE") == 24
  assert restored["token_count"] == reader.get_tensor(
      "model/optimizer/gba/token_generator/.ATTRIBUTES/count") == 72
  # Buffers are created on the first step after restore and restored then: the global step
  # continues from 24, and each row tag is either the saved one or a step applied since.
  final_step = second["final_iterations"]
  assert final_step == 24 + (2 * 3) // 3  # two epochs of 3 steps, M = 3
  for name, buf in second["buffers"].items():
    saved_step = reader.get_tensor(f"model/optimizer/gba/{name}/.ATTRIBUTES/global_step")
    assert saved_step == 24
    assert buf["global_step"] == final_step
    if "row_tags" in buf:
      saved_tags = reader.get_tensor(f"model/optimizer/gba/{name}/.ATTRIBUTES/row_tags")
      tags = np.array(buf["row_tags"])
      kept = tags == saved_tags
      assert np.all(kept | ((tags >= 24) & (tags < final_step)))
      assert kept.sum() > 0 and np.any(saved_tags >= 0)
      assert np.all(saved_tags[kept] == tags[kept])
  assert second["stats"][-1]["dense"]["dropped"] == 0  # tokens resumed at the restored step


def test_worker_killed_mid_step_is_not_applied_twice(tmp_path):
  # Worker 0 dies while epoch 1 runs. The coordinator re-runs its closure on another worker,
  # which takes a new token and batch: a new push, never a second copy of the dead worker's push
  # (that would carry the same ticket and be ignored). The dead worker may have pushed some of its
  # step's gradients before dying; those count as what they are, one extra push at most. One step
  # per function: a re-run function trains again the steps the dead worker had already pushed,
  # up to all of them (docs/api.md), which would hide a second copy among them.
  report = run_job(tmp_path, "killed", "--epochs", "3", "--steps_per_epoch", "60",
                   "--kill_worker_during_epoch", "1", "--steps_per_execution", "1")
  last = report["stats"][-1]["dense"]
  assert last["duplicates"] == 0
  assert 180 <= last["pushes"] <= 181
  assert last["global_step"] == last["pushes"] // 3
  assert report["final_iterations"] == last["pushes"] // 3
  steps = {b["global_step"] for b in report["buffers"].values()}
  assert max(steps) - min(steps) <= 1, report["buffers"]
  assert report["losses"][-1] < report["losses"][0]
