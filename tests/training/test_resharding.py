"""restore_training_state: checkpoints move between shard counts, on real parameter servers.

One chain of training jobs, each restoring the previous one's checkpoint into another layout:

  no strategy, Adam  ->  2 PS, GBA(Adam)  ->  3 PS, GBA(Adam)  ->  no strategy, GBA(Adam)
                                                                ->  MultiWorkerMirrored, Adam

Each job trains a few steps after restoring, so every checkpoint carries non-zero slots, a global
step and (from GBA) row tags, and each restore is compared tensor by tensor, as whole logical
tensors, with the model that wrote the checkpoint.
"""

import os
import re

import numpy as np
import pytest

import tf_gba  # noqa: F401  (Keras 2 before TensorFlow; mwms_job runs without conftest)
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

from tf_gba.distribute import GBAStrategy
from tf_gba.distribute import LocalCluster
from tf_gba.distribute import collective_cluster
from tf_gba.optimizers import GBA
from tf_gba.training.resharding import CheckpointMismatchError
from tf_gba.training.resharding import restore_training_state

VOCAB, DIM, WIDTH, BATCH, STEPS = 4096, 32, 4, 64, 3  # the table: 512 KiB, 8 x min_shard_bytes
EMB = "model/layer_with_weights-0/embeddings"


def build_model(vocab=VOCAB, extra_layer=False):
  inp = keras.Input((WIDTH,), dtype=tf.int64)
  x = keras.layers.Flatten()(keras.layers.Embedding(vocab, DIM, name="emb")(inp))
  x = keras.layers.Dense(1, activation="sigmoid", name="out")(x)
  if extra_layer:
    x = keras.layers.Dense(1, name="extra")(x)
  return keras.Model(inp, x)


def dataset_fn(ctx=None):
  del ctx
  rng = np.random.default_rng(0)
  ids = rng.integers(0, VOCAB, (16 * BATCH, WIDTH))
  y = ((ids % 7).sum(1) > 12).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices((ids, y)).repeat().batch(BATCH)


def make(gba, vocab=VOCAB, extra_layer=False, **adam):
  model = build_model(vocab, extra_layer)
  inner = keras.optimizers.Adam(0.01, **adam)
  optimizer = GBA(inner, staleness_threshold=3) if gba else inner
  model.compile(optimizer, loss="binary_crossentropy")
  optimizer.build(model.trainable_variables)
  return model, optimizer


def logical_state(model, optimizer):
  """Every variable, slot, the step and the GBA state as whole tensors, named by variable.

  Read through the optimizer's own per-shard slot lists (not its checkpoint list), so the
  comparison does not rest on the mapping under test.
  """
  inner = optimizer.inner_optimizer if isinstance(optimizer, GBA) else optimizer
  shards = {}
  for v in model.trainable_variables:
    shards.setdefault(re.sub(r"(/part_\d+)?:\d+$", "", v.name), []).append(v)
  state = {"iterations": inner.iterations.numpy()}
  for name, parts in shards.items():
    state[f"var/{name}"] = np.concatenate([np.atleast_1d(p.numpy()) for p in parts])
    for slot, slots in (("m", inner._momentums), ("v", inner._velocities)):
      state[f"{slot}/{name}"] = np.concatenate([
          np.atleast_1d(slots[inner._index_dict[inner._var_key(p)]].numpy()) for p in parts])
    if isinstance(optimizer, GBA):
      made = optimizer.gba_state()["buffers"]
      buffers = [made.get(optimizer.variable_index(p), {}).get("buffer") for p in parts]
      if all(b is not None for b in buffers):
        state[f"steps/{name}"] = np.array(sorted({int(b.global_step()) for b in buffers}))
        if hasattr(buffers[0], "export_state"):
          state[f"tags/{name}"] = np.concatenate([b.export_state()[1].numpy() for b in buffers])
  if isinstance(optimizer, GBA):
    state["tokens"] = optimizer.token_generator.count().numpy()
  return state


