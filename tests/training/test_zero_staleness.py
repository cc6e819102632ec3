"""The zero-staleness equivalence (SPEC, "Embeddings: per-ID staleness"), on real servers.

Sync runs as the project runs it: MultiWorkerMirroredStrategy worker processes with a real
all-reduce (`sync_job.run_sync`). GBA runs on a parameter-server LocalCluster with its pushes
serialized in worker order, one global step at a time, over the very batches the Sync replicas
get (worker i: shard i of N), so every entry of step k is computed on version k. With the default
embedding divisor (M) both must end with the same weights, Adam slots and iterations, dense and
embedding, within float32 tolerance; with the paper's per-ID divisor (c(id)) they must not.
With --embedding=hash the same holds row by row of the hash table (SPEC section 6: Sync
all-gathers the replicas' (key, gradient row) pairs and applies their per-key mean; GBA's keyed
buffers aggregate the same rows at zero staleness), both applied by the table's LazyAdam.
"""

import tf_gba  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads Keras)
import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba import data as data_lib
from tf_gba import models as models_lib
from tf_gba.distribute import GBAStrategy
from tf_gba.distribute import LocalCluster
from tf_gba.layers import HashEmbedding
from tf_gba.optimizers import GBA
from tf_gba.training import sync_job
from tf_gba.training.config import TrainConfig

NUM_WORKERS = 2
GLOBAL_STEPS = 3
# float32 on both sides, different summation orders: observed differences are far below these.
TOLERANCE = {"w": 1e-5, "m": 1e-6, "v": 1e-8}


def _config(model_dir, embedding="vocab") -> TrainConfig:
  return TrainConfig(mode="sync", model="deepfm", data="synthetic",
                     data_options="num_examples=2000", num_workers=NUM_WORKERS,
                     local_batch_size=16, steps=NUM_WORKERS * GLOBAL_STEPS, log_every=2,
                     eval_examples=1024, learning_rate=0.01, model_dir=str(model_dir),
                     stragglers="none", embedding=embedding, export_dir="")


def _build(cfg, info):
  return models_lib.build_model(cfg.model, info, embedding_dim=cfg.embedding_dim, seed=cfg.seed,
                                embedding=cfg.embedding)


def _hash_rows(model):
  """The hash table's keys, values and slots, ordered by key (None with --embedding=vocab)."""
  layers = [layer for layer in model.layers if isinstance(layer, HashEmbedding)]
  if not layers:
    return None
  rows = layers[0].table.export()
  order = np.argsort(rows["keys"].numpy())
  return {f: rows[f].numpy()[order] for f in ("keys", "values", "slots")}


def _state(model, adam):
  return {"w": [v.numpy() for v in model.trainable_variables],
          "m": [x.numpy() for x in adam._momentums],  # pylint: disable=protected-access
          "v": [x.numpy() for x in adam._velocities],  # pylint: disable=protected-access
          "iterations": int(adam.iterations.numpy()), "hash": _hash_rows(model)}


def _sync_state(cfg, path):
  info = data_lib.data_info(cfg.data, **cfg.data_kwargs())
  model = _build(cfg, info)
  adam = keras.optimizers.Adam(cfg.learning_rate)
  model.compile(adam, loss=keras.losses.BinaryCrossentropy())
  adam.build(model.trainable_variables)
  tf.train.Checkpoint(model=model).restore(path).assert_existing_objects_matched()
  return _state(model, adam), [isinstance(v, tf.Variable) and "embedding" in v.name
                               and "hash_anchor" not in v.name
                               for v in model.trainable_variables]


def _gba_serialized(cfg, sparse_normalize):
  """GBA(Adam) on a parameter-server cluster, pushes one at a time in worker order."""
  options = cfg.data_kwargs()
  info = data_lib.data_info(cfg.data, **options)
  with LocalCluster(num_ps=1, num_workers=NUM_WORKERS) as cluster:
    strategy = GBAStrategy(cluster.resolver(), mode="gba")
    # Read here, on this process (connected to the cluster now), as the sync workers read them
    # (fresh processes: no global seed for the shuffle order).
    tf.random.set_seed(None)
    iterators = [iter(data_lib.make_dataset(
        cfg.data, split="train", batch_size=cfg.local_batch_size, num_shards=NUM_WORKERS,
        shard_index=i, repeat=True, shuffle_seed=cfg.seed, **options))
                 for i in range(NUM_WORKERS)]
    with strategy.scope():
      model = _build(cfg, info)
      optimizer = GBA(keras.optimizers.Adam(cfg.learning_rate), num_aggregate=NUM_WORKERS,
                      sparse_normalize=sparse_normalize)
      optimizer.build(model.trainable_variables)
    bce = keras.losses.BinaryCrossentropy(reduction=keras.losses.Reduction.NONE)

    def replica_fn(features, labels):
      with tf.GradientTape() as tape:
        probs = tf.reshape(model(features, training=True), [-1, 1])
        loss = tf.reduce_mean(bce(tf.reshape(tf.cast(labels, probs.dtype), [-1, 1]), probs))
        if model.losses:
          loss += tf.add_n(model.losses)
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    @tf.function
    def step(features, labels):
      return strategy.run(replica_fn, args=(features, labels))

    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    for _ in range(GLOBAL_STEPS):
      for i in range(NUM_WORKERS):
        features, labels = next(iterators[i])
        coordinator.schedule(step, args=(features, labels))
        coordinator.join()  # the next push starts after this one was applied
    stats = optimizer.stats()
    state = _state(model, optimizer.inner_optimizer)
  return state, stats


