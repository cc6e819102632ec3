"""What one distributed training step costs, by process role, beside one process's training.

  python -m benchmarks.step_cost [--modes=gba,async_plain,sync] [--steps=1000,3000]
                                 [--num_workers=4] [--local_batch_size=256] [--log_every=100]
                                 [--repeats=1]
                                 [--trees=.] [--out=runs/bench_step_cost] [binary flags ...]

Each configuration runs examples/train.py (DeepFM, synthetic data, no stragglers; 1 PS in the
parameter-server modes) twice, for the two step counts of `--steps`, while
`benchmarks.process_cpu` samples the CPU-seconds (user + system, /proc) of every process of the
job by role: the coordinator (the binary's own process), each parameter server, the workers, the
tf.data service's workers. The difference between the two runs, divided by the extra worker
steps, is the marginal CPU of a worker step: start-up, tracing, the final checkpoint, the
evaluation and the export are the same in both runs and cancel. "single" is the physical limit:
`model.fit` of the same model, data and batch in one process, no strategy, measured the same way.

`--trees=new:.,old:/path/to/checkout` runs every configuration with each tree's binary (its own
tf_gba package and op libraries), interleaved, so a change is measured against its base side by
side on the same machine state. Further `--name=value` flags go to the binary (for the modes that
read them), e.g. `--steps_per_execution=1`.

Measure on a quiet machine: threads that wait by spinning burn less CPU when the cores are busy
with other work, so the figures of a loaded machine read lower than the job's own cost.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Dict, List

from benchmarks import mode_qps
from benchmarks.process_cpu import ProcessTreeCpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLES = ("coordinator", "ps", "worker", "tfdata_worker", "other")
SINGLE = "single"


def _tree_env(tree: str) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in env.get("PYTHONPATH", "").split(
      os.pathsep) if p])
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  return env


def _measure(cmd: List[str], tree: str, log: str) -> Dict[str, float]:
  """Runs `cmd` in `tree`; returns its process tree's CPU-seconds by role and the wall time."""
  with open(log, "w") as out:
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=tree, env=_tree_env(tree), stdout=out,
                            stderr=subprocess.STDOUT)
    with ProcessTreeCpu(proc.pid) as cpu:
      rc = proc.wait()
    wall = time.time() - t0
  if rc != 0:
    with open(log) as f:
      raise RuntimeError(f"{' '.join(cmd)} failed (exit {rc}):\n{f.read()[-3000:]}")
  roles = cpu.by_role()
  roles["wall"] = wall
  return roles


def _binary_run(mode: str, steps: int, tree: str, out: str, extra, num_workers: int,
                local_batch_size: int, log_every: int) -> dict:
  model_dir = os.path.join(out, f"{mode}_{steps}")
  subprocess.run(["rm", "-rf", model_dir], check=True)
  os.makedirs(model_dir)
  flags = mode_qps.binary_flags(mode, "none", steps, model_dir, extra, num_workers,
                                local_batch_size)
  flags = [f for f in flags if not f.startswith("--log_every")] + [f"--log_every={log_every}"]
  cost = _measure([sys.executable, os.path.join(tree, "examples", "train.py"), *flags], tree,
                  os.path.join(model_dir, "stdout.log"))
  with open(os.path.join(model_dir, "summary.json")) as f:
    summary = json.load(f)
  cost["qps"] = summary["global_qps"]
  cost["worker_steps"] = summary.get("worker_steps", steps)
  return cost


def _single_run(steps: int, tree: str, out: str, local_batch_size: int) -> dict:
  os.makedirs(out, exist_ok=True)
  return _measure([sys.executable, "-m", "benchmarks.step_cost", f"--_single_steps={steps}",
                   f"--local_batch_size={local_batch_size}"], tree,
                  os.path.join(out, f"single_{steps}.log"))


def single_process_fit(steps: int, local_batch_size: int) -> None:
  """`model.fit` of the binary's default model on its default data, one process, no strategy."""
  import tf_keras as keras  # pylint: disable=g-import-not-at-top
  from tf_gba import data as data_lib  # pylint: disable=g-import-not-at-top
  from tf_gba import models as models_lib  # pylint: disable=g-import-not-at-top
  from tf_gba.training.config import TrainConfig  # pylint: disable=g-import-not-at-top
  config = TrainConfig()
  info = data_lib.data_info(config.data)
  model = models_lib.build_model(config.model, info, embedding_dim=config.embedding_dim,
                                 seed=config.seed)
  model.compile(keras.optimizers.Adam(config.learning_rate),
                loss=keras.losses.BinaryCrossentropy())
  data = data_lib.make_dataset(config.data, split="train", batch_size=local_batch_size,
                               repeat=True, shuffle_seed=config.seed)
  model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)


def marginal(short: dict, long: dict, extra_steps: int) -> Dict[str, float]:
  """ms of CPU per worker step by role (and "job", their sum) between two run lengths."""
  per = {r: 1000.0 * (long.get(r, 0.0) - short.get(r, 0.0)) / extra_steps for r in ROLES}
  per["job"] = sum(per.values())
  return per


