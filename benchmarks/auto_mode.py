"""--mode=auto against pure Sync and pure GBA on a straggler trace whose middle third is slow.

  python -m benchmarks.auto_mode [--seeds=1] [--window_s=60] [--factor=4] [--slow_workers=0,1]
                                 [--steps=auto] [--num_workers=4] [--local_batch_size=256]
                                 [--compute_ms=100] [--log_every=40] [--modes=sync,gba,auto]
                                 [--out=runs/bench_auto] [--plot=docs/img/auto_timeline.png]

The trace (`tf_gba.distribute.stragglers`, `trace:` profile) slows `--slow_workers` by
`--factor` in its second window of `--window_s` seconds of each worker's clock, and not before or
after; the clock is the worker's training time, and it goes on across auto's switches (each
checkpoint carries it). Every worker takes at least `--compute_ms` per step (`compute:<ms>`), as
on a machine of its own. `--steps` defaults to what pure Sync trains in three windows: the
stragglers cover about the middle third of its run.

Each mode is a fresh run of examples/train.py in its own process (DeepFM, synthetic data, static
shards, 1 PS for GBA); the time compared is the whole command's, start-up, switches and final
evaluation included. Per seed (the model's and the input's seed) the three modes run one after
the other. Printed: a table per run, the acceptance lines (auto within 1.05x of the faster pure
mode, exactly two switches, AUC >= Sync's - 0.001), and the auto run's timeline as a plot.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from tf_gba.training import mode_registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_steps(window_s: float, factor: float, num_workers: int, compute_ms: float) -> int:
  """Worker steps pure Sync trains in three windows, the middle one at the slow pace."""
  fast = num_workers / (compute_ms / 1000.0)  # worker steps per second, all at the floor
  steps = window_s * fast * (2.0 + 1.0 / factor)
  return int(round(steps / (num_workers * 10))) * num_workers * 10


def run_one(mode: str, seed: int, args, trace: str, model_dir: str) -> dict:
  # Static shards where a mode has a choice (auto's own stays read static shards).
  input_flag = (["--input=sharded"] if mode_registry.reads_input(mode) else [])
  flags = [f"--mode={mode}", "--model=deepfm", "--data=synthetic", *input_flag,
           f"--stragglers=compute:{args.compute_ms:g}+trace:{trace}", f"--steps={args.steps}",
           f"--log_every={args.log_every}", f"--model_dir={model_dir}", "--num_ps=1",
           f"--num_workers={args.num_workers}", f"--local_batch_size={args.local_batch_size}",
           f"--seed={seed}", f"--straggler_seed={seed}", "--eval_examples=20000"]
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train.py"), *flags],
                        cwd=ROOT, capture_output=True, text=True, timeout=3600)
  seconds = time.perf_counter() - t0
  with open(os.path.join(model_dir, "stdout.txt"), "w") as f:
    f.write(proc.stdout)
  if proc.returncode != 0:
    raise RuntimeError(f"{mode} seed {seed} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
  with open(os.path.join(model_dir, "summary.json")) as f:
    summary = json.load(f)
  summary["command_seconds"] = seconds
  return summary


def plot_timeline(summary: dict, path: str, window_s: float) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(9, 3.6))
  colors = {"sync": "tab:blue", "gba": "tab:orange"}
  for stay in summary["stays"]:
    ax.axvspan(stay["start_seconds"], stay["start_seconds"] + stay["seconds"],
               color=colors[stay["mode"]], alpha=0.12, lw=0)
  for mode in ("sync", "gba"):
    pts = [p for p in summary["timeline"] if p["mode"] == mode]
    ax.scatter([p["seconds"] for p in pts], [p["qps"] for p in pts], s=10, color=colors[mode],
               label=f"{mode} (shaded: the process set of the stay in {mode})")
  top = max(p["qps"] for p in summary["timeline"]) * 1.1
  ax.set_ylim(0, top * 1.12)
  for sw in summary["switches"]:
    decided = sw.get("decided_at_seconds") or sw["at_seconds"]
    ax.axvline(decided, color="k", lw=0.8, ls="--")
    ax.annotate(f"{sw['from']}->{sw['to']} decided\ngain {sw['predicted_gain']:.2f}",
                (decided, top * 1.1), fontsize=8, ha="right", va="top")
  ax.set_xlabel("seconds since the job started (switches included)")
  ax.set_ylabel("QPS over the last interval")
  ax.set_title(f"--mode=auto on a trace: stragglers in the worker-clock window "
               f"[{window_s:g}, {2 * window_s:g}) s", fontsize=10)
  ax.legend(loc="lower right", fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seeds", type=int, default=1)
  p.add_argument("--window_s", type=float, default=60.0)
  p.add_argument("--factor", type=float, default=4.0)
  p.add_argument("--slow_workers", default="0,1")
  p.add_argument("--steps", type=int, default=None)
  p.add_argument("--num_workers", type=int, default=4)
  p.add_argument("--local_batch_size", type=int, default=256)
  p.add_argument("--compute_ms", type=float, default=100.0)
  p.add_argument("--log_every", type=int, default=40)
  p.add_argument("--modes", default="sync,gba,auto")
  p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_auto"))
  p.add_argument("--plot", default=os.path.join(ROOT, "docs", "img", "auto_timeline.png"))
  p.add_argument("--replot", default=None,
                 help="only draw the timeline of this auto run's summary.json")
  p.add_argument("--dry_run", action="store_true",
                 help="check the flags, print one line and exit without running anything")
  args = p.parse_args(argv)
  for mode in args.modes.split(","):
    try:
      mode_registry.get(mode)
    except ValueError as e:
      p.error(f"--modes: {e}")
  if not all(w.strip().isdigit() for w in args.slow_workers.split(",")):
    p.error(f"--slow_workers takes comma-separated worker indices, got {args.slow_workers!r}")
  if args.dry_run:
    print(f"benchmarks.auto_mode: dry run: flags valid (modes {args.modes}, {args.seeds} seeds); "
          "nothing run.")
    return None
  if args.replot:
    with open(args.replot) as f:
      plot_timeline(json.load(f), args.plot, args.window_s)
    return None
  if args.steps is None:
    args.steps = default_steps(args.window_s, args.factor, args.num_workers, args.compute_ms)
  os.makedirs(args.out, exist_ok=True)
  trace = os.path.join(args.out, "trace.json")
  with open(trace, "w") as f:
    json.dump({"window_seconds": args.window_s,
               "workers": {w: [1, args.factor, 1] for w in args.slow_workers.split(",")}}, f)
  rows = []
  for seed in range(args.seeds):
    runs = {}
    for mode in args.modes.split(","):
      model_dir = os.path.join(args.out, f"{mode}_{seed}")
      subprocess.run(["rm", "-rf", model_dir], check=True)
      s = run_one(mode, seed, args, trace, model_dir)
      runs[mode] = s
      print(f"  seed {seed} {mode:5s}: {s['command_seconds']:.1f} s (training "
            f"{s.get('train_seconds', s['wall_seconds']):.1f} s)  AUC {s['eval_auc']:.4f}"
            + (f"  switches {s['num_switches']} at steps "
               f"{[sw['at_step'] for sw in s['switches']]}" if mode == "auto" else ""),
            flush=True)
    row = {"seed": seed, "steps": args.steps}
    for mode, s in runs.items():
      row[mode] = {"command_seconds": s["command_seconds"],
                   "train_seconds": s.get("train_seconds", s["wall_seconds"]),
                   "eval_auc": s["eval_auc"], "global_qps": s["global_qps"],
                   "num_switches": s.get("num_switches"), "switches": s.get("switches")}
    if {"sync", "gba", "auto"} <= set(runs):
      best = min(runs["sync"]["command_seconds"], runs["gba"]["command_seconds"])
      row["auto_vs_best"] = runs["auto"]["command_seconds"] / best
      row["auto_auc_minus_sync"] = runs["auto"]["eval_auc"] - runs["sync"]["eval_auc"]
      row["accepted"] = (row["auto_vs_best"] <= 1.05 and runs["auto"]["num_switches"] == 2 and
                         row["auto_auc_minus_sync"] >= -0.001)
    if "auto" in runs and seed == 0 and args.plot:
      plot_timeline(runs["auto"], args.plot, args.window_s)
    rows.append(row)
  load = os.getloadavg()
  print(f"\n{args.num_workers} workers x {args.local_batch_size}, {args.steps} worker steps, "
        f"compute floor {args.compute_ms:g} ms, workers {args.slow_workers} {args.factor:g}x "
        f"slower in [{args.window_s:g}, {2 * args.window_s:g}) s; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end\n")
  print("| seed | mode | command s | training s | eval AUC | switches (at worker step) |")
  print("|---|---|---|---|---|---|")
  for row in rows:
    for mode in args.modes.split(","):
      r = row[mode]
      sw = (f"{r['num_switches']} ({', '.join(str(x['at_step']) for x in r['switches'])})"
            if r["num_switches"] is not None else "-")
      print(f"| {row['seed']} | {mode} | {r['command_seconds']:.1f} | {r['train_seconds']:.1f} | "
            f"{r['eval_auc']:.4f} | {sw} |")
  for row in rows:
    if "auto_vs_best" in row:
      print(f"seed {row['seed']}: auto / best pure = {row['auto_vs_best']:.3f} (<= 1.05), "
            f"switches {row['auto']['num_switches']} (== 2), AUC - sync = "
            f"{row['auto_auc_minus_sync']:+.4f} (>= -0.001): "
            f"{'met' if row['accepted'] else 'NOT met'}")
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(rows, f, indent=2)
  return rows


if __name__ == "__main__":
  main()
