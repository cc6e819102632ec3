"""ShadowSync and ASGD without gradient delay on real TF servers (LocalCluster on 127.0.0.1).

- training goes on while a sync is in flight: with every sync slowed by an injected delay, each
  worker still completes training steps between the start and the end of its syncs (counted in
  steps, not timed; benchmarks/shadow_overlap.py measures the step rate);
- after the final sync every replica holds the same model, the average, which is what the
  checkpoint holds;
- asgd_nodelay: no step is taken more than tau local steps past the last PS model its worker
  received (from the per-step staleness the run records);
- switching: a checkpoint of the sync layout restores into these modes and theirs restores into
  the sync layout.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba import data as data_lib
from tf_gba import models as models_lib
from tf_gba.distribute import LocalCluster
from tf_gba.training import recovery
from tf_gba.training import resharding
from tf_gba.training import shadow_job
from tf_gba.training.config import TrainConfig


def config(tmp_path, mode, **kw):
  base = dict(mode=mode, model="deepfm", data="synthetic", num_ps=1, num_workers=2,
              local_batch_size=64, steps=60, input="sharded", eval_examples=2048,
              data_options="num_examples=20000", model_dir=str(tmp_path / mode),
              learning_rate=0.01, export_dir="")
  base.update(kw)
  cfg = TrainConfig(**base)
  cfg.validate()
  return cfg


class Replicas:
  """The dense variables of every replica and of the checkpoint model, read before the cluster
  goes away."""

  def __init__(self, rm):
    self.replicas = [[v.numpy() for v in dense] for dense in rm.replica_dense]
    self.master = [v.numpy() for v in rm.dense]
    self.before_final = rm.before_final
    # Adam's (m, v) of every replica's dense variables, and of the shared embedding tables.
    self.slots = [[[s.numpy() for s in rm._slots(opt, v)] for v in dense]  # pylint: disable=protected-access
                  for opt, dense in zip(rm.local_optimizers, rm.replica_dense)]
    self.embeddings = [v.numpy() for v in rm.embeddings]
    self.embedding_slots = [[s.numpy() for s in rm._slots(rm.optimizer, v)]  # pylint: disable=protected-access
                            for v in rm.embeddings]


def _train_once(cfg, **kw):
  with LocalCluster(num_ps=cfg.num_ps, num_workers=cfg.num_workers) as cluster:
    summary, rm = shadow_job.train(cfg, cluster.resolver(), cfg.num_workers, cfg.num_ps,
                                   timeout_s=600, return_model=True, **kw)
    return summary, Replicas(rm)


def train(cfg, **kw):
  """One run on a cluster of its own. A run that starts from nothing and meets a fault inside
  TensorFlow's runtime (recovery.RuntimeFault: a request a server could not parse, no process
  died; seen once in a CI run of this module) is run again once from nothing, as the binary's
  supervisor restarts such a job; a second fault fails the test. A run that continues a
  checkpoint is not repeated: a rerun would resume, not repeat, it."""
  fresh = not os.path.exists(cfg.model_dir)
  try:
    return _train_once(cfg, **kw)
  except recovery.RuntimeFault as fault:
    if not fresh:
      raise
    print(f"WARNING: run again from nothing after a fault in TensorFlow's runtime: {fault}")
    shutil.rmtree(cfg.model_dir, ignore_errors=True)
    return _train_once(cfg, **kw)


@pytest.mark.parametrize("mode", ["shadow_easgd", "shadow_ma", "shadow_bmuf", "asgd_nodelay"])
def test_replicas_agree_after_final_sync(tmp_path, mode):
  cfg = config(tmp_path, mode, steps=80, asgd_tau=4)
  summary, reps = train(cfg)
  # They did drift apart while training (local steps on different shards)...
  assert summary["replica_spread_before_final_sync"] > 0
  # ...and after the final sync all hold the average, which is the checkpoint model's dense part.
  master = reps.master
  for i, r in enumerate(reps.replicas):
    for k, (a, b) in enumerate(zip(r, master)):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7,
                                 err_msg=f"{mode}: replica {i} variable {k}")
  # The average of the replicas as they were when training stopped (asgd_nodelay: once each
  # was rebased onto the newest model, keeping its own unmerged steps), computed here.
  for k, b in enumerate(master):
    mean = np.mean([r[k] for r in reps.before_final], axis=0)
    np.testing.assert_allclose(b, mean, rtol=1e-5, atol=1e-6, err_msg=f"{mode}: variable {k}")
  reader = tf.train.load_checkpoint(summary["checkpoint"])
  names = {name for name in reader.get_variable_to_shape_map()
           if name.startswith("model/") and "optimizer" not in name}
  assert names, "no model variables in the checkpoint"
  assert summary["steps"] == cfg.steps
  assert sum(w["steps"] for w in summary["per_worker"]) == cfg.steps
  assert 0.0 < summary["eval_auc"] <= 1.0
  assert sum(summary["sync"]["syncs_per_worker"]) > 0


def _shard_position(checkpoint):
  reader = tf.train.load_checkpoint(checkpoint)
  return reader.get_tensor("shard_position/batches/.ATTRIBUTES/VARIABLE_VALUE").tolist()


def test_a_resumed_run_goes_on_in_each_workers_shard(tmp_path):
  """The checkpoint holds the batches each worker trained in its shard, and a resumed run starts
  each shard after them (tests/training/test_shard_position.py shows the skipped shard is the
  uninterrupted one; the fault drills resume after real kills). A new run from a finished one's
  checkpoint starts afresh, as the other modes' data list does."""
  first, _ = train(config(tmp_path, "shadow_ma", steps=40))
  trained = [w["steps"] for w in first["per_worker"]]
  assert sum(trained) == 40 and first["restored_shard_batches"] == [0, 0]
  assert _shard_position(first["checkpoint"]) == trained
  # The record an 80-step run leaves when its coordinator dies just after the checkpoint at 40.
  cfg = config(tmp_path, "shadow_ma", steps=80)
  recovery.begin(cfg.model_dir, cfg.mode, cfg.steps, 0, target_if_new=80)
  recovery.report(cfg.model_dir, 40)
  resumed, _ = train(cfg)
  assert (resumed["restarts"], resumed["start_global_step"], resumed["global_step"]) == (1, 40, 80)
  assert resumed["restored_shard_batches"] == trained
  now = [w["steps"] for w in resumed["per_worker"]]
  assert _shard_position(resumed["checkpoint"]) == [a + b for a, b in zip(trained, now)]
  # That run finished: the same command again is a new run of 80 steps more.
  again, _ = train(cfg)
  assert (again["restarts"], again["global_step"]) == (0, 160)
  assert again["restored_shard_batches"] == [0, 0]
  assert _shard_position(again["checkpoint"]) == [w["steps"] for w in again["per_worker"]]


