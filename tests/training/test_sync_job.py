"""`--mode=sync` on real worker processes: a real all-reduce, checked against a NumPy reference.

The workers are separate processes (MultiWorkerMirroredStrategy over localhost gRPC), so nothing
here needs logical CPU devices: the in-process reference runs on TensorFlow's default device, and
this file can share a pytest process with others.
"""

import dataclasses
import json
import math
import os
import types

import tf_gba  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads Keras)
import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba import data as data_lib
from tf_gba import models as models_lib
from tf_gba.distribute import collective_cluster
from tf_gba.training import runner
from tf_gba.training import sync_job
from tf_gba.training.config import TrainConfig

_TARGET = "tf_gba.training.sync_job:run_worker"
_ENV = {"CUDA_VISIBLE_DEVICES": ""}


def _config(model_dir, **overrides) -> TrainConfig:
  values = dict(mode="sync", model="deepfm", data="synthetic", data_options="num_examples=2000",
                num_workers=2, local_batch_size=16, steps=6, log_every=2, eval_examples=1024,
                learning_rate=0.01, model_dir=str(model_dir), stragglers="none", export_dir="")
  values.update(overrides)
  return TrainConfig(**values)


def _run_workers(cfg: TrainConfig):
  return collective_cluster.run_collective_cluster(
      _TARGET, num_workers=cfg.num_workers, kwargs={"config": dataclasses.asdict(cfg)},
      timeout_s=240, env=_ENV)


def _ps_summary_keys():
  """The keys of the parameter-server modes' summary, from the runner's own function."""
  stats = {"global_step": 1, "dense": None, "dense_all_variables": None, "sparse": None}
  summary = runner._summary(  # pylint: disable=protected-access
      TrainConfig(), types.SimpleNamespace(num_ps=1, num_workers=1),
      types.SimpleNamespace(history={"loss": [0.5]}), stats, [],
      {"auc": 0.5, "logloss": 0.7, "examples": 1}, 1.0, 1, 1.0, 0, "ckpt-1")
  return set(summary)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
  """Two workers, 6 worker steps = 3 global steps, from scratch; shared by the tests below."""
  cfg = _config(tmp_path_factory.mktemp("sync") / "model")
  return cfg, _run_workers(cfg)


# ------------------------------------------------------------------------------------------------
# NumPy reference: synchronous Adam on the mean of the two shards' gradients.

def _adam_reference(cfg: TrainConfig, global_steps: int, shards=(0, 1)):
  """Model weights and Adam slots after `global_steps` steps on the mean gradient of `shards`.

  Gradients come from TensorFlow (the model's own backward pass, one shard batch at a time, on
  the reference's current weights); their mean and the Adam update are computed here in float64.
  """
  # The workers are fresh processes with no global seed: draw the same shuffle order here even if
  # something earlier in this process set one.
  tf.random.set_seed(None)
  options = cfg.data_kwargs()
  info = data_lib.data_info(cfg.data, **options)
  model = models_lib.build_model(cfg.model, info, embedding_dim=cfg.embedding_dim, seed=cfg.seed)
  variables = model.trainable_variables
  w = [v.numpy().astype(np.float64) for v in variables]
  m = [np.zeros_like(x) for x in w]
  v = [np.zeros_like(x) for x in w]
  iterators = [iter(data_lib.make_dataset(
      cfg.data, split="train", batch_size=cfg.local_batch_size, num_shards=cfg.num_workers,
      shard_index=i, day=cfg.day, repeat=True, shuffle_seed=cfg.seed, **options))
               for i in range(cfg.num_workers)]
  beta_1, beta_2, eps, lr = 0.9, 0.999, 1e-7, cfg.learning_rate
  for t in range(1, global_steps + 1):
    grads = []
    for i, iterator in enumerate(iterators):
      features, labels = next(iterator)  # every worker consumes its batch
      if i not in shards:
        continue
      for var, value in zip(variables, w):
        var.assign(value.astype(np.float32))
      with tf.GradientTape() as tape:
        probs = tf.reshape(model(features, training=True), [-1, 1])
        loss = tf.reduce_mean(keras.losses.binary_crossentropy(
            tf.reshape(tf.cast(labels, tf.float32), [-1, 1]), probs))
      grads.append([tf.convert_to_tensor(g).numpy().astype(np.float64)
                    for g in tape.gradient(loss, variables)])
    for k in range(len(w)):
      g = np.mean([worker[k] for worker in grads], axis=0)
      m[k] = beta_1 * m[k] + (1 - beta_1) * g
      v[k] = beta_2 * v[k] + (1 - beta_2) * g * g
      alpha = lr * math.sqrt(1 - beta_2 ** t) / (1 - beta_1 ** t)
      w[k] = w[k] - alpha * m[k] / (np.sqrt(v[k]) + eps)
  return w, m, v


