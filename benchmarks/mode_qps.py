"""Global QPS of the training modes on the demo setup, side by side in one run.

  python -m benchmarks.mode_qps [--modes=sync,gba,async,bsp,hop_bs,hop_bw]
                                [--stragglers=transient,dedicated] [--steps=1500] [--repeats=1]
                                [--num_workers=4] [--local_batch_size=256]
                                [--inputs=shared] [--straggler_delay=after_push]
                                [--out=runs/bench_mode_qps]

Each configuration is a fresh run of examples/train.py (DeepFM, synthetic data, 4 workers on
127.0.0.1; 1 PS in the parameter-server modes) in its own process; configurations are
interleaved (all modes of one repeat before the next repeat) so slow drifts of the machine hit
every mode alike. "async_plain" is ParameterServerStrategy's own async training with the bare
optimizer; "async" pushes through GBA buffers with M=1 to measure staleness. QPS is measured
after the first log interval (start-up). `--inputs=shared,sharded` runs every parameter-server
mode with both inputs (the shared data list, static shards) side by side. The ratios are to sync and async of the same profile
(the paper's Table 5.2 shape: GBA about as fast as async, >= 2.4x sync under stragglers).

With a compute floor in the profile (`compute:<ms>`), the table also gives the parameter-server
limit: the sum over workers of local batch / expected step time, the step time being the floor
stretched by the worker's expected slowdown under the profile (factors multiply; a transient
p:f has mean 1 + p (f - 1)). No mode that keeps every worker busy can go faster. "in step" is
the workers' mean share of the measured time spent inside their steps (compute and injected
delay, parameter-server modes): the rest is each step's dispatch, result and input read (a
logging interval's end does not stop the workers, tf_gba/training/pipelining.py). A mode that
never waits reaches about that share of the limit. Under the table, the Sync bound of each such
profile: N x local batch / E[slowest of the N workers' step times], what a synchronous mode
would run if each step waited for its slowest worker and nothing else. Limit / bound is the
smallest ratio to Sync a mode at the limit can show; a larger measured ratio is Sync's own
overhead on this machine.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from typing import Optional

from tf_gba.distribute import stragglers as stragglers_lib
from tf_gba.training import mode_registry

# "dedicated": the transient profile on workers that each take at least 100 ms per step, as if on
# machines of their own (`compute:<ms>` in tf_gba.distribute.stragglers). Without that floor,
# 4 workers + PS on this 2-core machine are bound by the shared cores in every mode: a straggler's
# sleep hands its core to the others, hiding the waiting that separates sync from async.
PROFILES = {"none": "none", "transient": "transient:0.2:4+persistent:2@0",
            "dedicated": "compute:100+transient:0.2:4+persistent:2@0"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _step_factors(profile: str, num_workers: int):
  """The profile's compute floor (s) and, per worker, the distribution of its slowdown factor as
  {factor: probability}: persistent factors multiply every draw, each transient p:f is an
  independent draw (f with probability p, else 1). (None, None) without a floor or for a trace,
  which has no fixed distribution."""
  canonical = stragglers_lib.parse(PROFILES.get(profile, profile))
  floor_s, dists = None, [{1.0: 1.0} for _ in range(num_workers)]

  def times(dist, draw):
    out = {}
    for a, pa in dist.items():
      for b, pb in draw.items():
        out[a * b] = out.get(a * b, 0.0) + pa * pb
    return out

  for part in canonical.split("+"):
    kind, *fields = part.split(";")
    if kind == "compute":
      floor_s = float(fields[0]) / 1000.0
    elif kind == "transient":
      p, f = float(fields[0]), float(fields[1])
      dists = [times(d, {f: p, 1.0: 1.0 - p}) for d in dists]
    elif kind == "persistent":
      for entry in fields[0].split(","):
        w, f = entry.split("=")
        if int(w) < num_workers:
          dists[int(w)] = times(dists[int(w)], {float(f): 1.0})
    elif kind == "trace":
      return None, None
  if floor_s is None:
    return None, None
  return floor_s, dists


def ps_limit_qps(profile: str, num_workers: int, local_batch_size: int) -> Optional[float]:
  """Sum of the workers' expected rates (examples/s) under `profile`; None without a floor.

  From the profile alone: worker w's expected step time is floor x E[slowdown of w], with
  E[slowdown] the product of its persistent factors and of 1 + p (f - 1) for each transient p:f
  (independent draws). A trace profile has no fixed expectation: None.
  """
  floor_s, dists = _step_factors(profile, num_workers)
  if floor_s is None:
    return None
  return sum(local_batch_size / (floor_s * sum(f * p for f, p in d.items())) for d in dists)


def sync_bound_qps(profile: str, num_workers: int, local_batch_size: int) -> Optional[float]:
  """The fastest a synchronous mode can run under `profile` (examples/s); None without a floor.

  Every global step waits for the slowest of the workers' steps, drawn independently, and nothing
  else: N x B / E[max_w floor x slowdown_w]. A real Sync adds its all-reduce and dispatch, so it is
  slower; a mode at the parameter-server limit is therefore at least limit / bound times a Sync.
  """
  floor_s, dists = _step_factors(profile, num_workers)
  if floor_s is None:
    return None
  values = sorted({f for d in dists for f in d})
  expected_max, below = 0.0, 0.0
  for v in values:  # P(max <= v) is the product of the workers' P(factor <= v)
    at_or_below = 1.0
    for d in dists:
      at_or_below *= sum(p for f, p in d.items() if f <= v)
    expected_max += v * (at_or_below - below)
    below = at_or_below
  return num_workers * local_batch_size / (floor_s * expected_max)


def bound_line(profile: str, num_workers: int, local_batch_size: int,
               sync_qps: Optional[float]) -> Optional[str]:
  """Under the table: what the profile allows a mode at the limit against a Sync, and how near
  the measured Sync came to its bound; None for a profile without a floor."""
  limit = ps_limit_qps(profile, num_workers, local_batch_size)
  bound = sync_bound_qps(profile, num_workers, local_batch_size)
  if limit is None:
    return None
  measured = (f"; sync measured {sync_qps:,.0f} = {sync_qps / bound:.2f} of its bound, "
              f"so a mode at the limit is {limit / sync_qps:.2f}x it" if sync_qps else "")
  return (f"{profile}: PS limit {limit:,.0f}, Sync bound {bound:,.0f} examples/s (each step "
          f"waits only for its slowest worker): a mode at the limit is {limit / bound:.2f}x an "
          f"ideal Sync{measured}")


def _in_step(summary: dict) -> Optional[float]:
  """The workers' mean share of the measured time spent inside a step (compute and injected
  delay): the rest is what a mode that never waits loses to per-step dispatch and input reads.
  None where the run does not report it (the collective modes)."""
  shares = [w["in_step_fraction"] for w in summary["per_worker"]
            if w.get("in_step_fraction") is not None]
  return statistics.mean(shares) if shares else None


def flags_for(mode: str, extra) -> list:
  """Of the extra binary flags (`--name=value`, `--noname`), those `mode` reads: a mode-specific
  flag of another mode (`--bsp_aggregate` for sync) would make the binary refuse the run."""
  reads, specific = mode_registry.get(mode).flags, mode_registry.mode_flags()
  out = []
  for arg in extra:
    name = arg.lstrip("-").partition("=")[0]
    if name not in specific and name.startswith("no") and name[2:] in specific:
      name = name[2:]
    if name not in specific or name in reads:
      out.append(arg)
  return out


def binary_flags(mode: str, profile: str, steps: int, model_dir: str, extra, num_workers: int = 4,
                 local_batch_size: int = 256, input_mode: str = "shared") -> list:
  """The flags of examples/train.py for one run of `mode` ("async_plain": the bare optimizer)."""
  binary_mode = "async" if mode.startswith("async") else mode
  # The binary refuses flags a mode does not read: the input only where the mode has one (the
  # extra flags are filtered the same way, `flags_for`).
  flags = [f"--mode={binary_mode}"] + ([f"--input={input_mode}"] if mode_registry.reads_input(binary_mode)
                                       else []) + [
           f"--stragglers={PROFILES.get(profile, profile)}", f"--steps={steps}",
           "--log_every=250", f"--model_dir={model_dir}", "--num_ps=1",
           f"--num_workers={num_workers}", f"--local_batch_size={local_batch_size}",
           "--eval_examples=4096"]
  if mode == "async_plain":
    flags.append("--noasync_staleness_stats")
  return flags + flags_for(binary_mode, extra)


def run_one(mode: str, profile: str, steps: int, model_dir: str, extra, num_workers: int = 4,
            local_batch_size: int = 256, input_mode: str = "shared") -> dict:
  flags = binary_flags(mode, profile, steps, model_dir, extra, num_workers, local_batch_size,
                       input_mode)
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train.py"), *flags],
                        cwd=ROOT, capture_output=True, text=True, timeout=1200)
  if proc.returncode != 0:
    raise RuntimeError(f"{mode}/{profile} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
  with open(os.path.join(model_dir, "summary.json")) as f:
    return json.load(f)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--modes", default=",".join(mode_registry.names(compared=True)))
  p.add_argument("--stragglers", default="transient,dedicated",
                 help=f"comma-separated; names {sorted(PROFILES)} or a profile string")
  p.add_argument("--steps", type=int, default=1500)
  p.add_argument("--repeats", type=int, default=1)
  p.add_argument("--num_workers", type=int, default=4)
  p.add_argument("--local_batch_size", type=int, default=256)
  p.add_argument("--inputs", default="shared",
                 help="comma-separated inputs of the parameter-server modes: shared, sharded")
  p.add_argument("--straggler_delay", default="after_push", choices=["after_push", "before_push"],
                 help="parameter-server modes: where a straggler sleeps (before_push: a slow "
                      "machine's gradients arrive late and stale)")
  p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_mode_qps"))
  p.add_argument("--dry_run", action="store_true",
                 help="print the examples/train.py command of every run (check each with its "
                      "own --dry_run) and exit without running anything")
  args, extra = p.parse_known_args(argv)
  stray = [a for a in extra if not a.startswith("-")]
  if stray:
    p.error(f"unrecognized arguments: {' '.join(stray)} (the binary's flags, passed on, are "
            "--name=value)")
  for m in args.modes.split(","):
    if m != "async_plain":
      try:
        mode_registry.get(m)
      except ValueError as e:
        p.error(f"--modes: {e}")
  # Passed on like any extra flag: flags_for gives it to the modes that read it.
  extra = [*extra, f"--straggler_delay={args.straggler_delay}"]
  inputs = args.inputs.split(",")
  # A mode per input ("gba/sharded") when several inputs are compared; sync has its own input.
  def has_input(m):
    return mode_registry.reads_input("async" if m.startswith("async") else m)
  modes = [m if len(inputs) == 1 or not has_input(m) else f"{m}/{i}"
           for m in args.modes.split(",") for i in (inputs if has_input(m) else inputs[:1])]
  profiles = args.stragglers.split(",")
  if args.dry_run:
    for profile in profiles:
      for mode in modes:
        name, _, input_mode = mode.partition("/")
        print(shlex.join(["examples/train.py", *binary_flags(
            name, profile, args.steps, os.path.join(args.out, "dry_run"), extra,
            args.num_workers, args.local_batch_size, input_mode or inputs[0])]))
    return []
  results = {(m, s): [] for s in profiles for m in modes}
  for rep in range(args.repeats):
    for profile in profiles:
      for mode in modes:
        name, _, input_mode = mode.partition("/")
        model_dir = os.path.join(args.out, f"{mode.replace('/', '_')}_"
                                 f"{profile.replace(':', '_')}_{rep}")
        subprocess.run(["rm", "-rf", model_dir], check=True)
        summary = run_one(name, profile, args.steps, model_dir, extra, args.num_workers,
                          args.local_batch_size, input_mode or inputs[0])
        results[(mode, profile)].append(summary)
        print(f"  {mode:12s} {profile:10s} rep {rep}: QPS {summary['global_qps']:,.0f}  "
              f"AUC {summary['eval_auc']:.4f}  staleness {summary['mean_staleness']:.2f}",
              flush=True)
  table = []
  load = os.getloadavg()
  print(f"\n{args.num_workers} workers, local batch {args.local_batch_size}, straggler delay "
        f"{args.straggler_delay}; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")
  print("\n| stragglers | mode | global QPS (mean over repeats) | PS limit | vs limit | vs sync | "
        "vs async | vs gba | per-worker QPS | in step | mean / max staleness | dropped batches | "
        "blocked s (hop_bs, hop_bw) | eval AUC |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

  def mean_qps(mode, profile):
    runs = results.get((mode, profile))
    return statistics.mean(s["global_qps"] for s in runs) if runs else None

  for profile in profiles:
    sync = mean_qps("sync", profile)
    async_ = mean_qps("async", profile) or mean_qps(f"async/{inputs[0]}", profile)
    gba = mean_qps("gba", profile) or mean_qps(f"gba/{inputs[0]}", profile)
    limit = ps_limit_qps(profile, args.num_workers, args.local_batch_size)
    bound = sync_bound_qps(profile, args.num_workers, args.local_batch_size)
    for mode in modes:
      runs = results[(mode, profile)]
      qps = statistics.mean(s["global_qps"] for s in runs)
      last = runs[-1]
      row = {"stragglers": profile, "mode": mode, "global_qps": qps,
             "global_qps_runs": [s["global_qps"] for s in runs],
             "per_worker_qps": [w["qps"] for w in last["per_worker"]],
             "in_step_fraction": _in_step(last),
             "mean_staleness": last["mean_staleness"], "max_staleness": last["max_staleness"],
             "dropped_batches": last["dropped_batches"],
             "blocked_seconds": last.get("blocked_seconds", 0.0),
             "eval_auc": last["eval_auc"],
             "vs_sync": qps / sync if sync else None, "vs_async": qps / async_ if async_ else None,
             "vs_gba": qps / gba if gba else None, "ps_limit_qps": limit,
             "vs_limit": qps / limit if limit else None, "sync_bound_qps": bound,
             "num_workers": args.num_workers,
             "load_average": list(load)}
      table.append(row)
      ratio = lambda r: f"{r:.2f}" if r else "-"  # pylint: disable=unnecessary-lambda-assignment
      print(f"| {profile} | {mode} | {qps:,.0f} | {f'{limit:,.0f}' if limit else '-'} | "
            f"{ratio(row['vs_limit'])} | {ratio(row['vs_sync'])} | "
            f"{ratio(row['vs_async'])} | {ratio(row['vs_gba'])} | "
            f"{' '.join('?' if q is None else f'{q:,.0f}' for q in row['per_worker_qps'])} | "
            f"{ratio(row['in_step_fraction'])} | "
            f"{row['mean_staleness']:.2f} / {row['max_staleness']} | {row['dropped_batches']} | "
            f"{row['blocked_seconds']:.1f} | {row['eval_auc']:.4f} |")
  for profile in profiles:
    line = bound_line(profile, args.num_workers, args.local_batch_size, mean_qps("sync", profile))
    if line:
      print(line)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(table, f, indent=2)
  return table


if __name__ == "__main__":
  main()
