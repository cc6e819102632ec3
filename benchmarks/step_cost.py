"""What one distributed training step costs, by process role, beside one process's training.

  python -m benchmarks.step_cost [--modes=gba,async_plain,sync,user_fit,single] [--steps=4000]
                                 [--num_workers=4] [--local_batch_size=256] [--log_every=N]
                                 [--repeats=1] [--trees=.] [--out=runs/bench_step_cost]
                                 [binary flags ...]

Each configuration runs examples/train.py (DeepFM, synthetic data, no stragglers; 1 PS in the
parameter-server modes) while `benchmarks.process_cpu` samples the CPU-seconds (user + system,
/proc) of every process of the job by role: the coordinator (the binary's job process), the
parameter servers, the workers, the tf.data service's workers and its dispatcher (a process of
its own, in the local cluster as on a real one). At each progress line the counters are read
again; the CPU between the first line past a quarter of the run and the last one, over the worker
steps between them, is the CPU of a worker step: start-up, tracing, the final checkpoint, the
evaluation and the export fall outside that window. "single" is the physical limit: `model.fit`
of the same model, data and batch in one process, no strategy, measured the same way (its own
progress lines). "user_fit" is a user's own script
(benchmarks/user_fit_job.py): `model.fit` of the same model, data and batch under `GBAStrategy`
on a `LocalCluster`, every setting left at its default.

`--trees=new:.,old:/path/to/checkout` runs every configuration with each tree's binary (its own
tf_gba package and op libraries), interleaved, so a change is measured against its base side by
side on the same machine state ("single" runs once, with this checkout: it uses no strategy).
Further `--name=value` flags go to the binary (for the modes that read them), e.g.
`--steps_per_execution=1`.

Measure on a quiet machine: threads that wait by spinning burn less CPU when the cores are busy
with other work, so the figures of a loaded machine read lower than the job's own cost.
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from typing import Dict, List, Optional

from benchmarks import mode_qps
from benchmarks.process_cpu import ProcessTreeCpu
from tf_gba.training import mode_registry
from tf_gba.training.config import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLES = ("coordinator", "ps", "worker", "tfdata_worker", "tfdata_dispatcher", "other")
SINGLE = "single"
DEFAULT_LOG_EVERY = TrainConfig().log_every
# A user's own script: `model.fit` under GBAStrategy with its default settings on a LocalCluster.
USER_FIT = "user_fit"


def _tree_env(tree: str) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in env.get("PYTHONPATH", "").split(
      os.pathsep) if p])
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  return env


_PROGRESS = re.compile(r"^step (\d+)/(\d+)")


def _measure(cmd: List[str], tree: str, log: str) -> Dict[str, float]:
  """Runs `cmd` in `tree`; returns its process tree's CPU-seconds by role over its warm window,
  the worker steps in that window ("window_steps") and its seconds ("window_seconds").

  The window runs from the first progress line (`step N/T`) at or past a quarter of the run to
  the last one: start-up, tracing, the final checkpoint, evaluation and export fall outside.
  """
  marks = []  # (steps finished, time, CPU by role) at each progress line
  with open(log, "w") as out:
    proc = subprocess.Popen(cmd, cwd=tree, env=_tree_env(tree), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    with ProcessTreeCpu(proc.pid) as cpu:
      for line in proc.stdout:
        out.write(line)
        m = _PROGRESS.match(line)
        if m:
          cpu.sample()
          marks.append((int(m.group(1)), int(m.group(2)), time.time(), cpu.by_role()))
      rc = proc.wait()
  if rc != 0:
    with open(log) as f:
      raise RuntimeError(f"{' '.join(cmd)} failed (exit {rc}):\n{f.read()[-3000:]}")
  warm = [m for m in marks if m[0] >= m[1] / 4]
  if len(warm) < 2 or warm[-1][0] <= warm[0][0]:
    raise RuntimeError(f"{' '.join(cmd)}: fewer than two progress lines after a quarter of the "
                       f"run ({len(marks)} in all): run more --steps or a smaller --log_every")
  (s0, _, t0, c0), (s1, _, t1, c1) = warm[0], warm[-1]
  roles = {r: c1.get(r, 0.0) - c0.get(r, 0.0) for r in set(c0) | set(c1)}
  roles.update(window_steps=s1 - s0, window_seconds=t1 - t0)
  return roles


def binary_flags(mode: str, steps: int, model_dir: str, extra, num_workers: int,
                 local_batch_size: int, log_every: Optional[int]) -> List[str]:
  """examples/train.py's flags for one run of `mode` (no stragglers); `log_every` None leaves the
  binary's own."""
  flags = mode_qps.binary_flags(mode, "none", steps, model_dir, extra, num_workers,
                                local_batch_size)
  return ([f for f in flags if not f.startswith("--log_every")]
          + ([f"--log_every={log_every}"] if log_every else []))


