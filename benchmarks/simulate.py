"""The cluster simulator over modes and cluster sizes: QPS, staleness, drops, idle time.

  python -m benchmarks.simulate [--num_workers=8,16,...,1024] [--num_ps=1] [--steps=1000]
                                [--modes=sync,async,gba,bsp,hop_bs,hop_bw] [--stragglers=paper]
                                [--compute_ms=100] [--pull_ms=5] [--push_ms=5] [--latency_ms=0.5]
                                [--ps_push_ms=0] [--ps_apply_ms=0] [--ps_ms_per_closure=0]
                                [--ps_cores=1]
                                [--coord_ms_per_closure=0] [--coord_ms_per_step=0]
                                [--steps_per_execution=1]
                                [--plots=docs/img] [--out=runs/bench_simulate]

`--stragglers` takes the names of benchmarks/mode_qps.py's profiles (none, transient, dedicated),
"paper" (below), or any profile string of tf_gba.distribute.stragglers. `--steps` counts global
batches of the synchronous size N x B: every mode runs until steps x N worker steps are pushed.
See tf_gba/simulate/cluster.py for the model and docs/simulator.md for results.
"""

import argparse
import json
import os
import time

from benchmarks.mode_qps import PROFILES
from tf_gba.simulate import MODES, SimConfig, simulate

# A busy shared cluster: every worker step is 4x slower with probability 0.1, on workers that take
# 100 ms per step on a machine of their own. With N in the hundreds nearly every synchronous step
# waits for some slow worker (1 - 0.9**N ~ 1), while a free-running worker is slowed by
# 1 + 0.1 x 3 = 1.3 on average.
PAPER_PROFILE = "compute:100+transient:0.1:4"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def profile_string(name: str) -> str:
  if name == "paper":
    return PAPER_PROFILE
  return PROFILES.get(name, name)


