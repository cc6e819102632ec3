"""Tests of the synthetic Criteo-like generator and its planted truth."""

import collections

import numpy as np
import pytest

import tf_gba  # noqa: F401  (sets up Keras 2 before TensorFlow is imported)

from tf_gba import data
from tf_gba.data import synthetic


def rank_auc(scores, labels):
  """ROC AUC from the Mann-Whitney U statistic, with average ranks for ties."""
  scores, labels = np.asarray(scores, np.float64), np.asarray(labels) > 0.5
  order = np.argsort(scores, kind="stable")
  _, first, count = np.unique(scores[order], return_index=True, return_counts=True)
  ranks = np.empty(len(scores))
  ranks[order] = np.repeat(first + (count + 1) / 2, count)  # mean of ranks first+1..first+count
  positives, negatives = labels.sum(), (~labels).sum()
  return (ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives)


def test_rank_auc_reference():
  assert rank_auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
  assert rank_auc([1, 1, 1, 1], [0, 1, 0, 1]) == pytest.approx(0.5)  # all tied
  assert rank_auc([3, 2, 1], [1, 0, 0]) == pytest.approx(1.0)


def test_deterministic_by_seed():
  a = synthetic.SyntheticCTR(num_examples=500, num_days=2, seed=7).generate(1, "eval")
  b = synthetic.SyntheticCTR(num_examples=500, num_days=2, seed=7).generate(1, "eval")
  c = synthetic.SyntheticCTR(num_examples=500, num_days=2, seed=8).generate(1, "eval")
  for name in a.features:
    np.testing.assert_array_equal(a.features[name], b.features[name])
  np.testing.assert_array_equal(a.labels, b.labels)
  assert not np.array_equal(a.features["C1"], c.features["C1"])

  opts = dict(num_examples=300, seed=3, batch_size=100)
  first = [next(iter(data.make_dataset("synthetic", **opts)))[0]["C2"].numpy() for _ in range(2)]
  np.testing.assert_array_equal(*first)


def test_dataset_carries_the_generated_rows():
  gen = synthetic.SyntheticCTR(num_examples=300, num_numeric=2, seed=1)
  rows = gen.generate(0, "train")
  features, label = next(iter(data.make_dataset(
      "synthetic", batch_size=300, shuffle_seed=None, num_examples=300, num_numeric=2, seed=1)))
  assert set(features) == set(gen.info().categorical) | set(gen.info().numeric)
  for name, values in rows.features.items():
    np.testing.assert_array_equal(features[name].numpy(), values)
  np.testing.assert_array_equal(label.numpy(), rows.labels)
  assert features["C1"].dtype.name == "int64" and features["I1"].dtype.name == "float32"


def test_ids_follow_a_power_law():
  rows = synthetic.SyntheticCTR(num_examples=20_000, vocab_size=1000, seed=0).generate(0)
  for name in ("C1", "C5"):
    ids = rows.features[name]
    assert ids.min() >= 0 and ids.max() < 1000
    counts = np.sort(np.bincount(ids, minlength=1000))[::-1]
    assert counts[0] > 20 * counts[49]               # the top id against the 50th
    assert counts[:10].sum() > 0.4 * len(ids)        # 1% of the ids, over 40% of the rows
    assert np.count_nonzero(counts) > 300            # yet a long tail is present


def test_labels_follow_the_planted_truth():
  gen = synthetic.SyntheticCTR(num_examples=20_000, seed=0)
  rows = gen.generate(0, "train")
  auc = rank_auc(rows.logits, rows.labels)
  assert 0.72 < auc < 0.85
  assert 0.15 < rows.labels.mean() < 0.35
  # The logits are the truth's function of the features, not a side channel.
  ids = np.stack([rows.features[n] for n in gen.categorical_names], axis=1)
  numeric = np.stack([rows.features[n] for n in gen.numeric_names], axis=1)
  np.testing.assert_allclose(gen.truth(0).logits(ids, numeric), rows.logits, rtol=1e-12)
  # A shuffled truth carries no signal.
  assert abs(rank_auc(np.random.default_rng(0).permutation(rows.logits), rows.labels) - 0.5) < 0.03


def test_drift_moves_the_truth_between_days():
  gen = synthetic.SyntheticCTR(num_examples=10_000, num_days=3, drift=0.3, seed=0)
  day0, day1 = gen.truth(0), gen.truth(1)
  w0, w1 = day0.id_weights[0], day1.id_weights[0]
  assert not np.allclose(w0, w1)
  assert 0.8 < np.corrcoef(w0, w1)[0, 1] < 0.99  # a small move, not a new truth
  assert not np.allclose(day0.numeric_weights, day1.numeric_weights)
  # Day 1's labels follow day 1's truth better than day 0's.
  rows = gen.generate(1, "train")
  ids = np.stack([rows.features[n] for n in gen.categorical_names], axis=1)
  numeric = np.stack([rows.features[n] for n in gen.numeric_names], axis=1)
  assert rank_auc(day1.logits(ids, numeric), rows.labels) > rank_auc(
      day0.logits(ids, numeric), rows.labels)

  still = synthetic.SyntheticCTR(num_examples=100, num_days=2, drift=0.0, seed=0)
  np.testing.assert_array_equal(still.truth(0).id_weights[0], still.truth(1).id_weights[0])


def test_days_shards_and_splits():
  opts = dict(num_examples=400, num_eval_examples=100, num_days=3, seed=2)
  info = data.data_info("synthetic", **opts)
  assert info.num_days == 3 and len(info.categorical) == 10 and len(info.numeric) == 4

  def rows(**kwargs):
    out = collections.Counter()
    for features, label in data.make_dataset("synthetic", batch_size=1000, **opts, **kwargs):
      names = sorted(features)
      out.update(zip(label.numpy().tolist(), *(features[n].numpy().tolist() for n in names)))
    return out

  assert sum(rows().values()) == 1200                 # every day
  assert sum(rows(day=2).values()) == 400
  assert sum(rows(split="eval", day=0).values()) == 100
  whole = rows(day=1)
  parts = [rows(day=1, num_shards=3, shard_index=k) for k in range(3)]
  assert sum(parts, collections.Counter()) == whole
  with pytest.raises(ValueError, match="day must be"):
    data.make_dataset("synthetic", day=3, **opts)
  with pytest.raises(ValueError, match="takes no option"):
    data.make_dataset("synthetic", vocabulary=10)
  with pytest.raises(ValueError, match="Unknown data spec"):
    data.make_dataset("criteo_terabyte:/data")