def _binary_run(mode: str, steps: int, tree: str, out: str, extra, num_workers: int,
                local_batch_size: int, log_every: Optional[int]) -> dict:
  model_dir = os.path.join(out, f"{mode}_{steps}")
  subprocess.run(["rm", "-rf", model_dir], check=True)
  os.makedirs(model_dir)
  flags = binary_flags(mode, steps, model_dir, extra, num_workers, local_batch_size, log_every)
  cost = _measure([sys.executable, os.path.join(tree, "examples", "train.py"), *flags], tree,
                  os.path.join(model_dir, "stdout.log"))
  with open(os.path.join(model_dir, "summary.json")) as f:
    summary = json.load(f)
  cost["qps"] = summary["global_qps"]
  cost["worker_steps"] = summary.get("worker_steps", steps)
  return cost


def _single_run(steps: int, tree: str, out: str, local_batch_size: int, log_every: int) -> dict:
  os.makedirs(out, exist_ok=True)
  return _measure([sys.executable, "-m", "benchmarks.step_cost", f"--_single_steps={steps}",
                   f"--local_batch_size={local_batch_size}", f"--log_every={log_every}"], tree,
                  os.path.join(out, f"single_{steps}.log"))


def single_process_fit(steps: int, local_batch_size: int, log_every: int) -> None:
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

  class Progress(keras.callbacks.Callback):  # the binary's progress lines, for the window

    def on_epoch_end(self, epoch, logs=None):
      print(f"step {(epoch + 1) * log_every}/{steps}", flush=True)

  model.fit(data, epochs=steps // log_every, steps_per_epoch=log_every, verbose=0,
            callbacks=[Progress()])


def _user_fit_run(steps: int, tree: str, out: str, num_workers: int, local_batch_size: int,
                  log_every: int) -> dict:
  # This checkout's script, run with `tree`'s tf_gba: a user's script does not change with it.
  os.makedirs(out, exist_ok=True)
  return _measure([sys.executable, os.path.join(ROOT, "benchmarks", "user_fit_job.py"),
                   f"--steps={steps}", f"--num_workers={num_workers}",
                   f"--local_batch_size={local_batch_size}", f"--log_every={log_every}"], tree,
                  os.path.join(out, f"{USER_FIT}_{steps}.log"))


def per_step(cost: dict) -> Dict[str, float]:
  """ms of CPU per worker step by role (and "job", their sum) over a run's warm window."""
  per = {r: 1000.0 * cost.get(r, 0.0) / cost["window_steps"] for r in ROLES}
  per["job"] = sum(per.values())
  return per


