"""A synthetic Criteo-like CTR source with a planted ground truth: the default, needs no download.

Each example has `num_categorical` id features `C1..Cn` and `num_numeric` float features
`I1..Im`:

* Ids follow a Zipf-like law: the id of popularity rank `r` has probability proportional to
  `(r + 1) ** -zipf_exponent`. Ranks are mapped to ids through a fixed random permutation per field,
  so popular ids are spread over the vocabulary as hashed ids are.
* Numeric features look like Criteo counts after the reader's transform: `log(1 + count)` with
  `count` drawn from a log-normal law.
* The label is a Bernoulli draw from `sigmoid(logit)` of a planted logistic model:

      logit = bias + sum_f w_f[id_f]                             (a weight per id of each field)
            + sum_{(f, g) in pairs} s_fg * <v_f[id_f], v_g[id_g]>  (a few pairwise interactions)
            + sum_j beta_j * (x_j - mean_j)                        (numeric weights)

  a model class DeepFM can represent. Each of the three parts is scaled to a fixed variance, so
  the Bayes-optimal AUC (the AUC of `logit` itself) is about 0.78 for any seed, and the bias is
  set for a mean click rate of 0.25.
* Drift: from one day to the next every weight moves as a stationary AR(1) process,
  `w_{d+1} = sqrt(1 - drift**2) * w_d + drift * noise`, so the truth changes a little each day
  while its overall scale (and the reachable AUC) stays the same.

Everything is a deterministic function of `seed`; each (day, split) has its own random stream, so
generating one day never depends on which others were generated.

Example:

  gen = SyntheticCTR(num_examples=1000, num_days=2, seed=1)
  rows = gen.generate(day=1, split="train")
  rows.features["C1"][:3], rows.labels[:3], rows.logits[:3]
"""

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from tf_gba.data import pipeline
from tf_gba.data.info import DataInfo

# Variances of the three parts of the planted logit (on day 0's input distribution): 1.6
# in all, a Bayes-optimal AUC of about 0.78. The bias then sets the mean click rate to TARGET_CTR.
_ID_VARIANCE = 0.9
_PAIR_VARIANCE = 0.3
_NUMERIC_VARIANCE = 0.4
_TARGET_CTR = 0.25
# Log-normal parameters of the raw numeric counts (before log(1 + x)).
_COUNT_LOG_MEAN = 1.5
_COUNT_LOG_STD = 1.2

# Random streams, so each part of the generator draws from its own sequence.
_STREAM_TRUTH, _STREAM_DRIFT, _STREAM_EXAMPLES = 0, 1, 2
_SPLIT_CODE = {"train": 0, "eval": 1}


def _scale_to(variance: float, values: np.ndarray) -> float:
  """The factor that gives `values` the variance `variance` (1 where they do not vary)."""
  std = np.std(values) if values.size else 0.0
  return float(np.sqrt(variance) / std) if std > 0 else 1.0


@dataclasses.dataclass(frozen=True)
class Truth:
  """The planted logistic model of one day (see the module docstring)."""
  bias: float
  id_weights: Tuple[np.ndarray, ...]  # per categorical field, [vocab]
  pairs: Tuple[Tuple[int, int], ...]  # interacting categorical field indices
  pair_scales: np.ndarray             # [len(pairs)], a weight per interaction
  factors: Tuple[np.ndarray, ...]     # per categorical field, [vocab, factor_dim]
  numeric_weights: np.ndarray         # [num_numeric]
  numeric_means: np.ndarray           # [num_numeric]

  def logits(self, ids: np.ndarray, numeric: np.ndarray) -> np.ndarray:
    """Planted logits of rows with categorical `ids` [n, fields] and `numeric` values [n, m]."""
    out = np.full(ids.shape[0], self.bias)
    for f, w in enumerate(self.id_weights):
      out += w[ids[:, f]]
    for (f, g), scale in zip(self.pairs, self.pair_scales):
      out += scale * np.sum(self.factors[f][ids[:, f]] * self.factors[g][ids[:, g]], axis=1)
    out += (numeric - self.numeric_means) @ self.numeric_weights
    return out


@dataclasses.dataclass(frozen=True)
class Examples:
  features: Dict[str, np.ndarray]  # C*: int64 [n], I*: float32 [n]
  labels: np.ndarray               # float32 [n], 0 or 1
  logits: np.ndarray               # float64 [n], the planted logits the labels were drawn from


