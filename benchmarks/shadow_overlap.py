"""Does a slow sync slow training down? ShadowSync's step rate with and without a sync delay.

  python -m benchmarks.shadow_overlap [--modes=shadow_easgd,shadow_ma,shadow_bmuf]
                                      [--delays_ms=0,500] [--num_workers=4] [--steps=400]
                                      [--stragglers=compute:50] [--repeats=1]
                                      [--out=runs/bench_shadow_overlap]

Each configuration is a fresh examples/train.py run (DeepFM, synthetic data, static shards,
1 PS). `--shadow_sync_delay_ms` holds every sync in flight that much longer (between reading
the replicas and writing them back); training never waits for a sync, so the step rate should
stay within noise of the undelayed run (the acceptance line: at most 10% lower), while the sync
gap (steps between two syncs of a worker) grows. The compute floor makes each worker's step
take at least that long, as on machines of their own (see benchmarks/mode_qps.py).
"""

import argparse
import json
import os
import shlex
import shutil
import statistics

from benchmarks.mode_qps import binary_flags
from benchmarks.mode_qps import run_one

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--modes", default="shadow_easgd,shadow_ma,shadow_bmuf")
  p.add_argument("--delays_ms", default="0,500")
  p.add_argument("--num_workers", type=int, default=4)
  p.add_argument("--steps", type=int, default=400)
  p.add_argument("--local_batch_size", type=int, default=256)
  p.add_argument("--stragglers", default="compute:50")
  p.add_argument("--repeats", type=int, default=1)
  p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_shadow_overlap"))
  p.add_argument("--dry_run", action="store_true",
                 help="check the flags, print one line and exit without running anything")
  args, extra = p.parse_known_args(argv)
  stray = [a for a in extra if not a.startswith("-")]
  if stray:
    p.error(f"unrecognized arguments: {' '.join(stray)} (the binary's flags, passed on, are "
            "--name=value)")
  try:
    delays = [float(d) for d in args.delays_ms.split(",")]
  except ValueError:
    p.error(f"--delays_ms takes comma-separated numbers, got {args.delays_ms!r}")
  if args.dry_run:
    # The runs are the binary's: each planned command line, to check with its own --dry_run.
    for mode in args.modes.split(","):
      for delay in delays:
        print(shlex.join(["examples/train.py", *binary_flags(
            mode, args.stragglers, args.steps, os.path.join(args.out, "dry_run"),
            [f"--shadow_sync_delay_ms={delay}", *extra], args.num_workers,
            args.local_batch_size, "sharded")]))
    return None
  rows = {}
  for rep in range(args.repeats):
    for mode in args.modes.split(","):
      for delay in delays:
        model_dir = os.path.join(args.out, f"{mode}_{int(delay)}ms_{rep}")
        shutil.rmtree(model_dir, ignore_errors=True)
        s = run_one(mode, args.stragglers, args.steps, model_dir,
                    [f"--shadow_sync_delay_ms={delay}", *extra],
                    args.num_workers, args.local_batch_size, "sharded")
        rows.setdefault((mode, delay), []).append(s)
        print(f"  {mode} delay {delay:.0f} ms rep {rep}: QPS {s['global_qps']:,.0f}, "
              f"mean sync gap {s['sync']['mean_sync_gap']}, "
              f"sync {s['sync']['mean_sync_seconds']:.3f} s", flush=True)
  load = os.getloadavg()
  print(f"\n{args.num_workers} workers, stragglers {args.stragglers}, {args.steps} worker steps; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end\n")
  print("| mode | sync delay | global QPS | vs no delay | mean sync s | mean sync gap (steps) "
        "| p10 / p50 / p90 gap | steps during a sync |")
  print("|---|---|---|---|---|---|---|---|")
  table = []
  for (mode, delay), runs in rows.items():
    qps = statistics.mean(r["global_qps"] for r in runs)
    base = statistics.mean(r["global_qps"] for r in rows[(mode, delays[0])])
    sync = runs[-1]["sync"]
    pct = sync.get("sync_gap_percentiles", {})
    table.append({"mode": mode, "delay_ms": delay, "global_qps": qps, "vs_no_delay": qps / base,
                  "sync": sync, "load_average": list(load)})
    print(f"| {mode} | {delay:.0f} ms | {qps:,.0f} | {qps / base:.3f} | "
          f"{sync['mean_sync_seconds']:.3f} | {sync['mean_sync_gap']:.1f} | "
          f"{pct.get('p10', 0):.0f} / {pct.get('p50', 0):.0f} / {pct.get('p90', 0):.0f} | "
          f"{sync['mean_steps_during_sync']:.1f} |")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(table, f, indent=2)
  return table


if __name__ == "__main__":
  main()