def table(results: dict, single: Dict[str, float], local_batch_size: int) -> List[str]:
  lines = ["| tree | mode | coordinator | PS | workers | tf.data workers | tf.data dispatcher | "
           "other | whole job | vs one process | examples per CPU-s | global QPS |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for (tree, mode), per in results.items():
    base = single.get(tree)
    ratio = f"{per['job'] / base:.1f}x" if base else "-"
    lines.append(
        f"| {tree} | {mode} | {per['coordinator']:.2f} | {per['ps']:.2f} | {per['worker']:.2f} | "
        f"{per['tfdata_worker']:.2f} | {per['tfdata_dispatcher']:.2f} | {per['other']:.2f} | "
        f"{per['job']:.2f} | {ratio} | "
        f"{1000.0 * local_batch_size / per['job']:,.0f} | "
        + (f"{per['qps']:,.0f} |" if per.get("qps") else "- |"))
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--modes", default=f"gba,async_plain,sync,{USER_FIT},{SINGLE}",
                 help="comma-separated binary modes (async_plain: TF's own async, the bare "
                      f"optimizer), {USER_FIT!r} for a user's model.fit under GBAStrategy with "
                      f"its defaults, and {SINGLE!r} for one process without a strategy")
  p.add_argument("--steps", type=int, default=4000,
                 help="worker steps of each run; the window measured is from a quarter of them "
                      "to the last progress line")
  p.add_argument("--num_workers", type=int, default=4)
  p.add_argument("--local_batch_size", type=int, default=256)
  p.add_argument("--log_every", type=int, default=None,
                 help="the binary's progress interval; by default each tree's binary keeps its "
                      f"own (this one's: {DEFAULT_LOG_EVERY}), and the user_fit and single runs "
                      f"take an epoch of {DEFAULT_LOG_EVERY} steps. A progress line reads "
                      "counters from every server, part of the coordinator's cost per step")
  p.add_argument("--repeats", type=int, default=1)
  p.add_argument("--trees", default=".",
                 help="comma-separated [name:]path of checkouts whose binaries are measured "
                      "side by side (each with its op libraries built)")
  p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_step_cost"))
  p.add_argument("--dry_run", action="store_true",
                 help="print the examples/train.py command of every run and exit")
  p.add_argument("--_single_steps", type=int, default=0, help=argparse.SUPPRESS)
  args, extra = p.parse_known_args(argv)
  if args._single_steps:  # pylint: disable=protected-access
    single_process_fit(args._single_steps, args.local_batch_size, args.log_every)  # pylint: disable=protected-access
    return None
  stray = [a for a in extra if not a.startswith("--")]
  if stray:
    p.error(f"unrecognized arguments: {' '.join(stray)} (the binary's flags, passed on, are "
            "--name=value)")
  interval = args.log_every or DEFAULT_LOG_EVERY
  if args.steps < 4 * interval:
    p.error(f"--steps={args.steps} leaves too few progress lines of --log_every="
            f"{interval} after a quarter of the run: use at least {4 * interval}")
  trees = {}
  for item in args.trees.split(","):
    name, _, path = item.rpartition(":")
    path = os.path.abspath(path)
    if not os.path.isfile(os.path.join(path, "examples", "train.py")):
      p.error(f"--trees: {path} has no examples/train.py")
    trees[name or os.path.basename(path)] = path
  modes = args.modes.split(",")
  for mode in modes:
    if mode not in (SINGLE, USER_FIT, "async_plain"):
      try:
        mode_registry.get(mode)
      except ValueError as e:
        p.error(f"--modes: {e}")
  if args.dry_run:
    for mode in modes:
      if mode not in (SINGLE, USER_FIT):
        print(shlex.join(["examples/train.py", *binary_flags(
            mode, args.steps, os.path.join(args.out, "dry_run"), extra, args.num_workers,
            args.local_batch_size, args.log_every)]))
    return {}
  runs = {(t, m): [] for t in trees for m in modes if m != SINGLE or t == next(iter(trees))}
  for rep in range(args.repeats):
    for mode in modes:
      for tname, tree in trees.items():
        if (tname, mode) not in runs:
          continue  # one process without a strategy: the same in every tree, run once
        out = os.path.join(args.out, f"{tname}_{rep}")
        if mode == SINGLE:
          cost = _single_run(args.steps, ROOT, out, args.local_batch_size, interval)
        elif mode == USER_FIT:
          cost = _user_fit_run(args.steps, tree, out, args.num_workers, args.local_batch_size,
                               interval)
        else:
          cost = _binary_run(mode, args.steps, tree, out, extra, args.num_workers,
                             args.local_batch_size, args.log_every)
        runs[(tname, mode)].append(cost)
        per = per_step(cost)
        print(f"  {tname:8s} {mode:12s} rep {rep}: "
              + "  ".join(f"{r} {per[r]:.2f}" for r in ROLES if per[r])
              + f"  job {per['job']:.2f} ms/step over {cost['window_steps']} steps in "
              f"{cost['window_seconds']:.1f} s"
              + (f"  QPS {cost['qps']:,.0f}" if cost.get("qps") else ""), flush=True)
  results, single = {}, {}
  for key, costs in runs.items():
    pers = [per_step(c) for c in costs]
    per = {k: sum(p[k] for p in pers) / len(pers) for k in pers[0]}
    qps = [c["qps"] for c in costs if c.get("qps")]
    per["qps"] = sum(qps) / len(qps) if qps else None
    if key[1] == SINGLE:
      single = {t: per["job"] for t in trees}
    results[key] = per
  load = os.getloadavg()
  lines_at = (f"every {args.log_every} steps" if args.log_every else
              "at each binary's default interval")
  lines = [f"ms of CPU per worker step over each run's warm window ({args.steps} worker steps "
           f"a run); {args.num_workers} workers, local batch {args.local_batch_size}; a progress "
           f"line {lines_at}; {args.repeats} repeat(s); load average {load[0]:.2f} "
           f"{load[1]:.2f} {load[2]:.2f} at the end", *table(results, single, args.local_batch_size)]
  print("\n" + "\n".join(lines))
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "step_cost.json"), "w") as f:
    json.dump({"args": vars(args), "extra": extra,
               "results": {f"{t}/{m}": v for (t, m), v in results.items()},
               "raw": {f"{t}/{m}": costs for (t, m), costs in runs.items()}}, f, indent=1)
  return results


if __name__ == "__main__":
  main()