def _plot(rows, modes, profile, out_dir):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  sizes = sorted({r["num_workers"] for r in rows})
  figures = [("sim_qps.png", "global QPS / N (batches x B per s per worker)",
              lambda r: r["global_qps"] / r["num_workers"], False),
             ("sim_staleness.png", "mean dense staleness", lambda r: r["mean_staleness"], True),
             ("sim_drops.png", "dropped batches (% of pushes)",
              lambda r: 100.0 * r["dropped_batches"] / max(1, r["pushes"]), False),
             ("sim_idle.png", "worker idle time (% of N x run time)",
              lambda r: 100.0 * r["idle_fraction"], False)]
  os.makedirs(out_dir, exist_ok=True)
  paths = []
  styles = ["-", "--", ":", "-.", "-", "--"]  # async, GBA and BSP share QPS: keep all visible
  for name, label, value, log in figures:
    fig, ax = plt.subplots(figsize=(4.2, 3.0), dpi=90)
    for i, mode in enumerate(modes):
      pts = [(r["num_workers"], value(r)) for r in rows if r["mode"] == mode]
      pts.sort()
      ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=mode,
              linestyle=styles[i % len(styles)], linewidth=2.2 - 0.3 * i)
    ax.set_xscale("log", base=2)
    if log:
      ax.set_yscale("symlog", linthresh=1.0)
      ax.set_ylim(bottom=0)
    ticks = [s for s in sizes if s & (s - 1) == 0] or sizes  # powers of two: labels stay apart
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(s) for s in ticks], fontsize=7)
    ax.set_xlabel("workers N")
    ax.set_ylabel(label, fontsize=8)
    ax.set_title(profile, fontsize=7)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path)
    plt.close(fig)
    paths.append(path)
  return paths


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--num_workers", default="8,16,32,64,128,256,512,1024",
                 help="comma-separated cluster sizes")
  p.add_argument("--num_ps", type=int, default=1)
  p.add_argument("--steps", type=int, default=1000)
  p.add_argument("--modes", default=",".join(MODES))
  p.add_argument("--stragglers", default="paper",
                 help="paper, none, transient, dedicated, or a profile string")
  p.add_argument("--compute_ms", type=float, default=100.0)
  p.add_argument("--pull_ms", type=float, default=5.0)
  p.add_argument("--push_ms", type=float, default=5.0)
  p.add_argument("--latency_ms", type=float, default=0.5)
  p.add_argument("--local_batch_size", type=int, default=256)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--iota", type=int, default=3)
  p.add_argument("--num_aggregate", type=int, default=None, help="GBA's M (default N)")
  p.add_argument("--bsp_aggregate", type=int, default=None, help="b2 (default round(N/5))")
  p.add_argument("--hop_bs_bound", type=int, default=2, help="b1")
  p.add_argument("--hop_bw_backup", type=int, default=None, help="b3 (default round(N/5))")
  p.add_argument("--delay_after_push", action="store_true",
                 help="slowdowns after the push, as the project's injected stragglers (GBA>StepEnd)")
  p.add_argument("--work_ms", type=float, default=10.0,
                 help="with --delay_after_push: the real work before the push")
  p.add_argument("--ps_push_ms", type=float, default=0.0,
                 help="PS service time of one push, whole model (gba, async, bsp; "
                      "benchmarks/ps_service.py measures it); 0: the PS's work is not modelled")
  p.add_argument("--ps_apply_ms", type=float, default=0.0,
                 help="PS service time of one aggregation + apply, whole model")
  p.add_argument("--ps_ms_per_closure", type=float, default=0.0,
                 help="PS CPU per scheduled closure beside its pushes, whole model")
  p.add_argument("--ps_cores", type=int, default=1,
                 help="cores of each PS: its pushes are served by that many cores in arrival order")
  p.add_argument("--coord_ms_per_closure", type=float, default=0.0,
                 help="the coordinator's CPU per scheduled closure of --steps_per_execution worker "
                      "steps (one process, one core; gba, async, bsp); 0: not modelled")
  p.add_argument("--coord_ms_per_step", type=float, default=0.0,
                 help="the coordinator's CPU per worker step besides (progress lines)")
  p.add_argument("--steps_per_execution", type=int, default=1,
                 help="k: worker steps per scheduled closure")
  p.add_argument("--plots", default=None, help="folder for the PNG plots vs N (none if unset)")
  p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_simulate"))
  p.add_argument("--dry_run", action="store_true",
                 help="check the flags, print one line and exit without running anything")
  args = p.parse_args(argv)
  modes = args.modes.split(",")
  for m in modes:
    if m not in MODES:
      p.error(f"--modes: {m!r} is not one of {MODES}")
  try:
    sizes = [int(x) for x in args.num_workers.split(",")]
  except ValueError:
    p.error(f"--num_workers must be comma-separated integers, got {args.num_workers!r}")
  profile = profile_string(args.stragglers)
  configs = {}
  for n in sizes:
    try:
      configs[n] = SimConfig(num_workers=n, num_ps=args.num_ps, steps=args.steps,
                             compute_ms=args.compute_ms, pull_ms=args.pull_ms,
                             push_ms=args.push_ms, latency_ms=args.latency_ms,
                             stragglers=profile, seed=args.seed,
                             local_batch_size=args.local_batch_size, iota=args.iota,
                             gba_num_aggregate=args.num_aggregate,
                             bsp_aggregate=args.bsp_aggregate, hop_bs_bound=args.hop_bs_bound,
                             hop_bw_backup=args.hop_bw_backup,
                             delay_after_push=args.delay_after_push, work_ms=args.work_ms,
                             ps_push_ms=args.ps_push_ms, ps_apply_ms=args.ps_apply_ms,
                             ps_ms_per_closure=args.ps_ms_per_closure,
                             ps_cores=args.ps_cores,
                             coord_ms_per_closure=args.coord_ms_per_closure,
                             coord_ms_per_step=args.coord_ms_per_step,
                             steps_per_execution=args.steps_per_execution)
    except ValueError as e:
      p.error(str(e))
  if args.dry_run:
    print(f"benchmarks.simulate: dry run: flags valid ({len(sizes)} cluster sizes x {len(modes)} "
          "modes); nothing simulated.")
    return []
  rows = []
  print(f"profile {profile}; compute {args.compute_ms} ms, pull {args.pull_ms} ms, push "
        f"{args.push_ms} ms (/ {args.num_ps} PS), latency {args.latency_ms} ms; "
        f"{args.steps} global batches of N x {args.local_batch_size}")
  costs = configs[sizes[0]].queued
  if costs:
    print(f"PS: {args.ps_push_ms} ms per push + {args.ps_apply_ms} ms per aggregation (whole "
          f"model) + {args.ps_ms_per_closure} ms per closure, {args.num_ps} PS x "
          f"{args.ps_cores} cores; coordinator: "
          f"{args.coord_ms_per_closure} ms per closure of {args.steps_per_execution} steps + "
          f"{args.coord_ms_per_step} ms per step")
  print("| N | mode | global QPS | vs sync | effective QPS | global steps | mean / max staleness "
        "| staleness histogram 0,1,2,3,4,5+ | dropped | idle | blocked s | simulated in |"
        + (" coordinator ms / step | PS ms / step | coordinator busy | each PS busy |"
           if costs else ""))
  print("|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|---|" if costs else ""))
  for n in sizes:
    config = configs[n]
    sync_qps = None
    for mode in modes:
      t0 = time.perf_counter()
      r = simulate(mode, config)
      took = time.perf_counter() - t0
      row = r.as_dict()
      row.update(stragglers=profile, runtime_seconds=took)
      if mode == "sync":
        sync_qps = r.global_qps
      row["vs_sync"] = r.global_qps / sync_qps if sync_qps else None
      rows.append(row)
      h = r.staleness_histogram
      hist = ",".join(str(x) for x in h[:5]) + f",{sum(h[5:])}"
      vs = f"{row['vs_sync']:.2f}" if row["vs_sync"] else "-"
      print(f"| {n} | {mode} | {r.global_qps:,.0f} | {vs} | {r.effective_qps:,.0f} | "
            f"{r.global_steps:,} | {r.mean_staleness:.2f} / {r.max_staleness} | {hist} | "
            f"{r.dropped_batches:,} ({100.0 * r.dropped_batches / r.pushes:.1f}%) | "
            f"{100 * r.idle_fraction:.1f}% | {r.blocked_seconds:,.0f} | {took:.1f} s |"
            + (f" {r.coordinator_ms_per_step:.3f} | {r.ps_ms_per_step:.3f} | "
               f"{100 * r.coordinator_utilisation:.1f}% | {100 * r.ps_utilisation:.1f}% |"
               if costs else ""), flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(rows, f, indent=2)
  if args.plots and len(sizes) > 1:
    for path in _plot(rows, modes, profile, args.plots):
      print(f"plot: {path}")
  return rows


if __name__ == "__main__":
  main()
