"""The switching protocol replayed in one process: next-day AUC of every mode at any N.

  python -m benchmarks.replay [--num_workers=8] [--modes=sync,gba,async,bsp,hop_bs,hop_bw]
                              [--stragglers=paper] [--data=synthetic] [--model=deepfm]
                              [--days=4] [--seeds=2] [--from_sync_only | --to_sync_only]
                              [--global_batch_size=G] [--out=runs/bench_replay]

Each day of each mode is a timeline from the cluster simulator (`tf_gba.simulate`, the flags of
`benchmarks.simulate`: stragglers, compute/pull/push times, b1, b2, b3, iota, ...; a seed's
straggler draws differ per day) replayed on the real model, inner optimizer (Adam) and GBA
buffers by `tf_gba.training.replay`: no cluster, one gradient per worker step. The protocol is
`benchmarks.switching`'s (its docstring): a base day in one mode, the switched days, each day's
model evaluated on every example of the next day; both directions (sync -> mode, mode -> sync),
every mode, several seeds. A day is one pass over its train rows through the data list (Sync: the
pass in whole global steps). Tables and plots are `benchmarks.switching`'s, one set per N; QPS,
staleness and drops are those of the replayed days (QPS: the simulated global QPS; staleness and
drops: the real buffers' counters).

`--num_workers` takes a comma-separated list (the N curve). `--global_batch_size=G` keeps the
synchronous global batch across N (local batch G / N, the paper's shape); otherwise every N runs
`--local_batch_size`. A protocol whose results cannot mean anything (at some N, a day of fewer
than `switching.MIN_GLOBAL_STEPS` global steps, or a global batch larger than a `--steps_per_day`
day; a local batch below 1) is refused before anything is replayed, in one line on stderr that
names the `--global_batch_size` that fits, with exit code 2 (`--dry_run` checks it too).
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import benchmarks  # pylint: disable=g-bad-import-order
from benchmarks import switching  # pylint: disable=g-bad-import-order
from benchmarks.simulate import profile_string  # pylint: disable=g-bad-import-order
from tf_gba.training import mode_registry  # pylint: disable=g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = "benchmarks.replay"
# The modes replay reproduces (training/mode_registry.py: `replayed`), all run by default.
MODES = mode_registry.replayed_modes()


def _sim_config(args, n: int, seed: int, day: int, steps: int, local_batch: int):
  from tf_gba.simulate import SimConfig  # pylint: disable=g-import-not-at-top
  # One straggler seed per (seed, day): a day's slow steps are not the previous day's.
  return SimConfig(num_workers=n, num_ps=args.num_ps, steps=steps, compute_ms=args.compute_ms,
                   pull_ms=args.pull_ms, push_ms=args.push_ms, latency_ms=args.latency_ms,
                   stragglers=profile_string(args.stragglers), seed=1000 * seed + day,
                   local_batch_size=local_batch, iota=args.staleness_threshold,
                   gba_num_aggregate=args.num_aggregate, bsp_aggregate=args.bsp_aggregate,
                   hop_bs_bound=args.hop_bs_bound, hop_bw_backup=args.hop_bw_backup,
                   delay_after_push=args.delay_after_push, work_ms=args.work_ms,
                   ps_push_ms=args.ps_push_ms, ps_apply_ms=args.ps_apply_ms)


class Chains:
  """Runs the chains of one N and one seed in this process, recording what switching records."""

  def __init__(self, args, protocol, n: int, local_batch: int):
    from tf_gba import data as data_lib  # pylint: disable=g-import-not-at-top
    self.args, self.protocol, self.n, self.local_batch = args, protocol, n, local_batch
    self.data_lib = data_lib
    self.kwargs = _data_kwargs(args.data, protocol.data_options)
    self.info = data_lib.data_info(args.data, **self.kwargs)
    self.records: List[dict] = []
    self.replay_seconds = 0.0
    self.replayed_steps = 0

  # ---- state -------------------------------------------------------------------------------------
  def new_replay(self, seed: int, state=None):
    import tf_keras as keras  # pylint: disable=g-import-not-at-top
    from tf_gba import models as models_lib  # pylint: disable=g-import-not-at-top
    from tf_gba.training import replay  # pylint: disable=g-import-not-at-top
    model = models_lib.build_model(self.args.model, self.info, seed=seed)
    r = replay.Replay(model, keras.optimizers.Adam(self.args.learning_rate))
    if state is not None:
      for v, value in zip(model.weights, state[0]):
        v.assign(value)
      for v, value in zip(r.inner.variables, state[1]):
        v.assign(value)
    return r

  @staticmethod
  def snapshot(r):
    return ([v.numpy() for v in r.model.weights], [v.numpy() for v in r.inner.variables])

  # ---- one day -------------------------------------------------------------------------------------
  def batches(self, seed: int, day: int):
    ds = self.data_lib.make_dataset(self.args.data, split="train", day=day,
                                    batch_size=self.local_batch, shuffle_seed=seed,
                                    **self.kwargs)
    return iter(ds.repeat())

  def evaluate(self, r, day: int) -> dict:
    from tf_gba.common import metrics  # pylint: disable=g-import-not-at-top
    common = dict(batch_size=1024, shuffle_seed=None, **self.kwargs)
    if self.protocol.next_day:
      ds = self.data_lib.make_dataset(self.args.data, split="train", day=day, **common)
      ds = ds.concatenate(self.data_lib.make_dataset(self.args.data, split="eval", day=day,
                                                     **common))
    else:
      ds = self.data_lib.make_dataset(self.args.data, split="eval", day=day, **common)
    return metrics.evaluate_binary(r.model, ds.take(math.ceil(
        self.protocol.eval_examples / 1024)))

  def day(self, r, mode: str, seed: int, day: int, eval_day: int, direction: str,
          base_mode: str) -> dict:
    from tf_gba.simulate import simulate  # pylint: disable=g-import-not-at-top
    from tf_gba.training import replay  # pylint: disable=g-import-not-at-top
    n = self.n
    steps = day_steps(self.protocol, mode, n)
    sim = simulate(mode, _sim_config(self.args, n, seed, day, math.ceil(steps / n) + 1,
                                     self.local_batch))
    timeline = replay.Timeline.from_simulation(sim, num_steps=steps)
    config = replay.ModeConfig(mode, num_workers=n, iota=self.args.staleness_threshold,
                               num_aggregate=self.args.num_aggregate,
                               bsp_aggregate=self.args.bsp_aggregate,
                               hop_bw_backup=self.args.hop_bw_backup)
    t0 = time.perf_counter()
    stats = r.run_day(config, timeline, self.batches(seed, day))
    took = time.perf_counter() - t0
    self.replay_seconds += took
    self.replayed_steps += steps
    ev = self.evaluate(r, eval_day)
    # QPS of the replayed steps: their batches over the simulated time to the last push.
    qps = steps * self.local_batch / float(timeline.push.max())
    record = {"direction": direction, "mode": mode, "seed": seed, "day": day,
              "eval_day": eval_day if self.protocol.next_day else None, "base_mode": base_mode,
              "status": "ok", "eval_auc": ev["auc"], "eval_logloss": ev["logloss"],
              "global_qps": qps, "pushes": stats["pushes"],
              "mean_staleness": stats["mean_staleness"], "max_staleness": stats["max_staleness"],
              "dropped_batches": stats["dropped_batches"],
              "staleness_histogram": [int(x) for x in stats["staleness_histogram"]],
              "global_steps": stats["global_steps"], "replay_seconds": took,
              "process_seconds": took}
    self.records.append(record)
    print(f"  N={n:<5d} {direction + '/' + (mode if direction != 'to_sync' else base_mode):18s} "
          f"seed {seed} day {day} -> {eval_day}: AUC {ev['auc']:.4f}  QPS {qps:,.0f}  "
          f"staleness {stats['mean_staleness']:.2f}/{stats['max_staleness']}  dropped "
          f"{stats['dropped_batches']}  steps {stats['global_steps']}  ({took:.1f} s)",
          flush=True)
    return record

  # ---- the chains of one seed (switching.Runner.seed's order) ------------------------------------
  def seed(self, seed: int, modes: Sequence[str]) -> None:
    p, a = self.protocol, self.args
    bases = {}
    base_modes = ["sync"] + [m for m in modes if m != "sync" and not a.from_sync_only]
    for mode in base_modes:
      r = self.new_replay(seed)
      for day in p.base_days:
        self.day(r, mode, seed, day, day + 1, "base", mode)
      bases[mode] = self.snapshot(r)
    for mode in modes:
      for direction in ("from_sync", "to_sync"):
        if direction == "from_sync" and a.to_sync_only and mode != "sync":
          continue
        if direction == "to_sync" and (a.from_sync_only or mode == "sync"):
          continue
        base = "sync" if direction == "from_sync" else mode
        r = self.new_replay(seed, bases[base])
        run_mode = mode if direction == "from_sync" else "sync"
        for day, eval_day in zip(p.train_days, p.eval_days):
          self.day(r, run_mode, seed, day, eval_day, direction, base)
    # sync -> sync is one chain; it is the "sync" row of both directions.
    for rec in [x for x in self.records if x["direction"] == "from_sync" and
                x["mode"] == "sync" and x["seed"] == seed]:
      self.records.append({**rec, "direction": "to_sync", "base_mode": "sync",
                           "shared_with": "from_sync"})


def day_steps(protocol, mode: str, n: int) -> int:
  """Worker steps of one day: one pass through the data list (Sync: the pass in whole global
  steps), or --steps_per_day in every mode."""
  if not protocol.one_pass_batches:
    return protocol.steps_per_day
  if mode == "sync":
    return n * math.ceil(protocol.one_pass_batches / n)
  return protocol.one_pass_batches


def _data_kwargs(data: str, options: str) -> dict:
  from tf_gba.training.config import TrainConfig  # pylint: disable=g-import-not-at-top
  return TrainConfig(data=data, data_options=options).data_kwargs()


def single_worker_seconds(chains: Chains, seed: int, day: int, steps: int) -> float:
  """The same day trained by one worker in one process (a plain Keras training step per batch)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_gba.training import replay  # pylint: disable=g-import-not-at-top
  r = chains.new_replay(seed)
  variables = r.variables

  @tf.function(reduce_retracing=True)
  def step(features, labels):
    with tf.GradientTape() as tape:
      loss = replay.binary_crossentropy(labels, r.model(features, training=True))
    r.inner.apply_gradients(zip(tape.gradient(loss, variables), variables))

  it = chains.batches(seed, day)
  t0 = time.perf_counter()
  for _ in range(steps):
    step(*next(it))
  return time.perf_counter() - t0


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  p = benchmarks.ArgumentParser(description=__doc__.splitlines()[0], program=PROGRAM)
  p.add_argument("--num_workers", default="8", help="comma-separated cluster sizes")
  p.add_argument("--num_ps", type=int, default=1)
  p.add_argument("--modes", default=",".join(MODES))
  p.add_argument("--stragglers", default="paper",
                 help="paper, none, transient, dedicated, or a profile string")
  p.add_argument("--compute_ms", type=float, default=100.0)
  p.add_argument("--pull_ms", type=float, default=5.0)
  p.add_argument("--push_ms", type=float, default=5.0)
  p.add_argument("--latency_ms", type=float, default=0.5)
  p.add_argument("--local_batch_size", type=int, default=256)
  p.add_argument("--global_batch_size", type=int, default=None,
                 help="keep this global batch across N (local batch G / N)")
  p.add_argument("--staleness_threshold", "--iota", type=int, default=3)
  p.add_argument("--num_aggregate", type=int, default=None, help="GBA's M (default N)")
  p.add_argument("--bsp_aggregate", type=int, default=None, help="b2 (default round(N/5))")
  p.add_argument("--hop_bs_bound", type=int, default=2, help="b1")
  p.add_argument("--hop_bw_backup", type=int, default=None, help="b3 (default round(N/5))")
  p.add_argument("--delay_after_push", action="store_true")
  p.add_argument("--work_ms", type=float, default=10.0)
  p.add_argument("--ps_push_ms", type=float, default=0.0,
                 help="PS service time of one push (gba, async, bsp)")
  p.add_argument("--ps_apply_ms", type=float, default=0.0,
                 help="PS service time of one aggregation + apply")
  p.add_argument("--data", default="synthetic",
                 help="'synthetic', 'movielens100k:<dir>' or 'criteo:<file or dir>'")
  p.add_argument("--data_options", default=None)
  p.add_argument("--model", default="deepfm")
  p.add_argument("--days", type=int, default=4)
  p.add_argument("--steps_per_day", type=int, default=0,
                 help="worker steps a day in every mode, rounded up to whole multiples of 4 N "
                      "(0: one pass over the day's train rows; Sync in whole global steps)")
  p.add_argument("--base_days", type=int, default=1)
  p.add_argument("--seeds", type=int, default=2, help="seeds 0 .. seeds - 1")
  p.add_argument("--learning_rate", type=float, default=0.003)
  direction = p.add_mutually_exclusive_group()
  direction.add_argument("--from_sync_only", action="store_true")
  direction.add_argument("--to_sync_only", action="store_true")
  p.add_argument("--speed", action="store_true",
                 help="also time the first switched day trained by one worker in one process")
  p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_replay"))
  p.add_argument("--dry_run", action="store_true",
                 help="check the flags, print one line and exit without running anything")
  args = p.parse_args(argv)
  args.modes_list = [m.strip() for m in args.modes.split(",") if m.strip()]
  bad = [m for m in args.modes_list if m not in MODES]
  if bad or not args.modes_list:
    p.error(f"--modes: expected some of {MODES}, got {args.modes!r}")
  try:
    args.sizes = [int(x) for x in args.num_workers.split(",")]
  except ValueError:
    p.error(f"--num_workers must be comma-separated integers, got {args.num_workers!r}")
  if args.steps_per_day < 0:
    p.error(f"--steps_per_day must be >= 0, got {args.steps_per_day}")
  if min(args.sizes) < 2 or args.seeds < 1 or args.base_days < 1:
    p.error("need --num_workers >= 2, --seeds >= 1 and --base_days >= 1")
  if args.global_batch_size is None and args.local_batch_size < 1:
    p.error(f"--local_batch_size must be >= 1, got {args.local_batch_size}.")
  for n in args.sizes:
    if args.global_batch_size is not None and args.global_batch_size < n:
      p.error(f"--global_batch_size={args.global_batch_size} is a local batch below 1 at N={n}: "
              f"pass a multiple of every N, at least {max(args.sizes)}.")
    if args.global_batch_size and args.global_batch_size % n:
      p.error(f"--global_batch_size={args.global_batch_size} is not a multiple of N={n}.")
  try:
    _sim_config(args, args.sizes[0], 0, 0, 1, 1)
  except ValueError as e:
    p.error(str(e))
  args.out = os.path.abspath(args.out)
  return args