def assert_same(got, want, keys):
  for key in keys:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def tensor_keys(state):
  return [k for k in state if k.split("/")[0] in ("var", "m", "v", "iterations")]


def fit_ps(model):
  model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
            steps_per_epoch=STEPS, verbose=0)


def ps_job(num_ps, restore_from, save_to):
  """Builds GBA(Adam) on `num_ps` servers, restores, trains STEPS steps and saves."""
  out = {}
  with LocalCluster(num_ps=num_ps, num_workers=1) as cluster:
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=64 << 10, max_shards=num_ps)
    strategy = GBAStrategy(cluster.resolver(), variable_partitioner=partitioner, mode="gba")
    with strategy.scope():
      model, optimizer = make(gba=True)
    out["devices"] = sorted({v.device for v in model.trainable_variables if "emb" in v.name})
    out["report"] = restore_training_state(restore_from, model, optimizer)
    out["restored"] = logical_state(model, optimizer)
    fit_ps(model)
    out["stats"] = optimizer.stats()
    out["saved"] = logical_state(model, optimizer)
    out["path"] = tf.train.Checkpoint(model=model).save(save_to)
  return out


def mwms_job(checkpoint, out):
  """Runs in a MultiWorkerMirroredStrategy worker process: restores into plain Adam, unsharded."""
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  with strategy.scope():
    model, optimizer = make(gba=False)
  report = restore_training_state(checkpoint, model, optimizer)
  np.savez(out, **{k.replace("/", "|"): v for k, v in logical_state(model, optimizer).items()})
  return report


@pytest.fixture(scope="module")
def sync_job(tmp_path_factory):
  """No strategy, plain Adam: how synchronous training leaves a checkpoint."""
  tmp = tmp_path_factory.mktemp("resharding")
  model, optimizer = make(gba=False)
  model.fit(dataset_fn(), epochs=1, steps_per_epoch=STEPS, verbose=0)
  return tmp, {"saved": logical_state(model, optimizer),
               "path": tf.train.Checkpoint(model=model).save(str(tmp / "sync" / "ckpt"))}


@pytest.fixture(scope="module")
def chain(sync_job):
  tmp, sync = sync_job
  jobs = {"sync": sync}
  jobs["ps2"] = ps_job(2, jobs["sync"]["path"], str(tmp / "ps2" / "ckpt"))
  jobs["ps3"] = ps_job(3, jobs["ps2"]["path"], str(tmp / "ps3" / "ckpt"))
  model, optimizer = make(gba=True)  # no strategy again, GBA kept
  report = restore_training_state(jobs["ps3"]["path"], model, optimizer)
  jobs["local"] = {"report": report, "restored": logical_state(model, optimizer)}
  model.fit(dataset_fn(), epochs=1, steps_per_epoch=STEPS, verbose=0)
  jobs["local"]["stats"] = optimizer.stats()
  return tmp, jobs


def test_unsharded_adam_into_two_ps_gba(chain):
  _, jobs = chain
  ps2, sync = jobs["ps2"], jobs["sync"]
  assert len(ps2["devices"]) == 2, "the embedding must be sharded over both PS"
  assert_same(ps2["restored"], sync["saved"], tensor_keys(sync["saved"]))
  assert ps2["restored"]["iterations"] == STEPS
  report = ps2["report"]
  assert report["resharded"][EMB] == [1, 2]
  assert report["resharded"]["model/optimizer/_variables/1"] == [1, 2]  # m of the embedding
  assert report["model_variables"] == 3 and report["optimizer_variables"] == 8
  # No GBA state in an Adam checkpoint: tokens start at the restored step, buffers on first push.
  assert report["gba"]["from_checkpoint"] is False and report["gba"]["restored_buffers"] == 0
  assert ps2["restored"]["tokens"] == STEPS
  dense = ps2["stats"]["dense"]
  assert dense["dropped"] == 0 and dense["staleness_max"] == 0  # not STEPS steps stale
  assert ps2["saved"]["iterations"] == 2 * STEPS


