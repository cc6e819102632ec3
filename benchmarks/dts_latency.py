"""Plain synchronous SGD vs DTS under injected network latency (DTS paper, Fig. 1 and 4).

Every configuration trains the same model from the same initial weights on the same examples in
the same order, for the same number of steps, on `--replicas` replicas (a MirroredStrategy over
logical CPU devices of this process), with `--latencies` milliseconds injected into every
all-reduce (a propagation delay: several exchanges can be in flight at once, see
`tf_gba.distribute.latency`). Reported per (configuration, latency): steady-state steps/s, the
time the loop spent blocked on exchanges, final training loss, and the AUC / log loss of the final
model (after `synchronize()`, i.e. the replicas' average) on a held-out set.

Configurations (`--configs`): "sync" is delay 1, period 1 through the same exchange: each step
waits for its all-reduce, which makes it exactly synchronous (momentum) SGD (tests/optimizers/test_dts.py
checks this); "tXpY" is DTS with delay X and period Y.

Data: a deterministic synthetic CTR problem: dense features x ~ N(0, I), clicks drawn from a
logistic teacher with a negative bias (about 25% positives); the model is a small MLP (tf_keras)
returning click probabilities. The defaults train close to the teacher's AUC, so the AUC
comparison is not decided by how far from convergence each run stopped.

Target checked (--target_latency, default the largest latency): every DTS configuration keeps at
least 3x the steps/s of plain sync, with eval AUC within 0.002 of sync's at the same number of
examples.

Usage:
  python -m benchmarks.dts_latency
  python -m benchmarks.dts_latency --steps=600 --latencies=0,50,200,500 \
      --configs=sync,t4p1,t1p4,t8p8

Writes `dts_latency.md`, `dts_latency.json` and `dts_latency.png` (scalability vs latency, if
matplotlib is installed) to --output_dir.
"""

import dataclasses
import json
import os
import re
import sys
import tempfile
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

import tf_gba  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is used)
import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute.dts_training import make_local_mirrored_strategy
from tf_gba.training.dts_job import train_dts

SPEEDUP_TARGET = 3.0
AUC_TOLERANCE = 0.002


@dataclasses.dataclass
class Config:
  """What to run. The defaults take about 5 minutes on 2 CPU cores."""
  replicas: int = 4
  steps: int = 300
  per_replica_batch: int = 256
  latencies: Tuple[float, ...] = (0.0, 50.0, 200.0)
  configs: Tuple[str, ...] = ("sync", "t4p4", "t4p8", "t8p4", "t8p8")
  inner: str = "momentum"
  learning_rate: float = 0.07
  momentum: float = 0.9
  features: int = 32
  hidden: int = 32
  eval_examples: int = 20000
  target_latency: Optional[float] = None   # default: the largest latency
  seed: int = 0
  output_dir: str = os.path.join(tempfile.gettempdir(), "tf_gba_benchmarks", "dts_latency")
  plot: bool = True


def parse_config(name: str) -> Tuple[int, int]:
  """"sync" -> (1, 1); "t4p8" -> (delay 4, period 8)."""
  if name == "sync":
    return 1, 1
  match = re.fullmatch(r"t(\d+)p(\d+)", name)
  if not match:
    raise ValueError(f"configuration must be 'sync' or 'tXpY' (delay X, period Y), got {name!r}")
  return int(match.group(1)), int(match.group(2))


# ------------------------------------------------------------------------------------------------
# Data and model.