def _restored_state(cfg: TrainConfig, path: str):
  """Weights, Adam slots and iterations of the checkpoint at `path`, read into a fresh model."""
  info = data_lib.data_info(cfg.data, **cfg.data_kwargs())
  model = models_lib.build_model(cfg.model, info, embedding_dim=cfg.embedding_dim, seed=cfg.seed)
  optimizer = keras.optimizers.Adam(cfg.learning_rate)
  model.compile(optimizer, loss=keras.losses.BinaryCrossentropy())
  optimizer.build(model.trainable_variables)
  tf.train.Checkpoint(model=model).restore(path).assert_existing_objects_matched()
  # The optimizer built its slots in the order of the variables it was given.
  return ([x.numpy() for x in model.trainable_variables],
          [x.numpy() for x in optimizer._momentums],  # pylint: disable=protected-access
          [x.numpy() for x in optimizer._velocities],  # pylint: disable=protected-access
          int(optimizer.iterations.numpy()))


def _max_diff(a, b) -> float:
  return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------------

def test_run_sync_trains_saves_and_summarizes_like_ps_modes(tmp_path, capsys):
  cfg = _config(tmp_path / "model", steps=12, stragglers="persistent:2@1")
  summary = sync_job.run_sync(cfg)

  # Sync keeps a progress record as the parameter-server modes do (a run stopped by a signal
  # resumes to the same target), so its summary carries the same recovery fields they add.
  recovery_keys = {"target_global_step", "restarts", "restart_causes", "steps_redone",
                   "batches_reread", "worker_restarts"}
  assert set(summary) == _ps_summary_keys() | recovery_keys
  assert summary["steps_redone"] == 0 and summary["restarts"] == 0
  with open(tmp_path / "model" / "summary.json") as f:
    assert json.load(f) == json.loads(json.dumps(summary))
  assert summary["mode"] == "sync" and summary["num_workers"] == 2
  assert summary["steps"] == 12 and summary["examples"] == 12 * 16
  assert summary["global_batch_size"] == 32 and summary["num_aggregate"] == 2
  assert summary["start_global_step"] == 0 and summary["global_step"] == 12 // 2
  assert summary["mean_staleness"] == 0.0 and summary["dropped_batches"] == 0
  assert np.isfinite(summary["final_train_loss"]) and summary["final_train_loss"] > 0
  assert 0.0 <= summary["eval_auc"] <= 1.0 and summary["eval_logloss"] > 0
  assert summary["global_qps"] > 0
  assert summary["checkpoint"] == tf.train.latest_checkpoint(str(tmp_path / "model"))
  assert os.path.exists(summary["checkpoint"] + ".index")
  assert os.listdir(tmp_path / "model" / "tensorboard")
  # The straggler kernels found each worker's index in its MWMS device name: only worker 1 slept.
  workers = summary["per_worker"]
  assert [w["worker"] for w in workers] == [0, 1]
  assert all(w["steps"] == 6 and w["qps"] > 0 for w in workers)
  assert workers[0]["injected_delay_seconds"] == 0.0
  assert workers[1]["injected_delay_seconds"] > 0.0
  out = capsys.readouterr().out
  assert "step 12/12  global step 6" in out  # the chief's progress, echoed
  assert "summary (sync, deepfm, synthetic)" in out


