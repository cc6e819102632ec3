"""Evaluation metrics computed exactly in NumPy (no threshold buckets), and the evaluation of a
binary classifier that every training job reports: {"auc", "logloss", "examples"}."""

import weakref

import numpy as np


def auc(labels, scores) -> float:
  """Area under the ROC curve by the rank-sum (Mann-Whitney) formula, ties averaged."""
  labels = np.asarray(labels, np.float64).ravel()
  scores = np.asarray(scores, np.float64).ravel()
  pos = labels > 0.5
  n_pos, n_neg = int(pos.sum()), int((~pos).sum())
  if n_pos == 0 or n_neg == 0:
    return float("nan")
  order = np.argsort(scores, kind="mergesort")
  ranks = np.empty(len(scores), np.float64)
  sorted_scores = scores[order]
  i = 0
  while i < len(scores):  # average ranks over runs of equal scores
    j = i
    while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
      j += 1
    ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
    i = j + 1
  return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def logloss(labels, probs, eps: float = 1e-7) -> float:
  labels = np.asarray(labels, np.float64).ravel()
  p = np.clip(np.asarray(probs, np.float64).ravel(), eps, 1 - eps)
  return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


# One traced prediction per model: a job evaluating the same model every few steps traces it
# once, not once per evaluation.
_PREDICT = weakref.WeakKeyDictionary()


def predict_function(model):
  """`model(x, training=False)` as a `tf.function`, traced once per model and input signature."""
  predict = _PREDICT.get(model)
  if predict is None:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    # The function holds the model weakly: a strong reference from the cache's value would keep
    # its key, and so every model ever evaluated, alive.
    ref = weakref.ref(model)
    predict = tf.function(lambda x: ref()(x, training=False), reduce_retracing=True)
    # TensorFlow counts traces by the Python code traced, across function objects: every model
    # evaluated (a benchmark's fresh model per chain, each with one trace) would add to one count
    # and print "triggered tf.function retracing" after the fifth. One trace per model is what
    # this cache is for, so that warning says nothing here.
    predict._omit_frequent_tracing_warning = True  # pylint: disable=protected-access
    _PREDICT[model] = predict
  return predict


def evaluate_binary(model, dataset) -> dict:
  """AUC and log loss of `model` (probabilities) on a dataset of (features, labels) batches."""
  predict = predict_function(model)
  labels, scores = [], []
  for features, y in dataset:
    labels.append(np.reshape(y.numpy(), [-1]))
    scores.append(np.reshape(predict(features).numpy(), [-1]))
  labels, scores = np.concatenate(labels), np.concatenate(scores)
  return {"auc": auc(labels, scores), "logloss": logloss(labels, scores),
          "examples": int(labels.size)}