@pytest.mark.parametrize("mode", ["shadow_easgd", "shadow_ma"])
def test_training_continues_while_a_sync_is_in_flight(tmp_path, mode):
  # Every sync takes at least 400 ms (injected between its read and its write-back); steps
  # take about 40 ms (a compute floor), so a sync that blocked training would show 0 steps.
  cfg = config(tmp_path, mode, steps=120, shadow_sync_delay_ms=400, stragglers="compute:40")
  summary, _ = train(cfg)
  sync = summary["sync"]
  assert all(n >= 1 for n in sync["syncs_per_worker"]), sync
  # (The median: the syncs in flight when training ends are cut short.)
  assert sync["median_sync_seconds"] >= 0.4, sync
  # Steps each worker completed while its syncs were in flight.
  assert sync["mean_steps_during_sync"] >= 2, sync
  # The sync gap is measured, not set: it is the steps a worker makes per sync.
  assert sync["mean_sync_gap"] >= 2, sync


def test_a_run_in_which_no_step_starts_ends_for_a_restart(tmp_path):
  # Every merge is held 20 s: at tau = 2 the workers wait for the next model and no step
  # starts. Past --stall_timeout_s the job ends with JobLost (the binary then restarts it from
  # the last checkpoint) instead of waiting forever.
  cfg = config(tmp_path, "asgd_nodelay", steps=200, asgd_tau=2, shadow_sync_delay_ms=20000,
               stall_timeout_s=2.0)
  with pytest.raises(recovery.Stalled, match="stall_timeout_s"):
    train(cfg)


def test_a_run_whose_last_claimed_steps_do_not_finish_ends_for_a_restart(tmp_path):
  # Every step lasts 4 s (a compute floor). After the warm-up step of each worker, the two
  # threads claim the last two steps of the budget at once: no step finishes for more than the
  # 1.5 s stall limit, which must end the job even though no step is left to start.
  cfg = config(tmp_path, "shadow_ma", steps=4, stragglers="compute:4000", stall_timeout_s=1.5)
  with pytest.raises(recovery.Stalled, match="no worker finished a step"):
    train(cfg)


