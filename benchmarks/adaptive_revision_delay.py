"""AdaptiveRevision vs AdaGrad under simulated update delays (McMahan & Streeter 2014, Fig. 1).

Logistic regression on a CTR data set, one example per update (online learning), trained with
simulated update delays D: every update is computed from the parameters (and, for
AdaptiveRevision, the gradient sums) read D updates earlier, exactly as an update queue would
deliver them. Delay patterns (paper section 3): "constant" (every update is D updates late),
"minibatch" (2D+1 reads, then their 2D+1 updates) and "random" (delays uniform in {0..2D}).

As in the paper's Figure 1, the learning-rate scale alpha is tuned once, at D = 0, on a small
grid, and held fixed for every D. At D = 0 the algorithms below are one and the same AdaGrad, so
the grid runs once (with the first algorithm) unless --tune_each asks for one grid per algorithm;
the D = 0 rows of the table show the algorithms agree there. Metrics are progressive validation:
logloss and AUC of the prediction made with the parameters read for each example, before
training on it, over the second half of the data.

Algorithms:
  adaptive_revision        tf_gba.optimizers.AdaptiveRevision through its explicit API: the Read
                           is `read_state` (gbar rows of the example's features) with the
                           parameter rows, the Update `apply_with_gbar_old`.
  adaptive_revision_star   the same with use_max=False (the paper's AdaptiveRevision*).
  adagrad                  tf_keras Adagrad (initial accumulator G0, epsilon 0) applied to the
                           delayed gradients: the paper's AsyncAda-GD baseline.

Data: a deterministic synthetic sparse logistic problem (default), or `--criteo=FILE[,FILE...]`:
Criteo TSV(.gz) rows (label, 13 integer and 26 categorical fields), each field value hashed
into `2**hash_bits` features (integers bucketised as floor(log(1+v)^2)), plus a bias feature.

Usage:
  python -m benchmarks.adaptive_revision_delay                       # synthetic, all 3 patterns
  python -m benchmarks.adaptive_revision_delay --patterns=constant --num_examples=5000
  python -m benchmarks.adaptive_revision_delay \
      --criteo=<data>/criteo_sample/train_8k.tsv.gz,<data>/criteo_sample/eval_2k.tsv.gz

Writes `results.md`, `results.json` and `logloss_vs_delay.png` (if matplotlib is installed) to
--output_dir.
"""

import dataclasses
import gzip
import json
import math
import os
import sys
import tempfile
import time
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

import tf_gba  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is used)
import tensorflow as tf
import tf_keras as keras

from tf_gba.optimizers.adaptive_revision import AdaptiveRevision

ALGORITHMS = ("adaptive_revision", "adaptive_revision_star", "adagrad")
PATTERNS = ("constant", "minibatch", "random")
LABELS = {"adaptive_revision": "AdaptiveRevision", "adaptive_revision_star": "AdaptiveRevision*",
          "adagrad": "AdaGrad (async GD)"}


@dataclasses.dataclass
class Config:
  """What to run. The defaults take a few minutes on 2 CPU cores."""
  num_examples: int = 20000
  delays: Tuple[int, ...] = (0, 10, 100, 1000)
  patterns: Tuple[str, ...] = PATTERNS
  algorithms: Tuple[str, ...] = ("adaptive_revision", "adagrad")
  alpha_grid: Tuple[float, ...] = (0.05, 0.1, 0.2, 0.4, 0.8)
  # At D = 0 all three algorithms are the same AdaGrad (tests/*/test_adaptive_revision_*.py check
  # it), so by default the grid is run once, with the first algorithm, and the others are run at
  # its best alpha (the D = 0 rows then show they agree). tune_each runs the grid for each.
  tune_each: bool = False
  g0: float = 1.0
  seed: int = 0
  criteo: Optional[str] = None
  hash_bits: int = 18
  output_dir: str = os.path.join(tempfile.gettempdir(), "tf_gba_benchmarks",
                                 "adaptive_revision_delay")
  plot: bool = True