def synthetic_ctr(num_examples: int, features: int, seed: int,
                  stream: int) -> Tuple[np.ndarray, np.ndarray]:
  """Dense features and 0/1 clicks from a fixed logistic teacher (same seed, same teacher).

  `stream` picks independent examples (0: training, 1: evaluation) from the same teacher.
  """
  w_true = np.random.default_rng(seed).normal(size=features) * 1.5 / np.sqrt(features)
  rng = np.random.default_rng([seed, stream])
  x = rng.normal(size=(num_examples, features)).astype(np.float32)
  logits = x @ w_true - 1.6
  y = (rng.random(num_examples) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
  return x, y


def make_model(features: int, hidden: int, seed: int) -> keras.Model:
  keras.utils.set_random_seed(seed)   # The same initial weights for every configuration.
  return keras.Sequential([
      keras.Input(shape=(features,)),
      keras.layers.Dense(hidden, activation="relu"),
      keras.layers.Dense(1, activation="sigmoid"),
  ])


# ------------------------------------------------------------------------------------------------
# Runs.

def run(config: Config, strategy: Optional[tf.distribute.Strategy] = None) -> Dict:
  """Trains every (configuration, latency), writes and returns the results."""
  for name in config.configs:
    parse_config(name)
  strategy = strategy or make_local_mirrored_strategy(config.replicas)
  replicas = strategy.num_replicas_in_sync
  global_batch = config.per_replica_batch * replicas
  train_x, train_y = synthetic_ctr(config.steps * global_batch, config.features, config.seed,
                                   stream=0)
  eval_x, eval_y = synthetic_ctr(config.eval_examples, config.features, config.seed, stream=1)

  def dataset_fn(ctx):
    del ctx  # One input pipeline; the strategy deals its batches to the replicas in turn.
    data = tf.data.Dataset.from_tensor_slices((train_x, train_y))
    return data.repeat().batch(config.per_replica_batch, drop_remainder=True).prefetch(4)

  def eval_fn():
    return tf.data.Dataset.from_tensor_slices((eval_x, eval_y)).batch(4096)

  runs = []
  for latency in config.latencies:
    for name in config.configs:
      delay, period = parse_config(name)
      summary = train_dts(
          lambda: make_model(config.features, config.hidden, config.seed), dataset_fn,
          steps=config.steps, delay=delay, period=period, latency_ms=latency, strategy=strategy,
          inner=config.inner, learning_rate=config.learning_rate, momentum=config.momentum,
          eval_dataset_fn=eval_fn, global_batch_size=global_batch)
      summary["config"] = name
      runs.append(summary)
      print(f"[dts_latency] {name:>6} latency {latency:6.0f} ms: "
            f"{summary['steps_per_sec']:8.2f} steps/s, "
            f"blocked {summary['blocked_seconds']:6.2f} s, AUC {summary['eval_auc']:.4f}",
            flush=True)
  results = {"config": dataclasses.asdict(config), "replicas": replicas,
             "global_batch": global_batch, "examples": config.steps * global_batch,
             "runs": runs}
  results["target"] = check_target(results, config)
  _write(results, config)
  return results


def _by_key(results) -> Dict[Tuple[str, float], Dict]:
  return {(r["config"], r["latency_ms"]): r for r in results["runs"]}


def check_target(results: Dict, config: Config) -> Dict:
  """At the target latency: DTS steps/s >= 3x sync's and |AUC - sync AUC| <= 0.002."""
  latency = float(config.target_latency if config.target_latency is not None
                  else max(config.latencies))
  runs = _by_key(results)
  sync = runs.get(("sync", latency))
  checks = {}
  if sync is None:
    return {"latency_ms": latency, "met": None, "why": "no sync run at this latency"}
  for name in config.configs:
    if name == "sync" or (name, latency) not in runs:
      continue
    r = runs[(name, latency)]
    speedup = r["steps_per_sec"] / sync["steps_per_sec"]
    auc_gap = r["eval_auc"] - sync["eval_auc"]
    checks[name] = {"speedup": speedup, "auc_gap": auc_gap,
                    "met": bool(speedup >= SPEEDUP_TARGET and abs(auc_gap) <= AUC_TOLERANCE)}
  return {"latency_ms": latency, "checks": checks,
          "met": bool(checks) and all(c["met"] for c in checks.values())}


# ------------------------------------------------------------------------------------------------
# Output.

def _markdown(results: Dict) -> str:
  config = results["config"]
  runs = _by_key(results)
  lines = [
      f"{results['replicas']} replicas (MirroredStrategy over logical CPUs), inner "
      f"{config['inner']} (lr {config['learning_rate']:g}, momentum {config['momentum']:g}), "
      f"{config['steps']} steps x {results['global_batch']} examples = {results['examples']} "
      f"examples per run; eval on {config['eval_examples']} held-out examples.",
      "Speedup: steps/s over sync at the same latency. Blocked: seconds the loop waited for "
      "exchanges.", "",
      "| config | delay | period | latency ms | steps/s | speedup | blocked s | final loss | "
      "eval AUC | AUC - sync | eval log loss |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for latency in config["latencies"]:
    sync = runs.get(("sync", float(latency)))
    for name in config["configs"]:
      r = runs[(name, float(latency))]
      speedup = r["steps_per_sec"] / sync["steps_per_sec"] if sync else float("nan")
      gap = r["eval_auc"] - sync["eval_auc"] if sync else float("nan")
      lines.append(
          f"| {name} | {r['delay']} | {r['period']} | {latency:g} | {r['steps_per_sec']:.2f} | "
          f"{speedup:.2f}x | {r['blocked_seconds']:.2f} | {r['final_loss']:.4f} | "
          f"{r['eval_auc']:.4f} | {gap:+.4f} | {r['eval_log_loss']:.4f} |")
  target = results["target"]
  lines += ["", f"Target at {target['latency_ms']:g} ms: DTS >= {SPEEDUP_TARGET:g}x sync steps/s "
            f"and |AUC - sync AUC| <= {AUC_TOLERANCE:g}: "
            f"{'MET' if target['met'] else 'NOT MET'}."]
  for name, check in target.get("checks", {}).items():
    lines.append(f"- {name}: {check['speedup']:.2f}x, AUC {check['auc_gap']:+.4f} "
                 f"({'ok' if check['met'] else 'missed'})")
  return "\n".join(lines) + "\n"


def _write(results: Dict, config: Config) -> None:
  os.makedirs(config.output_dir, exist_ok=True)
  table = _markdown(results)
  paths = [os.path.join(config.output_dir, n) for n in ("dts_latency.md", "dts_latency.json")]
  with open(paths[0], "w") as f:
    f.write(table)
  with open(paths[1], "w") as f:
    json.dump(results, f, indent=2)
  print("\n" + table, flush=True)
  if config.plot:
    png = _plot(results, config)
    if png:
      paths.append(png)
  print("Wrote " + ", ".join(paths), flush=True)


def _plot(results: Dict, config: Config) -> Optional[str]:
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    print("matplotlib is not installed: no plot (pip install matplotlib).", flush=True)
    return None
  runs = _by_key(results)
  latencies = [float(l) for l in config.latencies]
  base = runs.get(("sync", latencies[0]))
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
  positions = list(range(len(latencies)))   # a non-linear latency axis, as in the paper
  for name in config.configs:
    speed = [runs[(name, l)]["steps_per_sec"] for l in latencies]
    label = "sync SGD" if name == "sync" else f"DTS delay {parse_config(name)[0]}, " \
                                             f"period {parse_config(name)[1]}"
    style = dict(marker="o", linestyle="--" if name == "sync" else "-")
    if base:
      left.plot(positions, [s / base["steps_per_sec"] for s in speed], label=label, **style)
    right.plot(positions, [runs[(name, l)]["steps_per_sec"] /
                           runs[("sync", l)]["steps_per_sec"] for l in latencies],
               label=label, **style)
  for ax in (left, right):
    ax.set_xticks(positions)
    ax.set_xticklabels([f"{l:g}" for l in latencies])
    ax.set_xlabel("network latency per all-reduce (ms)")
    ax.grid(alpha=0.3)
  left.set_ylabel(f"steps/s relative to sync at {latencies[0]:g} ms")
  left.set_title(f"Scalability vs latency ({results['replicas']} replicas)")
  right.set_ylabel("speedup over sync at the same latency")
  right.set_title("DTS speedup over synchronous SGD")
  right.axhline(SPEEDUP_TARGET, color="grey", linewidth=0.8, linestyle=":")
  left.legend(fontsize=8)
  fig.tight_layout()
  path = os.path.join(config.output_dir, "dts_latency.png")
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


# ------------------------------------------------------------------------------------------------
# Command line.

def define_flags() -> None:
  """Defines the command-line flags (called by __main__ only, never at import)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  d = Config()
  flags.DEFINE_integer("replicas", d.replicas, "Replicas (logical CPU devices).")
  flags.DEFINE_integer("steps", d.steps, "Training steps per run (same for every run).")
  flags.DEFINE_integer("per_replica_batch", d.per_replica_batch, "Examples per replica and step.")
  flags.DEFINE_list("latencies", [f"{l:g}" for l in d.latencies],
                    "Injected latency per all-reduce, ms.")
  flags.DEFINE_list("configs", list(d.configs), "'sync' and DTS configurations 'tXpY'.")
  flags.DEFINE_enum("inner", d.inner, ["sgd", "momentum"], "Local update rule.")
  flags.DEFINE_float("learning_rate", d.learning_rate, "Learning rate.")
  flags.DEFINE_float("momentum", d.momentum, "Momentum (inner=momentum).")
  flags.DEFINE_integer("features", d.features, "Dense features of the synthetic problem.")
  flags.DEFINE_integer("hidden", d.hidden, "Hidden units of the MLP.")
  flags.DEFINE_integer("eval_examples", d.eval_examples, "Held-out examples for AUC.")
  flags.DEFINE_float("target_latency", None, "Latency at which the target is checked "
                     "(default: the largest).")
  flags.DEFINE_integer("seed", d.seed, "Seed of the data and the initial weights.")
  flags.DEFINE_string("output_dir", d.output_dir, "Where results are written.")
  flags.DEFINE_bool("plot", d.plot, "Write dts_latency.png (needs matplotlib).")
  flags.DEFINE_bool("dry_run", False, "Check the flags, print one line and exit without "
                    "running anything.")


def main(argv: Sequence[str]) -> None:
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  try:
    config = Config(replicas=f.replicas, steps=f.steps, per_replica_batch=f.per_replica_batch,
                    latencies=tuple(float(l) for l in f.latencies), configs=tuple(f.configs),
                    inner=f.inner, learning_rate=f.learning_rate, momentum=f.momentum,
                    features=f.features, hidden=f.hidden, eval_examples=f.eval_examples,
                    target_latency=f.target_latency, seed=f.seed, output_dir=f.output_dir,
                    plot=f.plot)
    for name in config.configs:
      parse_config(name)
  except ValueError as e:
    sys.exit(f"benchmarks.dts_latency: error: {e}")
  if f.dry_run:
    print("benchmarks.dts_latency: dry run: flags valid; nothing run.")
    return
  run(config)


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  define_flags()
  app.run(main)