def make_protocol(args, n: int, local_batch: int):
  """switching's protocol (days, day length, evaluation) for N = n workers."""
  return switching.make_protocol(argparse.Namespace(
      data=args.data, data_options=args.data_options, days=args.days, base_days=args.base_days,
      num_workers=n, local_batch_size=local_batch, steps_per_day=args.steps_per_day,
      input="shared"))


def local_batch_of(args, n: int) -> int:
  return args.global_batch_size // n if args.global_batch_size else args.local_batch_size


def check_protocol(args, protocol, n: int) -> None:
  """Refuses (one line, exit 2) a day too short for N = n workers (switching.short_day), naming
  the --global_batch_size that fixes it."""
  local_batch = local_batch_of(args, n)
  short = switching.short_day(protocol.train_rows, n, local_batch, args.steps_per_day)
  if not short:
    return
  why, largest = short
  multiple = math.lcm(*args.sizes)
  fit = largest // multiple * multiple  # a global batch that every N divides
  if fit:
    every = f"a multiple of {multiple}, " if len(args.sizes) > 1 else ""
    fix = (f"--global_batch_size={fit} or less ({every}local batch {fit // n} at N={n}), or "
           "fewer --num_workers")
  else:
    fix = f"fewer --num_workers or {switching.LONGER_DAYS}"
  benchmarks.refuse(PROGRAM, f"N={n}: {why}; pass {fix}.")