def _max_diffs(a, b, which):
  return {name: max([float(np.max(np.abs(x - y)))
                     for x, y, keep in zip(a[name], b[name], which) if keep] or [0.0])
          for name in ("w", "m", "v")}


@pytest.fixture(scope="module")
def sync_result(tmp_path_factory):
  cfg = _config(tmp_path_factory.mktemp("zero_staleness") / "sync")
  summary = sync_job.run_sync(cfg)
  assert summary["global_step"] == GLOBAL_STEPS
  return cfg, _sync_state(cfg, summary["checkpoint"])


def test_gba_without_staleness_equals_sync(sync_result):
  cfg, (sync, is_embedding) = sync_result
  assert any(is_embedding) and not all(is_embedding)
  gba, stats = _gba_serialized(cfg, "num_aggregate")
  assert stats["dense"]["staleness_max"] == 0 and stats["dense"]["dropped"] == 0
  assert stats["sparse"]["staleness_max"] == 0 and stats["sparse"]["dropped"] == 0
  assert gba["iterations"] == sync["iterations"] == GLOBAL_STEPS
  for which, name in ((is_embedding, "embedding"), ([not e for e in is_embedding], "dense")):
    diffs = _max_diffs(gba, sync, which)
    for key, tol in TOLERANCE.items():
      assert diffs[key] < tol, (name, key, diffs)


def test_per_id_divisor_differs_from_sync(sync_result):
  cfg, (sync, is_embedding) = sync_result
  gba, _ = _gba_serialized(cfg, "per_id")
  assert gba["iterations"] == GLOBAL_STEPS
  diffs = _max_diffs(gba, sync, is_embedding)
  # A row seen by one of the two workers gets twice Sync's gradient: m differs by ~|g| / 2.
  assert diffs["m"] > 100 * TOLERANCE["m"], diffs


@pytest.fixture(scope="module")
def sync_hash_result(tmp_path_factory):
  cfg = _config(tmp_path_factory.mktemp("zero_staleness_hash") / "sync", embedding="hash")
  summary = sync_job.run_sync(cfg)
  assert summary["global_step"] == GLOBAL_STEPS
  return cfg, _sync_state(cfg, summary["checkpoint"])


def test_gba_without_staleness_equals_sync_for_hash_rows(sync_hash_result):
  """Hash rows: GBA's zero-staleness aggregate (the M entries' sum / M per key) and Sync's
  all-gathered per-key mean give the same table, row by row (values, LazyAdam's m and v), and
  the same dense weights."""
  cfg, (sync, _) = sync_hash_result
  assert len(sync["hash"]["keys"]) > 0  # the categorical rows are in the table
  gba, stats = _gba_serialized(cfg, "num_aggregate")
  assert stats["sparse"]["staleness_max"] == 0 and stats["sparse"]["dropped"] == 0
  assert gba["iterations"] == sync["iterations"] == GLOBAL_STEPS
  dense = _max_diffs(gba, sync, [w.size > 0 for w in gba["w"]])  # not the empty anchor
  for key, tol in TOLERANCE.items():
    assert dense[key] < tol, ("dense", key, dense)
  g, s = gba["hash"], sync["hash"]
  np.testing.assert_array_equal(g["keys"], s["keys"])
  np.testing.assert_allclose(g["values"], s["values"], rtol=0, atol=TOLERANCE["w"])
  np.testing.assert_allclose(g["slots"][:, 0], s["slots"][:, 0], rtol=0, atol=TOLERANCE["m"])
  np.testing.assert_allclose(g["slots"][:, 1], s["slots"][:, 1], rtol=0, atol=TOLERANCE["v"])
  # The comparison can tell: the per-ID divisor (c(id) instead of M) moves the rows that one
  # worker's batch alone held.
  per_id, _ = _gba_serialized(cfg, "per_id")
  assert np.max(np.abs(per_id["hash"]["slots"][:, 0] - s["slots"][:, 0])) > 100 * TOLERANCE["m"]