def test_all_reduce_applies_the_mean_gradient_on_every_worker(first_run):
  cfg, results = first_run
  assert [r["task"] for r in results] == [0, 1]
  assert all(r["num_workers"] == 2 and r["global_step"] == 3 for r in results)
  # Bit-identical weights and Adam state on both workers.
  assert results[0]["weights_digest"] == results[1]["weights_digest"]
  assert all(np.isfinite(r["final_train_loss"]) for r in results)

  got_w, got_m, got_v, iterations = _restored_state(cfg, results[0]["checkpoint"])
  assert iterations == 3
  # Float32 (workers) against float64 (reference): observed differences are about a third of
  # these tolerances. Adam's first moment m is the applied gradient itself (a sum instead of the
  # mean would double it); v its square; the weights move by about lr = 0.01 per step.
  tolerances = {"m": 3e-6, "v": 3e-8, "w": 1e-4}
  ref = dict(zip("wmv", _adam_reference(cfg, 3)))
  got = {"w": got_w, "m": got_m, "v": got_v}
  for name, tol in tolerances.items():
    assert _max_diff(got[name], ref[name]) < tol, name
  # The comparison can tell: one worker's gradient alone (no all-reduce) is far off.
  local = dict(zip("wmv", _adam_reference(cfg, 3, shards=(0,))))
  for name, tol in tolerances.items():
    assert _max_diff(got[name], local[name]) > 100 * tol, name


def test_second_run_restores_and_continues(first_run):
  cfg, first = first_run
  second = _run_workers(dataclasses.replace(cfg, steps=4))
  for r in second:
    assert r["restored_from"] == first[0]["checkpoint"]
    assert r["restored_digest"] == first[0]["weights_digest"]  # weights, slots and iterations
    assert r["start_global_step"] == 3 and r["global_step"] == 5
  assert second[0]["weights_digest"] == second[1]["weights_digest"]
  assert second[0]["checkpoint"].endswith("ckpt-5")
  assert tf.train.latest_checkpoint(cfg.model_dir) == second[0]["checkpoint"]


def test_bad_input_is_refused_before_starting_workers(tmp_path, monkeypatch):
  with pytest.raises(ValueError, match="global_batch_size"):
    sync_job.run_sync(_config(tmp_path, global_batch_size=64))
  with pytest.raises(ValueError, match="straggler"):
    sync_job.run_sync(_config(tmp_path, stragglers="sometimes"))
  with pytest.raises(ValueError, match="num_workers"):
    sync_job.run_sync(_config(tmp_path, num_workers=0))
  monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1"]}}))
  with pytest.raises(ValueError, match="starts its own worker processes"):
    sync_job.run_sync(_config(tmp_path))
  assert not os.path.exists(tmp_path / "worker_logs")


def test_a_killed_or_cut_off_worker_ends_sync_as_a_restartable_loss():
  """A worker killed, or one whose all-reduce lost its peers, ends sync in one line with exit 75
  (recovery.WorkerLost: the rerun resumes from the last checkpoint), never the cluster's
  traceback; the model's own errors keep the ClusterError and its logs."""
  from tf_gba.distribute.collective_cluster import ClusterError
  from tf_gba.training import recovery

  def failing(**kw):
    with sync_job._lost_worker_is_restartable("/logs"):  # pylint: disable=protected-access
      raise ClusterError("worker(s) failed", **kw)

  with pytest.raises(recovery.WorkerLost, match=r"worker:1 was killed \(SIGKILL\).*/logs"):
    failing(exit_codes={1: -9, 0: 1}, log_tails={0: "UnavailableError", 1: ""})
  with pytest.raises(recovery.WorkerLost, match=r"worker:0 lost a peer or its link "
                                                r"\(UnavailableError\)"):
    failing(exit_codes={0: 1}, log_tails={0: "tensorflow...UnavailableError: Socket closed"})
  with pytest.raises(ClusterError):
    failing(exit_codes={0: 1}, log_tails={0: "ValueError: bad shape"})
  with pytest.raises(ClusterError):
    failing()  # a time-out names no worker