class SyntheticCTR:
  """Deterministic generator of Criteo-like click data with a planted, drifting truth.

  Args:
    num_examples: training examples per day.
    num_eval_examples: evaluation examples per day (default: a quarter of `num_examples`).
    num_days: number of days.
    drift: in [0, 1]; how far the truth moves each day (0: never).
    seed: everything is a deterministic function of it.
    num_categorical: number of id features (C1, C2, ...).
    num_numeric: number of numeric features (I1, I2, ...).
    vocab_size: ids per categorical feature, one int for all or one per feature.
    zipf_exponent: exponent of the id popularity law (larger: more skewed).
    num_interactions: pairs of categorical fields with a planted interaction.
    factor_dim: width of the planted interaction vectors.
  """

  def __init__(self, num_examples: int = 20_000, num_eval_examples: Optional[int] = None,
               num_days: int = 1, drift: float = 0.1, seed: int = 0, num_categorical: int = 10,
               num_numeric: int = 4, vocab_size: Union[int, Sequence[int]] = 1000,
               zipf_exponent: float = 1.2, num_interactions: int = 3, factor_dim: int = 4):
    if num_examples < 1:
      raise ValueError(f"num_examples must be >= 1, got {num_examples}.")
    if num_eval_examples is None:
      num_eval_examples = max(1, num_examples // 4)
    if num_eval_examples < 1:
      raise ValueError(f"num_eval_examples must be >= 1, got {num_eval_examples}.")
    if num_days < 1:
      raise ValueError(f"num_days must be >= 1, got {num_days}.")
    if not 0.0 <= drift <= 1.0:
      raise ValueError(f"drift must be in [0, 1], got {drift}.")
    if num_categorical < 1 or num_numeric < 0:
      raise ValueError("Need num_categorical >= 1 and num_numeric >= 0, got "
                       f"{num_categorical} and {num_numeric}.")
    if isinstance(vocab_size, int):
      vocab_sizes = [vocab_size] * num_categorical
    else:
      vocab_sizes = [int(v) for v in vocab_size]
    if len(vocab_sizes) != num_categorical or min(vocab_sizes) < 1:
      raise ValueError(f"vocab_size must be an int >= 1 or {num_categorical} of them, "
                       f"got {vocab_size!r}.")
    max_pairs = num_categorical * (num_categorical - 1) // 2
    if not 0 <= num_interactions <= max_pairs:
      raise ValueError(f"num_interactions must be in [0, {max_pairs}], got {num_interactions}.")
    if zipf_exponent <= 0:
      raise ValueError(f"zipf_exponent must be > 0, got {zipf_exponent}.")

    self.num_examples = num_examples
    self.num_eval_examples = num_eval_examples
    self.num_days = num_days
    self.drift = drift
    self.seed = seed
    self.vocab_sizes = vocab_sizes
    self.num_numeric = num_numeric
    self.zipf_exponent = zipf_exponent
    self.num_interactions = num_interactions
    self.factor_dim = factor_dim
    self.categorical_names = [f"C{i + 1}" for i in range(num_categorical)]
    self.numeric_names = [f"I{i + 1}" for i in range(num_numeric)]

    rng = self._rng(_STREAM_TRUTH)
    # Popularity rank -> id, fixed over days: popular ids stay popular, their weights drift.
    self._rank_to_id = [rng.permutation(v) for v in vocab_sizes]
    self._rank_cdf = []
    for v in vocab_sizes:
      p = np.arange(1, v + 1, dtype=np.float64) ** -zipf_exponent
      self._rank_cdf.append(np.cumsum(p / p.sum()))
    all_pairs = [(f, g) for f in range(num_categorical) for g in range(f + 1, num_categorical)]
    chosen = rng.choice(len(all_pairs), size=num_interactions, replace=False)
    pairs = tuple(all_pairs[i] for i in sorted(chosen))
    id_weights = [rng.normal(0.0, 1.0, v) for v in vocab_sizes]
    factors = tuple(rng.normal(0.0, 1.0, (v, factor_dim)) for v in vocab_sizes)
    numeric_weights = rng.normal(0.0, 1.0, num_numeric)
    # Mean of log(1 + count), so the numeric part is centred and the bias sets the click rate.
    numeric_means = np.full(num_numeric, np.mean(self._numeric(rng, 100_000, 1)))

    # A handful of random draws (4 numeric weights, the weights of a field's few popular ids)
    # would make the share of each part, and so the reachable AUC, vary a lot between seeds.
    # Scale each part to its target variance on a sample instead.
    ids, numeric = self._draw_inputs(rng, 20_000)
    for f in range(num_categorical):
      id_weights[f] *= _scale_to(_ID_VARIANCE / num_categorical, id_weights[f][ids[:, f]])
    pair_scales = np.array([
        _scale_to(_PAIR_VARIANCE / num_interactions,
                  np.sum(factors[f][ids[:, f]] * factors[g][ids[:, g]], axis=1))
        for f, g in pairs])
    numeric_weights *= _scale_to(_NUMERIC_VARIANCE, (numeric - numeric_means) @ numeric_weights)
    day0 = Truth(0.0, tuple(id_weights), pairs, pair_scales, factors, numeric_weights,
                 numeric_means)
    # The bias that gives a mean click rate of _TARGET_CTR on day 0, by bisection.
    centred = day0.logits(ids, numeric)
    lo, hi = -10.0, 10.0
    for _ in range(50):
      mid = (lo + hi) / 2
      if np.mean(1 / (1 + np.exp(-(centred + mid)))) < _TARGET_CTR:
        lo = mid
      else:
        hi = mid
    self._truths: List[Truth] = [dataclasses.replace(day0, bias=(lo + hi) / 2)]

  def _rng(self, *stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([self.seed, *stream]))

  def _numeric(self, rng: np.random.Generator, n: int, m: int) -> np.ndarray:
    counts = np.floor(rng.lognormal(_COUNT_LOG_MEAN, _COUNT_LOG_STD, (n, m)))
    # float32 as the features are fed, so the planted logits are exactly those of the features.
    return np.log1p(counts).astype(np.float32)

  def _draw_inputs(self, rng: np.random.Generator, n: int) -> Tuple[np.ndarray, np.ndarray]:
    ids = np.empty((n, len(self.vocab_sizes)), np.int64)
    for f, (cdf, rank_to_id) in enumerate(zip(self._rank_cdf, self._rank_to_id)):
      ranks = np.minimum(np.searchsorted(cdf, rng.random(n)), len(cdf) - 1)
      ids[:, f] = rank_to_id[ranks]
    return ids, self._numeric(rng, n, self.num_numeric)

  def info(self) -> DataInfo:
    return DataInfo(categorical=dict(zip(self.categorical_names, self.vocab_sizes)),
                    numeric=tuple(self.numeric_names), num_days=self.num_days)

  def truth(self, day: int = 0) -> Truth:
    """The planted model of `day`."""
    pipeline.check_day(day, self.num_days)
    keep = np.sqrt(1.0 - self.drift ** 2)
    while len(self._truths) <= day:
      d = len(self._truths)
      prev = self._truths[-1]
      rng = self._rng(_STREAM_DRIFT, d)

      def move(x, rng=rng):
        # Noise at the array's own scale (its root mean square), so the variance is stationary.
        if x.size == 0:
          return x
        return keep * x + self.drift * rng.normal(0.0, np.sqrt(np.mean(x ** 2)), x.shape)

      self._truths.append(dataclasses.replace(
          prev,
          id_weights=tuple(move(w) for w in prev.id_weights),
          factors=tuple(move(v) for v in prev.factors),
          numeric_weights=move(prev.numeric_weights)))
    return self._truths[day]

  def generate(self, day: int = 0, split: str = "train") -> Examples:
    """All examples of one day and split, with the planted logits the labels come from."""
    pipeline.check_day(day, self.num_days)
    pipeline.check_split(split)
    n = self.num_examples if split == "train" else self.num_eval_examples
    rng = self._rng(_STREAM_EXAMPLES, day, _SPLIT_CODE[split])
    ids, numeric = self._draw_inputs(rng, n)
    logits = self.truth(day).logits(ids, numeric)
    labels = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    features = {name: ids[:, f] for f, name in enumerate(self.categorical_names)}
    features.update({name: numeric[:, j] for j, name in enumerate(self.numeric_names)})
    return Examples(features, labels, logits)


def data_info(**options) -> DataInfo:
  return SyntheticCTR(**options).info()


# Plain Python that builds a graph: tf.function callers (a ParameterServerStrategy dataset_fn)
# need not convert it.
@tf.autograph.experimental.do_not_convert
def make_dataset(split: str = "train", batch_size: int = 256, num_shards: int = 1,
                 shard_index: int = 0, day: Optional[int] = None, repeat: bool = False,
                 shuffle_seed: Optional[int] = 0, strict: bool = False,
                 **options) -> tf.data.Dataset:
  """Synthetic `(features, label)` batches; `day=None` takes every day, in order.

  Eval rows are never shuffled. `strict` is accepted for a uniform interface: generated rows are
  never malformed. Options are the arguments of `SyntheticCTR`.
  """
  del strict
  pipeline.check_common_args(split, batch_size, num_shards, shard_index)
  gen = SyntheticCTR(**options)
  pipeline.check_day(day, gen.num_days)
  days = range(gen.num_days) if day is None else [day]
  parts = [gen.generate(d, split) for d in days]
  features = {name: np.concatenate([p.features[name] for p in parts]) for name in parts[0].features}
  labels = np.concatenate([p.labels for p in parts])
  return pipeline.from_arrays(gen.info(), features, labels, batch_size=batch_size,
                              num_shards=num_shards, shard_index=shard_index, repeat=repeat,
                              shuffle_seed=shuffle_seed if split == "train" else None)


def malformed_row_count(split: str = "train", **options) -> int:
  """Generated rows are never malformed; here for a uniform interface."""
  del split
  SyntheticCTR(**options)  # Still rejects bad options.
  return 0