@pytest.mark.parametrize("algorithm,tau", [(1, 2), (1, 4), (2, 4)])
def test_asgd_never_exceeds_tau(tmp_path, algorithm, tau):
  # Worker 0 is 3x slower and every merge is slowed: the fast worker runs into the bound.
  cfg = config(tmp_path, "asgd_nodelay", num_workers=3, steps=90, asgd_tau=tau,
               asgd_algorithm=algorithm, shadow_sync_delay_ms=150,
               stragglers="compute:20+persistent:3@0")
  summary, _ = train(cfg)
  asgd = summary["asgd"]
  hist = np.asarray(asgd["staleness_histogram_per_worker"])
  per_worker = [w["steps"] for w in summary["per_worker"]]
  np.testing.assert_array_equal(hist.sum(axis=1), per_worker)
  assert hist[:, tau + 1:].sum() == 0, hist  # never past tau
  assert hist[:, 1:].sum() > 0  # staleness is counted (a step is at least 1 past its model)
  # The bound binds: some steps of the fast workers are at staleness tau, and they waited.
  assert hist[1:, tau].sum() > 0, hist
  assert asgd["merges"] >= 2


DONOR = """
import json, os, sys
import tf_gba
import tensorflow as tf
import tf_keras as keras
from tf_gba import data as data_lib
from tf_gba import models as models_lib
data, kwargs, model, dim, lr, out = sys.argv[1:]
info = data_lib.data_info(data, **json.loads(kwargs))
donor = models_lib.build_model(model, info, embedding_dim=int(dim), seed=123)
adam = keras.optimizers.Adam(float(lr))
donor.compile(adam, loss=keras.losses.BinaryCrossentropy())
adam.build(donor.trainable_variables)
adam.iterations.assign(500)
for v in adam.variables[1:]:
  v.assign(tf.fill(v.shape, 1e-3))
tf.train.Checkpoint(model=donor).save(os.path.join(out, "ckpt"))
"""


def test_switching_sync_layout_to_shadow_and_back(tmp_path):
  cfg = config(tmp_path, "shadow_ma", steps=40)
  info = data_lib.data_info(cfg.data, **cfg.data_kwargs())
  # A checkpoint in the sync mode's layout (tf_gba.training.sync_job.build_and_restore), written
  # by a process of its own: this one's eager context may still name an earlier test's cluster.
  os.makedirs(cfg.model_dir)
  subprocess.run([sys.executable, "-c", DONOR, cfg.data, json.dumps(cfg.data_kwargs()),
                  cfg.model, str(cfg.embedding_dim), str(cfg.learning_rate), cfg.model_dir],
                 check=True, timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
  summary, rm = train(cfg)
  assert summary["restored_from"] is not None
  assert summary["start_global_step"] == 500
  # Every step applied the embedding update with the job's optimizer once.
  assert summary["global_step"] == 500 + cfg.steps
  # Back to the sync layout: the checkpoint restores whole into a plain model and its Adam.
  back = models_lib.build_model(cfg.model, info, embedding_dim=cfg.embedding_dim, seed=7)
  opt = keras.optimizers.Adam(cfg.learning_rate)
  back.compile(opt, loss=keras.losses.BinaryCrossentropy())
  opt.build(back.trainable_variables)
  resharding.restore_training_state(summary["checkpoint"], back, opt)
  assert int(opt.iterations.numpy()) == summary["global_step"]
  final_dense = rm.replicas[0]
  shared = {id(w) for layer in back.layers if isinstance(layer, models_lib.FieldEmbedding)
            for w in layer.weights}
  back_dense = [v.numpy() for v in back.trainable_variables if id(v) not in shared]
  assert len(back_dense) == len(final_dense)
  for a, b in zip(back_dense, final_dense):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  def slots(var):
    k = opt._index_dict[opt._var_key(var)]  # pylint: disable=protected-access
    return [opt._momentums[k].numpy(), opt._velocities[k].numpy()]  # pylint: disable=protected-access

  # The dense Adam slots restored are the replicas' average (computed here), not the donor's
  # constants...
  dense_vars = [v for v in back.trainable_variables if id(v) not in shared]
  for k, var in enumerate(dense_vars):
    for j, restored in enumerate(slots(var)):
      mean = np.mean([rm.slots[i][k][j] for i in range(cfg.num_workers)], axis=0)
      np.testing.assert_allclose(restored, mean, rtol=1e-5, atol=1e-8, err_msg=f"{k} {j}")
  assert not np.allclose(slots(dense_vars[-1])[0], 1e-3)
  # ...and the embedding tables and their slots are the job's, on the parameter servers.
  emb_vars = [v for v in back.trainable_variables if id(v) in shared]
  assert len(emb_vars) == len(rm.embeddings)
  for var, value, (m, v) in zip(emb_vars, rm.embeddings, rm.embedding_slots):
    np.testing.assert_array_equal(var.numpy(), value)
    np.testing.assert_array_equal(slots(var)[0], m)
    np.testing.assert_array_equal(slots(var)[1], v)
