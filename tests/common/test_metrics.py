"""tf_gba.common.metrics against NumPy references written here, and the evaluation's tracing."""

import gc
import logging
import weakref

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba.common import metrics


def _pairwise_auc(labels, scores):
  """AUC by its definition: P(score of a positive > score of a negative), ties counted half."""
  pos = scores[labels > 0.5]
  neg = scores[labels <= 0.5]
  greater = (pos[:, None] > neg[None, :]).sum()
  ties = (pos[:, None] == neg[None, :]).sum()
  return (greater + 0.5 * ties) / (pos.size * neg.size)


def test_auc_equals_the_pairwise_definition_with_ties():
  rng = np.random.default_rng(3)
  for _ in range(5):
    labels = (rng.random(301) < 0.3).astype(np.float32)
    scores = np.round(rng.random(301), 1)  # coarse scores: many ties, within and across classes
    assert metrics.auc(labels, scores) == pytest.approx(_pairwise_auc(labels, scores), abs=1e-12)


def test_auc_of_one_class_is_nan():
  assert np.isnan(metrics.auc([1, 1, 1], [0.2, 0.5, 0.9]))
  assert np.isnan(metrics.auc([0, 0], [0.2, 0.5]))


def test_logloss_equals_the_formula_and_clips():
  labels = np.array([1, 0, 1, 0], np.float64)
  probs = np.array([0.9, 0.2, 0.5, 0.7])
  want = -np.mean([np.log(0.9), np.log(0.8), np.log(0.5), np.log(0.3)])
  assert metrics.logloss(labels, probs) == pytest.approx(want, rel=1e-12)
  # A certain, wrong prediction costs -log(eps), not infinity.
  assert metrics.logloss([1.0], [0.0]) == pytest.approx(-np.log(1e-7), rel=1e-6)


def _model(seed):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([keras.layers.Dense(4, activation="relu", input_shape=(3,)),
                           keras.layers.Dense(1, activation="sigmoid")])


def _dataset(seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(100, 3)).astype(np.float32)
  y = (rng.random(100) < 0.4).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(32), x, y


class _Records(logging.Handler):

  def __init__(self):
    super().__init__()
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


def test_evaluate_binary_scores_the_models_predictions_and_traces_once_per_model():
  ds, x, y = _dataset(0)
  records = _Records()
  tf.get_logger().addHandler(records)
  try:
    model = _model(0)
    got = metrics.evaluate_binary(model, ds)
    probs = model(x, training=False).numpy().ravel()
    assert got["examples"] == 100
    assert got["auc"] == pytest.approx(_pairwise_auc(y, probs), abs=1e-9)
    assert got["logloss"] == pytest.approx(
        -np.mean(y * np.log(probs) + (1 - y) * np.log(1 - probs)), rel=1e-5)
    metrics.evaluate_binary(model, ds)  # a periodic evaluation of the same model: no new trace
    # Two traces: the full batches and the last, smaller one (reduce_retracing keeps it at two).
    assert metrics.predict_function(model).experimental_get_tracing_count() <= 2
    traces_before = metrics.predict_function(model).experimental_get_tracing_count()
    metrics.evaluate_binary(model, ds)
    assert metrics.predict_function(model).experimental_get_tracing_count() == traces_before
    # A fresh model per evaluation (a benchmark's chains): TensorFlow's warning about frequent
    # retracing, which counts traces of the same code across function objects, stays quiet.
    for seed in range(1, 8):
      metrics.evaluate_binary(_model(seed), ds)
  finally:
    tf.get_logger().removeHandler(records)
  assert not [m for m in records.messages if "retracing" in m], records.messages


def test_the_cached_prediction_does_not_keep_a_model_alive():
  ds, _, _ = _dataset(1)
  model = _model(0)
  metrics.evaluate_binary(model, ds)
  ref = weakref.ref(model)
  del model
  gc.collect()
  assert ref() is None