def run_size(args, n: int, protocol) -> dict:
  """Every seed's chains at N = n; the switching benchmark's results dict."""
  started = time.time()
  local_batch = local_batch_of(args, n)
  modes, seeds = args.modes_list, list(range(args.seeds))
  chains = Chains(args, protocol, n, local_batch)
  print(f"replay: N={n}, local batch {local_batch}, {day_steps(protocol, 'gba', n)} worker "
        f"steps a day (sync {day_steps(protocol, 'sync', n)}), modes {modes}, seeds {seeds}",
        flush=True)
  for seed in seeds:
    chains.seed(seed, modes)
  speed = None
  if args.speed:
    day = protocol.train_days[0]
    steps = day_steps(protocol, "gba", n)
    single = single_worker_seconds(chains, 0, day, steps)
    replayed = [r["replay_seconds"] for r in chains.records
                if r["direction"] == "from_sync" and r["day"] == day and r["seed"] == 0]
    speed = {"steps": steps, "single_worker_seconds": single,
             "replay_seconds": {r["mode"]: r["replay_seconds"] for r in chains.records
                                if r["direction"] == "from_sync" and r["day"] == day
                                and r["seed"] == 0},
             "max_ratio": max(replayed) / single if replayed else None}
    print(f"speed N={n}: one worker {single:.1f} s for {steps} steps; replayed "
          + ", ".join(f"{m} {s:.1f} s" for m, s in speed["replay_seconds"].items()), flush=True)
  results = {
      "args": {"data": args.data, "model": args.model, "num_workers": n,
               "local_batch_size": local_batch, "learning_rate": args.learning_rate,
               "staleness_threshold": args.staleness_threshold, "input": "shared (replayed)",
               "straggler_delay": "after_push" if args.delay_after_push else "before_push"},
      "modes": modes, "seeds": seeds, "stragglers": profile_string(args.stragglers),
      "protocol": dataclasses.asdict(protocol),
      "tables": switching.build_tables(chains.records, modes, seeds, protocol),
      "runs": chains.records, "wall_seconds": time.time() - started,
      "replay_seconds": chains.replay_seconds, "replayed_steps": chains.replayed_steps,
      "speed": speed,
  }
  return results


