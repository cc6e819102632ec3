"""Tests of the CTR models: shapes, the shared embedding table, sparse gradients, and learning."""

import numpy as np
import pytest

import tf_gba  # noqa: F401  (sets up Keras 2 before TensorFlow is imported)
import tensorflow as tf
import tf_keras as keras

from tf_gba import data
from tf_gba import models
from tf_gba.data.info import DataInfo

NAMES = ("deepfm", "dcn", "youtube_dnn")
TINY = dict(num_examples=64, num_categorical=3, num_numeric=2, vocab_size=[5, 7, 11], seed=4)


def _table(model):
  tables = [v for v in model.trainable_variables if "categorical_embedding" in v.name]
  assert len(tables) == 1, [v.name for v in model.trainable_variables]
  return tables[0]


@pytest.mark.parametrize("name", NAMES)
def test_builds_with_one_table_and_outputs_probabilities(name):
  info = data.data_info("synthetic", **TINY)
  model = models.build_model(name, info, embedding_dim=4, hidden_units=(8,))
  features, _ = next(iter(data.make_dataset("synthetic", batch_size=64, **TINY)))
  prob = model(features).numpy()
  assert prob.shape == (64, 1)
  assert np.all((prob > 0) & (prob < 1))
  assert _table(model).shape[0] == 5 + 7 + 11  # all fields side by side in ONE table
  assert len(model.trainable_variables) <= 12  # every variable costs a push per step


@pytest.mark.parametrize("name", NAMES)
def test_embedding_gradient_is_sparse_at_offset_rows(name):
  info = data.data_info("synthetic", **TINY)
  model = models.build_model(name, info, embedding_dim=4, hidden_units=(8,))
  features, labels = next(iter(data.make_dataset("synthetic", batch_size=16, **TINY)))
  with tf.GradientTape() as tape:
    loss = keras.losses.BinaryCrossentropy()(labels, model(features))
  table = _table(model)
  grad = tape.gradient(loss, table)
  assert isinstance(grad, tf.IndexedSlices)
  offsets = {"C1": 0, "C2": 5, "C3": 12}
  rows = set(np.concatenate([features[n].numpy() + o for n, o in offsets.items()]).tolist())
  assert set(grad.indices.numpy().tolist()) == rows


@pytest.mark.parametrize("name", NAMES)
def test_categorical_only_features(name):
  # MovieLens has no numeric features.
  info = DataInfo(categorical={"user_id": 10, "item_id": 20}, numeric=(), num_days=1)
  model = models.build_model(name, info, embedding_dim=4, hidden_units=(8,), seed=1)
  prob = model({"user_id": tf.constant([1, 9], tf.int64),
                "item_id": tf.constant([0, 19], tf.int64)})
  assert prob.shape == (2, 1)


def test_same_seed_same_model_and_unknown_name():
  info = data.data_info("synthetic", **TINY)
  a = models.build_model("deepfm", info, seed=3)
  b = models.build_model("deepfm", info, seed=3)
  for x, y in zip(a.get_weights(), b.get_weights()):
    np.testing.assert_array_equal(x, y)
  with pytest.raises(ValueError, match="choose one of"):
    models.build_model("wide_and_deep", info)


LEARN = dict(num_examples=6000, num_eval_examples=2000, vocab_size=100, seed=0)


@pytest.fixture
def global_seed():
  """TensorFlow's global seed set for one test, and unset after it.

  A global seed left set changes what every later `shuffle(seed=...)` in this process draws, so
  in-process references would no longer see the order that fresh worker processes see.
  """
  keras.utils.set_random_seed(0)
  yield
  tf.random.set_seed(None)


@pytest.mark.parametrize("name", NAMES)
def test_learns_the_synthetic_truth(name, global_seed):  # pylint: disable=redefined-outer-name
  del global_seed
  info = data.data_info("synthetic", **LEARN)
  model = models.build_model(name, info)
  model.compile(optimizer=keras.optimizers.Adam(0.002), loss=keras.losses.BinaryCrossentropy(),
                metrics=[keras.metrics.AUC(name="auc")])
  train = data.make_dataset("synthetic", batch_size=128, repeat=True, **LEARN)
  model.fit(train, steps_per_epoch=200, epochs=1, verbose=0)
  result = model.evaluate(data.make_dataset("synthetic", "eval", batch_size=1000, **LEARN),
                          verbose=0, return_dict=True)
  print(f"{name}: eval AUC {result['auc']:.3f}")
  assert result["auc"] > 0.65