# ------------------------------------------------------------------------------------------------
# Data: every example has the same number K of (feature index, value) pairs; index 0 is a bias.

@dataclasses.dataclass
class Data:
  ids: np.ndarray      # int64 [N, K]
  values: np.ndarray   # float32 [N, K]
  labels: np.ndarray   # float32 [N]
  num_features: int
  description: str


def synthetic_data(num_examples: int, seed: int) -> Data:
  """A sparse CTR-like logistic problem: 12 categorical fields with Zipf-distributed ids.

  Field vocabularies range from 3 to 10,000 values, so a few features (the bias, the small
  fields, the head of every Zipf law) are in most examples and collect many outstanding updates
  under delay, while the tail is rare; that is the regime the paper targets.
  """
  rng = np.random.default_rng(seed)
  vocab = [3, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
  offsets = np.cumsum([1] + vocab[:-1])   # feature 0 is the bias
  num_features = 1 + sum(vocab)
  true_w = rng.normal(0.0, 0.6, size=num_features)
  true_w[0] = -1.2                        # base click-through rate about 25%
  ids = np.zeros((num_examples, 1 + len(vocab)), np.int64)
  for f, (v, off) in enumerate(zip(vocab, offsets)):
    p = 1.0 / np.arange(1, v + 1) ** 1.1
    ids[:, 1 + f] = off + rng.choice(v, size=num_examples, p=p / p.sum())
  logits = true_w[ids].sum(axis=1)
  labels = (rng.random(num_examples) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
  return Data(ids, np.ones(ids.shape, np.float32), labels, num_features,
              f"synthetic: {num_examples} examples, {num_features} features, "
              f"{ids.shape[1]} per example (bias + 12 Zipf fields), CTR {labels.mean():.3f}")


def criteo_data(paths: str, num_examples: int, hash_bits: int) -> Data:
  """Reads up to `num_examples` Criteo rows into hashed binary features (plus a bias)."""
  size = 2 ** hash_bits
  ids, labels = [], []
  files = [p for p in paths.split(",") if p]
  for path in files:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
      for line in f:
        if len(labels) >= num_examples:
          break
        fields = line.rstrip("\n").split("\t")
        if len(fields) != 40 or fields[0] not in ("0", "1"):
          continue   # malformed row
        row = [0]
        for j, raw in enumerate(fields[1:14]):
          if raw == "":
            token = "missing"
          else:
            v = int(raw)
            token = str(int(math.log1p(v) ** 2)) if v > 0 else str(v)
          row.append(1 + zlib.crc32(f"I{j}={token}".encode()) % (size - 1))
        for j, raw in enumerate(fields[14:]):
          row.append(1 + zlib.crc32(f"C{j}={raw}".encode()) % (size - 1))
        ids.append(row)
        labels.append(float(fields[0]))
  if not labels:
    raise ValueError(f"No Criteo rows read from {files}.")
  ids = np.asarray(ids, np.int64)
  labels = np.asarray(labels, np.float32)
  return Data(ids, np.ones(ids.shape, np.float32), labels, size,
              f"Criteo {','.join(os.path.basename(p) for p in files)}: {len(labels)} examples, "
              f"2^{hash_bits} hashed features, CTR {labels.mean():.3f}")


# ------------------------------------------------------------------------------------------------
# Delay patterns as event lists: (0, i) reads example i, (1, i) applies its update.

def delay_events(pattern: str, n: int, d: int, seed: int = 0) -> np.ndarray:
  """Returns int64 [2n, 2] rows (kind, example)."""
  events = []
  if pattern == "constant" or d == 0:
    for i in range(n):
      events.append((0, i))
      if i >= d:
        events.append((1, i - d))
    events += [(1, i) for i in range(max(0, n - d), n)]
  elif pattern == "minibatch":
    b = 2 * d + 1
    for start in range(0, n, b):
      block = range(start, min(n, start + b))
      events += [(0, i) for i in block] + [(1, i) for i in block]
  elif pattern == "random":
    rng = np.random.default_rng(seed + d)
    due = np.arange(n) + rng.integers(0, 2 * d + 1, size=n)
    order = np.lexsort((np.arange(n), due))   # updates in order of due time, then of read
    k = 0
    for t in range(n):
      events.append((0, t))
      while k < n and due[order[k]] <= t:
        events.append((1, order[k]))
        k += 1
    events += [(1, i) for i in order[k:]]
  else:
    raise ValueError(f"Unknown delay pattern {pattern!r}; expected one of {PATTERNS}.")
  return np.asarray(events, np.int64)


# ------------------------------------------------------------------------------------------------
# One simulated training pass.

def simulate(data: Data, events: np.ndarray, algorithm: str, alpha: float, g0: float
             ) -> np.ndarray:
  """Runs one pass and returns the read-time prediction of every example."""
  n, k = data.ids.shape
  x = tf.Variable(tf.zeros([data.num_features]), name="weights")
  if algorithm == "adagrad":
    opt = keras.optimizers.Adagrad(learning_rate=alpha, initial_accumulator_value=g0,
                                   epsilon=0.0, jit_compile=False)
  else:
    opt = AdaptiveRevision(alpha=alpha, g0=g0, use_max=(algorithm == "adaptive_revision"))
  opt.build([x])
  # What each Read saw, kept until its Update: the parameter rows and (AdaptiveRevision) the
  # gbar rows of the example's features.
  x_read = tf.Variable(tf.zeros([n, k]), name="x_read")
  gbar_read = tf.Variable(tf.zeros([n, k]), name="gbar_read")
  predictions = tf.Variable(tf.zeros([n]), name="predictions")
  ids = tf.constant(data.ids)
  values = tf.constant(data.values)
  labels = tf.constant(data.labels)
  dense_shape = tf.constant([data.num_features], tf.int64)
  uses_gbar = algorithm != "adagrad"

  def read(i):
    rows = tf.gather(x, ids[i])
    x_read[i].assign(rows)
    if uses_gbar:
      gbar_read[i].assign(opt.read_state([x], indices=[ids[i]])[0].values)
    predictions[i].assign(tf.sigmoid(tf.reduce_sum(rows * values[i])))
    return tf.constant(0)

  def update(i):
    p = tf.sigmoid(tf.reduce_sum(x_read[i] * values[i]))
    grad = tf.IndexedSlices((p - labels[i]) * values[i], ids[i], dense_shape)
    if uses_gbar:
      gbar_old = tf.IndexedSlices(gbar_read[i], ids[i], dense_shape)
      opt.apply_with_gbar_old([(grad, x)], [gbar_old])
    else:
      opt.apply_gradients([(grad, x)])
    return tf.constant(0)

  @tf.function
  def run(events):
    for e in tf.range(tf.shape(events)[0]):
      kind, i = events[e, 0], events[e, 1]
      tf.cond(kind == 0, lambda: read(i), lambda: update(i))

  run(tf.constant(events))
  return predictions.numpy()


def logloss(labels: np.ndarray, p: np.ndarray) -> float:
  p = np.clip(p.astype(np.float64), 1e-7, 1 - 1e-7)
  return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


def auc(labels: np.ndarray, p: np.ndarray) -> float:
  """Area under the ROC curve (Mann-Whitney, ties counted one half)."""
  order = np.argsort(p, kind="mergesort")
  sorted_p = p[order]
  first = np.r_[True, sorted_p[1:] != sorted_p[:-1]]
  group = np.cumsum(first) - 1
  starts = np.r_[np.nonzero(first)[0], len(p)]
  ranks = np.empty(len(p))
  ranks[order] = 0.5 * (starts[group] + starts[group + 1] + 1)   # average 1-based rank
  pos = labels > 0.5
  n_pos, n_neg = pos.sum(), (~pos).sum()
  if n_pos == 0 or n_neg == 0:
    return float("nan")
  return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def evaluate(data: Data, predictions: np.ndarray) -> Dict[str, float]:
  half = len(data.labels) // 2
  return {"logloss": logloss(data.labels[half:], predictions[half:]),
          "auc": auc(data.labels[half:], predictions[half:])}


# ------------------------------------------------------------------------------------------------
# The experiment.

def run(config: Config) -> dict:
  """Tunes alpha at D = 0, runs every (pattern, D, algorithm), writes and returns the results."""
  for a in config.algorithms:
    if a not in ALGORITHMS:
      raise ValueError(f"Unknown algorithm {a!r}; expected some of {ALGORITHMS}.")
  data = (criteo_data(config.criteo, config.num_examples, config.hash_bits) if config.criteo
          else synthetic_data(config.num_examples, config.seed))
  n = len(data.labels)
  print(data.description, flush=True)
  started = time.time()
  no_delay = delay_events("constant", n, 0)

  tuning: Dict[str, Dict[str, dict]] = {}
  best_alpha: Dict[str, float] = {}
  tuned = config.algorithms if config.tune_each else config.algorithms[:1]
  for algorithm in tuned:
    tuning[algorithm] = {}
    for alpha in config.alpha_grid:
      t0 = time.time()
      metrics = evaluate(data, simulate(data, no_delay, algorithm, alpha, config.g0))
      metrics["seconds"] = time.time() - t0
      tuning[algorithm][repr(alpha)] = metrics
      print(f"tune {algorithm:24s} alpha={alpha:<8g} logloss={metrics['logloss']:.5f} "
            f"auc={metrics['auc']:.4f} ({metrics['seconds']:.1f}s)", flush=True)
    best_alpha[algorithm] = min(config.alpha_grid,
                                key=lambda a, alg=algorithm: tuning[alg][repr(a)]["logloss"])
    if best_alpha[algorithm] in (config.alpha_grid[0], config.alpha_grid[-1]):
      print(f"warning: the best alpha of {algorithm} is at the edge of the grid", flush=True)
  for algorithm in config.algorithms:
    best_alpha.setdefault(algorithm, best_alpha[tuned[0]])

  runs: List[dict] = []
  for pattern in config.patterns:
    for d in config.delays:
      events = delay_events(pattern, n, d, config.seed)
      for algorithm in config.algorithms:
        alpha = best_alpha[algorithm]
        if d == 0 and algorithm in tuning:   # D = 0 is the same run for every pattern
          metrics = dict(tuning[algorithm][repr(alpha)])
        elif d == 0 and pattern != config.patterns[0]:
          metrics = dict(next(r for r in runs if r["delay"] == 0 and r["algorithm"] == algorithm))
          for key in ("pattern", "delay", "algorithm", "alpha"):
            metrics.pop(key)
        else:
          t0 = time.time()
          try:
            metrics = evaluate(data, simulate(data, events, algorithm, alpha, config.g0))
          except tf.errors.InvalidArgumentError as e:
            # AdaptiveRevision* only: delayed gradients of opposite signs drove some z <= 0,
            # where its learning rate is undefined; the kernel refuses such an update.
            if algorithm != "adaptive_revision_star":
              raise
            metrics = {"logloss": float("nan"), "auc": float("nan"),
                       "error": str(e).strip().splitlines()[0][:300]}
          metrics["seconds"] = time.time() - t0
        runs.append({"pattern": pattern, "delay": d, "algorithm": algorithm, "alpha": alpha,
                     **metrics})
        print(f"{pattern:9s} D={d:<5d} {algorithm:24s} logloss={metrics['logloss']:.5f} "
              f"auc={metrics['auc']:.4f}", flush=True)

  results = {
      "config": dataclasses.asdict(config),
      "data": data.description,
      "best_alpha": best_alpha,
      "tuning": tuning,
      "runs": runs,
      "target": _target(runs, config),
      "seconds": time.time() - started,
  }
  _write(results, config)
  return results


def _target(runs: List[dict], config: Config) -> dict:
  """The paper's claim at the largest delay: AdaptiveRevision's loss stays close to its D = 0
  loss while AdaGrad's degrades. "Close": it grows by less than a quarter of AdaGrad's growth."""
  d_max = max(config.delays)
  out = {}
  if not ({"adaptive_revision", "adagrad"} <= set(config.algorithms) and 0 in config.delays
          and d_max > 0):
    return out
  loss = {(r["pattern"], r["delay"], r["algorithm"]): r["logloss"] for r in runs}
  for pattern in config.patterns:
    growth = {a: loss[(pattern, d_max, a)] / loss[(pattern, 0, a)] - 1.0
              for a in ("adaptive_revision", "adagrad")}
    out[pattern] = {
        "delay": d_max,
        "adaptive_revision_relative_increase": growth["adaptive_revision"],
        "adagrad_relative_increase": growth["adagrad"],
        "met": bool(growth["adagrad"] > 0 and
                    growth["adaptive_revision"] < 0.25 * growth["adagrad"]),
    }
  return out


def _markdown(results: dict) -> str:
  config = results["config"]
  algorithms = config["algorithms"]
  lines = [f"Data: {results['data']}.",
           "Progressive validation on the second half; alpha tuned at D = 0 on "
           f"{list(config['alpha_grid'])}" +
           (" per algorithm" if config["tune_each"] else
            " (once: the algorithms are identical at D = 0)") +
           " and held fixed for every D: " +
           ", ".join(f"{LABELS[a]} {results['best_alpha'][a]:g}" for a in algorithms) + ".", ""]
  header = "| pattern | D | " + " | ".join(
      f"{LABELS[a]} logloss | {LABELS[a]} AUC" for a in algorithms) + " |"
  lines += [header, "|" + "---|" * (2 + 2 * len(algorithms))]
  by_key = {(r["pattern"], r["delay"], r["algorithm"]): r for r in results["runs"]}
  for pattern in config["patterns"]:
    for d in config["delays"]:
      cells = []
      for a in algorithms:
        r = by_key[(pattern, d, a)]
        if "error" in r:   # AdaptiveRevision* refused an update: some z <= 0
          cells += ["failed: z <= 0", "-"]
        else:
          cells += [f"{r['logloss']:.4f}", f"{r['auc']:.4f}"]
      lines.append(f"| {pattern} | {d} | " + " | ".join(cells) + " |")
  for pattern, t in results["target"].items():
    lines.append("")
    lines.append(
        f"Target ({pattern}, D = {t['delay']} vs D = 0): AdaptiveRevision logloss "
        f"{t['adaptive_revision_relative_increase']:+.1%}, AdaGrad "
        f"{t['adagrad_relative_increase']:+.1%}: {'met' if t['met'] else 'NOT met'}.")
  return "\n".join(lines) + "\n"


def _write(results: dict, config: Config) -> None:
  os.makedirs(config.output_dir, exist_ok=True)
  table = _markdown(results)
  with open(os.path.join(config.output_dir, "results.md"), "w") as f:
    f.write(table)
  with open(os.path.join(config.output_dir, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  print("\n" + table, flush=True)
  paths = [os.path.join(config.output_dir, n) for n in ("results.md", "results.json")]
  if config.plot:
    png = _plot(results, config)
    if png:
      paths.append(png)
  print("Wrote " + ", ".join(paths), flush=True)


def _plot(results: dict, config: Config) -> Optional[str]:
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    print("matplotlib is not installed: no plot (pip install matplotlib).", flush=True)
    return None
  patterns = config.patterns
  fig, axes = plt.subplots(1, len(patterns), figsize=(4.5 * len(patterns), 3.6), squeeze=False)
  positions = list(range(len(config.delays)))   # the x-axis is non-linear, as in the paper
  for ax, pattern in zip(axes[0], patterns):
    for a in config.algorithms:
      ys = [next(r["logloss"] for r in results["runs"] if r["pattern"] == pattern and
                 r["delay"] == d and r["algorithm"] == a) for d in config.delays]
      ax.plot(positions, ys, marker="o",
              label=f"{LABELS[a]} (alpha {results['best_alpha'][a]:g})")
    ax.set_xticks(positions)
    ax.set_xticklabels([str(d) for d in config.delays])
    ax.set_xlabel("average update delay D")
    ax.set_ylabel("progressive logloss (2nd half)")
    ax.set_title(f"{pattern} delays, alpha tuned at D = 0")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  path = os.path.join(config.output_dir, "logloss_vs_delay.png")
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


# ------------------------------------------------------------------------------------------------
# Command line.

def define_flags() -> None:
  """Defines the command-line flags (called by __main__ only, never at import)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  defaults = Config()
  flags.DEFINE_integer("num_examples", defaults.num_examples, "Examples (updates) per pass.")
  flags.DEFINE_list("delays", [str(d) for d in defaults.delays], "Average update delays D.")
  flags.DEFINE_list("patterns", list(defaults.patterns), f"Delay patterns, of {PATTERNS}.")
  flags.DEFINE_list("algorithms", list(defaults.algorithms), f"Algorithms, of {ALGORITHMS}.")
  flags.DEFINE_list("alpha_grid", [repr(a) for a in defaults.alpha_grid],
                    "Learning-rate scales tried at D = 0.")
  flags.DEFINE_bool("tune_each", defaults.tune_each, "Run the alpha grid for every algorithm "
                    "(they coincide at D = 0, so by default only for the first).")
  flags.DEFINE_float("g0", defaults.g0, "Initial accumulator G0.")
  flags.DEFINE_integer("seed", defaults.seed, "Seed of the synthetic data and random delays.")
  flags.DEFINE_string("criteo", None, "Criteo TSV(.gz) file(s), comma-separated, instead of "
                      "the synthetic data.")
  flags.DEFINE_integer("hash_bits", defaults.hash_bits, "Criteo features are hashed into "
                       "2**hash_bits.")
  flags.DEFINE_string("output_dir", defaults.output_dir, "Where results are written.")
  flags.DEFINE_bool("plot", defaults.plot, "Write logloss_vs_delay.png (needs matplotlib).")
  flags.DEFINE_bool("dry_run", False, "Check the flags, print one line and exit without "
                    "running anything.")


def main(argv: Sequence[str]) -> None:
  del argv
  # Every pass builds fresh variables and so traces its loop anew, by design; TF would warn
  # about "excessive retracing" on each of them.
  tf.get_logger().setLevel("ERROR")
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  try:
    config = Config(num_examples=f.num_examples, delays=tuple(int(d) for d in f.delays),
                    patterns=tuple(f.patterns), algorithms=tuple(f.algorithms),
                    alpha_grid=tuple(float(a) for a in f.alpha_grid), tune_each=f.tune_each,
                    g0=f.g0, seed=f.seed, criteo=f.criteo, hash_bits=f.hash_bits,
                    output_dir=f.output_dir, plot=f.plot)
    unknown = [pattern for pattern in config.patterns if pattern not in PATTERNS]
    if unknown:
      raise ValueError(f"Unknown delay pattern {unknown[0]!r}; expected one of {PATTERNS}.")
    unknown = [a for a in config.algorithms if a not in ALGORITHMS]
    if unknown:
      raise ValueError(f"Unknown algorithm {unknown[0]!r}; expected some of {ALGORITHMS}.")
  except ValueError as e:
    sys.exit(f"benchmarks.adaptive_revision_delay: error: {e}")
  if f.dry_run:
    print("benchmarks.adaptive_revision_delay: dry run: flags valid; nothing run.")
    return
  # The simulation is one long chain of tiny ops: thread pools only add hand-offs (and load on a
  # shared machine). Not in a dry run, which configures nothing (and, in a process that has run
  # TensorFlow ops already, could not).
  tf.config.threading.set_inter_op_parallelism_threads(1)
  tf.config.threading.set_intra_op_parallelism_threads(1)
  run(config)


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  define_flags()
  app.run(main)