def main(argv: Optional[Sequence[str]] = None) -> Dict[int, dict]:
  args = parse_args(argv)
  # Every N's protocol before anything is replayed: a day too short for one of them is refused.
  protocols = {}
  for n in args.sizes:
    try:
      protocols[n] = make_protocol(args, n, local_batch_of(args, n))
    except ValueError as e:  # a bad data spec or --days: the message says which
      benchmarks.refuse(PROGRAM, str(e))
    check_protocol(args, protocols[n], n)
  if args.dry_run:
    print(f"benchmarks.replay: dry run: flags and days valid ({len(args.sizes)} cluster sizes x "
          f"{len(args.modes_list)} modes); nothing replayed.")
    return {}
  out = {}
  for n in args.sizes:
    try:
      results = run_size(args, n, protocols[n])
    except ValueError as e:  # a fault found while replaying: the message says which
      sys.exit(f"benchmarks.replay: {e}")
    folder = os.path.join(args.out, f"N{n}")
    paths = switching.write(results, folder)
    # switching's tables under this benchmark's own title.
    text = switching.markdown(results).replace("# Switching benchmark",
                                               f"# Switching benchmark, replayed (N = {n})", 1)
    with open(paths[0], "w") as f:
      f.write(text)
    print("\n" + text, flush=True)
    print("Wrote " + ", ".join(paths), flush=True)
    out[n] = results
  with open(os.path.join(args.out, "summary.json"), "w") as f:
    json.dump({str(n): {"tables": r["tables"], "speed": r["speed"],
                        "replay_seconds": r["replay_seconds"],
                        "replayed_steps": r["replayed_steps"]} for n, r in out.items()},
              f, indent=2)
  return out


if __name__ == "__main__":
  main()