def test_two_ps_into_three_ps(chain):
  _, jobs = chain
  ps3, ps2 = jobs["ps3"], jobs["ps2"]
  assert len(ps3["devices"]) == 3
  saved = ps2["saved"]
  assert any(np.any(saved[k] != 0) for k in saved if k.startswith("m/emb"))
  assert np.sum(saved["tags/emb/embeddings"] >= 0) > 0
  assert_same(ps3["restored"], saved, list(saved))  # every tensor, tags, steps and tokens
  assert ps3["report"]["resharded"][EMB] == [2, 3]
  assert ps3["report"]["gba"]["saved_buffers"] == 4 and ps3["report"]["gba"][
      "restored_buffers"] == 5
  assert ps3["stats"]["dense"]["dropped"] == 0
  assert ps3["saved"]["iterations"] == 3 * STEPS


def test_three_ps_into_no_strategy_gba(chain):
  _, jobs = chain
  local, saved = jobs["local"], jobs["ps3"]["saved"]
  assert_same(local["restored"], saved, list(saved))
  assert local["report"]["resharded"][EMB] == [3, 1]
  assert local["report"]["gba"]["restored_buffers"] == 3
  assert local["stats"]["global_step"] == 4 * STEPS and local["stats"]["dense"]["dropped"] == 0


def test_three_ps_into_multi_worker_mirrored_adam(chain):
  tmp, jobs = chain
  out = str(tmp / "mwms_state.npz")
  [report] = collective_cluster.run_collective_cluster(
      f"{os.path.abspath(__file__)}:mwms_job", num_workers=1,
      kwargs={"checkpoint": jobs["ps3"]["path"], "out": out}, timeout_s=120,
      env={"CUDA_VISIBLE_DEVICES": ""})
  with np.load(out) as f:
    got = {k.replace("|", "/"): f[k] for k in f.files}
  saved = jobs["ps3"]["saved"]
  assert_same(got, saved, tensor_keys(saved))
  assert report["resharded"][EMB] == [3, 1] and report["gba"] is None
  assert report["ignored"] == ["model/optimizer/gba"]


# ---- checkpoints that do not fit ---------------------------------------------------------------
def test_other_vocabulary_is_refused_naming_the_variable(sync_job):
  _, sync = sync_job
  model, optimizer = make(gba=False, vocab=VOCAB + 8)
  before = model.get_layer("emb").embeddings.numpy()
  with pytest.raises(CheckpointMismatchError, match=r"embeddings.*\[4104, 32\].*\[4096, 32\]"):
    restore_training_state(sync["path"], model, optimizer)
  np.testing.assert_array_equal(model.get_layer("emb").embeddings.numpy(), before)


def test_missing_variables_and_slots_are_refused(sync_job):
  _, sync = sync_job
  model, optimizer = make(gba=False, extra_layer=True)
  with pytest.raises(CheckpointMismatchError, match="no value for model variable extra/kernel"):
    restore_training_state(sync["path"], model, optimizer)
  model, optimizer = make(gba=False, amsgrad=True)
  with pytest.raises(CheckpointMismatchError, match="no value for optimizer variable.*vhat"):
    restore_training_state(sync["path"], model, optimizer)


def test_unbuilt_optimizer_and_wrong_path_are_refused(sync_job, tmp_path):
  _, sync = sync_job
  model = build_model()
  optimizer = keras.optimizers.Adam()
  model.compile(optimizer, loss="binary_crossentropy")
  with pytest.raises(ValueError, match=r"optimizer.build\(model.trainable_variables\)"):
    restore_training_state(sync["path"], model, optimizer)
  with pytest.raises(FileNotFoundError):
    restore_training_state(str(tmp_path / "nothing"), *make(gba=False))
  # A checkpoint of something else than a model.
  path = tf.train.Checkpoint(step=tf.Variable(1)).save(str(tmp_path / "other" / "ckpt"))
  with pytest.raises(CheckpointMismatchError, match="holds no 'model'"):
    restore_training_state(path, *make(gba=False))