def table(results: dict, single: Dict[str, float], local_batch_size: int) -> List[str]:
  lines = ["| tree | mode | coordinator | PS | workers | tf.data workers | other | whole job | "
           "vs one process | examples per CPU-s | global QPS |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for (tree, mode), per in results.items():
    base = single.get(tree)
    ratio = f"{per['job'] / base:.1f}x" if base else "-"
    lines.append(
        f"| {tree} | {mode} | {per['coordinator']:.2f} | {per['ps']:.2f} | {per['worker']:.2f} | "
        f"{per['tfdata_worker']:.2f} | {per['other']:.2f} | {per['job']:.2f} | {ratio} | "
        f"{1000.0 * local_batch_size / per['job']:,.0f} | "
        + (f"{per['qps']:,.0f} |" if per.get("qps") else "- |"))
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--modes", default="gba,async_plain,sync",
                 help="comma-separated binary modes (async_plain: TF's own async, the bare "
                      f"optimizer), and {SINGLE!r} for one process without a strategy")
  p.add_argument("--steps", default="1000,3000",
                 help="the two run lengths, in worker steps, whose difference is measured")
  p.add_argument("--num_workers", type=int, default=4)
  p.add_argument("--local_batch_size", type=int, default=256)
  p.add_argument("--log_every", type=int, default=100,
                 help="the binary's progress interval (its default): a progress line reads "
                      "counters from every server, part of the coordinator's cost per step")
  p.add_argument("--repeats", type=int, default=1)
  p.add_argument("--trees", default=".",
                 help="comma-separated [name:]path of checkouts whose binaries are measured "
                      "side by side (each with its op libraries built)")
  p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_step_cost"))
  p.add_argument("--_single_steps", type=int, default=0, help=argparse.SUPPRESS)
  args, extra = p.parse_known_args(argv)
  if args._single_steps:  # pylint: disable=protected-access
    single_process_fit(args._single_steps, args.local_batch_size)  # pylint: disable=protected-access
    return None
  stray = [a for a in extra if not a.startswith("--")]
  if stray:
    p.error(f"unrecognized arguments: {' '.join(stray)} (the binary's flags, passed on, are "
            "--name=value)")
  try:
    short, long = (int(s) for s in args.steps.split(","))
  except ValueError:
    p.error(f"--steps takes two step counts, short,long; got {args.steps!r}")
  if not 0 < short < long:
    p.error(f"--steps: the second run length must be longer than the first; got {args.steps}")
  trees = {}
  for item in args.trees.split(","):
    name, _, path = item.rpartition(":")
    path = os.path.abspath(path)
    if not os.path.isfile(os.path.join(path, "examples", "train.py")):
      p.error(f"--trees: {path} has no examples/train.py")
    trees[name or os.path.basename(path)] = path
  modes = args.modes.split(",")
  runs = {(t, m): {short: [], long: []} for t in trees for m in modes}
  for rep in range(args.repeats):
    for steps in (short, long):
      for mode in modes:
        for tname, tree in trees.items():
          out = os.path.join(args.out, f"{tname}_{rep}")
          if mode == SINGLE:
            cost = _single_run(steps, tree, out, args.local_batch_size)
          else:
            cost = _binary_run(mode, steps, tree, out, extra, args.num_workers,
                               args.local_batch_size, args.log_every)
          runs[(tname, mode)][steps].append(cost)
          print(f"  {tname:8s} {mode:12s} {steps:6d} steps: "
                + "  ".join(f"{r} {cost.get(r, 0.0):.1f}s" for r in ROLES if cost.get(r))
                + f"  wall {cost['wall']:.1f}s"
                + (f"  QPS {cost['qps']:,.0f}" if cost.get("qps") else ""), flush=True)
  results, single = {}, {}
  for key, by_len in runs.items():
    pairs = [marginal(s, l, long - short) for s, l in zip(by_len[short], by_len[long])]
    per = {k: sum(p[k] for p in pairs) / len(pairs) for k in pairs[0]}
    qps = [c["qps"] for c in by_len[long] if c.get("qps")]
    per["qps"] = sum(qps) / len(qps) if qps else None
    if key[1] == SINGLE:
      single[key[0]] = per["job"]
    results[key] = per
  load = os.getloadavg()
  lines = [f"ms of CPU per worker step, marginal between {short} and {long} worker steps; "
           f"{args.num_workers} workers, local batch {args.local_batch_size}; "
           f"{args.repeats} repeat(s); load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
           "at the end", *table(results, single, args.local_batch_size)]
  print("\n" + "\n".join(lines))
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "step_cost.json"), "w") as f:
    json.dump({"args": vars(args), "extra": extra,
               "results": {f"{t}/{m}": v for (t, m), v in results.items()},
               "raw": {f"{t}/{m}": {str(k): v for k, v in by.items()}
                       for (t, m), by in runs.items()}}, f, indent=1)
  return results


if __name__ == "__main__":
  main()
