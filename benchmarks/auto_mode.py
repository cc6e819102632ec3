"""--mode=auto against pure Sync and pure GBA on a straggler trace whose middle third is slow.

  python -m benchmarks.auto_mode [--seeds=1] [--window_s=60] [--factor=4] [--slow_workers=0,1]
                                 [--steps=auto] [--num_workers=4] [--local_batch_size=256]
                                 [--compute_ms=100] [--log_every=40] [--modes=sync,gba,auto]
                                 [--out=runs/bench_auto] [--plot=docs/img/auto_timeline.png]
                                 [--first_seed=0] [--report_only]

The trace (`tf_gba.distribute.stragglers`, `trace:` profile) slows `--slow_workers` by
`--factor` in its second window of `--window_s` seconds of each worker's clock, and not before or
after; the clock is the worker's training time, and it goes on across auto's switches (each
checkpoint carries it). Every worker takes at least `--compute_ms` per step (`compute:<ms>`), as
on a machine of its own. `--steps` defaults to what pure Sync trains in three windows: the
stragglers cover about the middle third of its run.

`--compute_ms=0`: no floor (the workers' real step times, where a quiet Sync is the faster mode
on this machine); `--steps` must then be given, as there is no floor to derive it from.

Each mode is a fresh run of examples/train.py in its own process (DeepFM, synthetic data, static
shards, 1 PS for GBA); the time compared is the whole command's, start-up, switches and final
evaluation included. Per seed (the model's and the input's seed) the three modes run one after
the other. Printed: a table per run, the acceptance lines (auto within 1.10x of the faster pure
mode in every seed, its switches and where they fell on the training clock, AUC >= Sync's - 0.001
over the seeds' mean), the simulator's time for each mode given what the auto run measured (its
efficiencies, its mean switch cost, its workers' quiet step times) against the real, and the auto
run's timeline as a plot.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from tf_gba.simulate import auto as auto_sim
from tf_gba.simulate.cluster import predicted_qps
from tf_gba.training import mode_registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_steps(window_s: float, factor: float, num_workers: int, compute_ms: float) -> int:
  """Worker steps pure Sync trains in three windows, the middle one at the slow pace."""
  fast = num_workers / (compute_ms / 1000.0)  # worker steps per second, all at the floor
  steps = window_s * fast * (2.0 + 1.0 / factor)
  return int(round(steps / (num_workers * 10))) * num_workers * 10


def trace_step_seconds(base_seconds, slow_workers, factor: float, window_s: float,
                       interval_s: float, intervals: int) -> np.ndarray:
  """[intervals, N]: each worker's own step time in each interval of the training clock, as the
  trace makes it: `base_seconds` (per worker), times `factor` for `slow_workers` while the
  interval's middle lies in the second window [window_s, 2 window_s)."""
  base = np.asarray(base_seconds, np.float64)
  mid = (np.arange(intervals) + 0.5) * interval_s
  slow = (mid >= window_s) & (mid < 2 * window_s)
  times = np.tile(base, (intervals, 1))
  for w in slow_workers:
    times[slow, w] *= factor
  return times


def simulated_seconds(step_seconds, interval_s: float, local_batch_size: int, target: float,
                      efficiency, modes, decisions=(), switch_cost_s: float = 0.0,
                      overhead_s=None) -> float:
  """Seconds to train `target` examples: interval i trains in modes[i] at its model QPS (from
  `step_seconds`, [intervals, N], or that mode's own, {mode: [intervals, N]}) times the mode's
  efficiency, or with `overhead_s` ({mode: seconds}) at the model on its step times stretched by
  the mode's overhead (`tf_gba.simulate.auto.stretched_qps`); the last interval counted in
  part; each decision adds the switch's cost after its interval. Raises if the intervals end
  before the target."""
  return _run_to(step_seconds, interval_s, local_batch_size, target, efficiency, modes,
                 decisions, switch_cost_s, overhead_s)[0]


def _run_to(step_seconds, interval_s, local_batch_size, target, efficiency, modes, decisions,
            switch_cost_s, overhead_s=None):
  """(seconds, the interval in which the target is reached)."""
  after = {d["interval"] for d in decisions}
  seconds = examples = 0.0
  for i, mode in enumerate(modes):
    times = step_seconds[mode][i] if isinstance(step_seconds, dict) else step_seconds[i]
    if overhead_s is None:
      qps = predicted_qps(times, local_batch_size)[f"{mode}_qps"] * efficiency[mode]
    else:
      qps = auto_sim.stretched_qps(times, local_batch_size, mode, overhead_s[mode])
    if examples + qps * interval_s >= target:
      return seconds + (target - examples) / qps, i
    seconds += interval_s + (switch_cost_s if i in after else 0.0)
    examples += qps * interval_s
  raise ValueError(f"{len(modes)} intervals train {examples:.0f} examples, not {target:.0f}")


def observed_pairs(auto_summary: dict) -> dict:
  """Each mode's observations in the auto run as (per-worker step times, measured QPS) pairs: a
  stay's `measured_qps`, or, in a summary without it, its timeline points (one per observed
  interval: the first, start-up, is not one) where no interval was skipped."""
  pairs = {"sync": [], "gba": []}
  for stay in auto_summary["stays"]:
    rows = stay["step_seconds"]
    qps = stay.get("measured_qps")
    if qps is None and "start_seconds" in stay and not stay.get("skipped_observations"):
      end = stay["start_seconds"] + stay["seconds"]
      points = [p["qps"] for p in auto_summary.get("timeline", [])
                if p["mode"] == stay["mode"] and stay["start_seconds"] <= p["seconds"] <= end]
      qps = points if len(points) == len(rows) else None
    if qps is not None and len(qps) == len(rows):
      pairs[stay["mode"]] += [(t, q) for t, q in zip(rows, qps) if q > 0]
  return pairs


def simulate(auto_summary: dict, args) -> dict:
  """The simulator's seconds for each mode on the benchmark's trace, given what `auto_summary`
  measured: the mean switch cost, each mode's quiet step times (the median of the observations
  of its stays, as a step's own time depends on the mode; a mode auto never trained in takes the
  other's), the mean observation interval and each mode's pace beyond the model, two ways: its
  step overhead (the median over its observations of `step_overhead_seconds`; a mode without
  one, from its efficiency at its quiet step times), and, under "by_efficiency", its efficiency
  (as the policy sees it); auto with the policy's flags (`tf_gba.simulate.auto.replay`). Also the
  simulated auto run's switches, at the interval's end on the training clock."""
  observed = {m: [t for stay in auto_summary["stays"] if stay["mode"] == m
                  for t in stay["step_seconds"]] for m in ("sync", "gba")}
  observations = observed["sync"] + observed["gba"]
  base = {m: np.median(np.asarray(observed[m] or observations, np.float64), axis=0)
          for m in observed}
  trained = sum(stay["train_seconds"] for stay in auto_summary["stays"])
  interval_s = trained / max(1, len(observations) + len(auto_summary["stays"]))
  measured = auto_summary["efficiency"]
  efficiency = {m: measured.get(m) or auto_summary["policy"][f"{m}_efficiency"]
                for m in ("sync", "gba")}
  pairs = observed_pairs(auto_summary)
  overhead = {}
  for m in ("sync", "gba"):
    if pairs[m]:
      overhead[m] = float(np.median([auto_sim.step_overhead_seconds(t, q, args.local_batch_size, m)
                                     for t, q in pairs[m]]))
    else:
      model = predicted_qps(base[m], args.local_batch_size)[f"{m}_qps"]
      overhead[m] = auto_sim.step_overhead_seconds(base[m], model * efficiency[m],
                                                   args.local_batch_size, m)
  costs = [sw["cost_s"] for sw in auto_summary["switches"] if sw.get("cost_s") is not None]
  cost = float(np.mean(costs)) if costs else auto_summary["policy"]["switch_cost_s"]
  slow = [int(w) for w in args.slow_workers.split(",")]
  target = args.steps * args.local_batch_size
  # Enough intervals for the slowest case: every worker at the slow pace throughout, at the
  # lower of the two paces.
  worst = max(target / min(predicted_qps(b * args.factor, args.local_batch_size)["sync_qps"]
                           * min(efficiency.values()),
                           auto_sim.stretched_qps(b * args.factor, args.local_batch_size, "sync",
                                                  max(overhead.values())))
              for b in base.values())
  n = int(worst / interval_s) + 2
  times = {m: trace_step_seconds(b, slow, args.factor, args.window_s, interval_s, n)
           for m, b in base.items()}
  out = {"interval_s": interval_s, "base_step_seconds": {m: b.tolist() for m, b in base.items()},
         "efficiency": efficiency, "overhead_s": overhead, "switch_cost_s": cost}
  policy = auto_summary["policy"]
  for world, key in ((overhead, None), (None, "by_efficiency")):
    res = {}
    for mode in ("sync", "gba"):
      res[mode] = simulated_seconds(times, interval_s, args.local_batch_size, target, efficiency,
                                    [mode] * n, overhead_s=world)
    rep = auto_sim.replay(times, interval_s, args.local_batch_size, efficiency, cost,
                          margin=policy["margin"], hysteresis=policy["hysteresis"],
                          dwell_s=policy["dwell_s"], confirm=policy["confirm"],
                          horizon_s=policy["horizon_s"], probe_s=policy["probe_s"],
                          measure_s=policy.get("measure_s", policy["dwell_s"]),
                          assumed_efficiency={m: policy[f"{m}_efficiency"]
                                              for m in ("sync", "gba")}
                          if policy["learn_efficiency"] else None, overhead_s=world)
    res["auto"], last = _run_to(times, interval_s, args.local_batch_size, target, efficiency,
                                rep.modes, rep.decisions, cost, world)
    res["auto_switches"] = [
        {"from": d["from"], "to": d["to"], "training_s": (d["interval"] + 1) * interval_s}
        for d in rep.decisions if d["interval"] < last]
    if key is None:
      out.update(res)
    else:
      out[key] = res
  return out


def real_switches(auto_summary: dict) -> list:
  """The auto run's switches, each at its decision on the training clock (the stays' training
  seconds before it, plus the seconds its stay had trained)."""
  out, clock = [], 0.0
  for stay, sw in zip(auto_summary["stays"], auto_summary["switches"]):
    out.append({"from": sw["from"], "to": sw["to"],
                "training_s": clock + sw["trained_s_in_mode"]})
    clock += stay["train_seconds"]
  return out


def _into_gba_and_back(switches, window_s: float) -> bool:
  """A switch to GBA decided inside the slow window, and one back to Sync after it."""
  into = [x for x in switches if x["to"] == "gba" and window_s <= x["training_s"] < 2 * window_s]
  return bool(into) and any(x["to"] == "sync" and x["training_s"] >= 2 * window_s
                            and x["training_s"] > into[0]["training_s"] for x in switches)


def run_one(mode: str, seed: int, args, trace: str, model_dir: str) -> dict:
  # Static shards where a mode has a choice (auto's own stays read static shards).
  input_flag = (["--input=sharded"] if mode_registry.reads_input(mode) else [])
  flags = [f"--mode={mode}", "--model=deepfm", "--data=synthetic", *input_flag,
           "--stragglers=" + (f"compute:{args.compute_ms:g}+" if args.compute_ms else "")
           + f"trace:{trace}", f"--steps={args.steps}",
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
  for i, sw in enumerate(summary["switches"]):
    decided = sw.get("decided_at_seconds") or sw["at_seconds"]
    ax.axvline(decided, color="k", lw=0.8, ls="--")
    gain = sw.get("expected_gain", sw["predicted_gain"])  # what it decided on (model's: older)
    # Left and right of their lines in turn: two switches close together stay readable.
    ax.annotate(f" {sw['from']}->{sw['to']} decided \n expected gain {gain:.2f} ",
                (decided, top * 1.1), fontsize=8, ha="left" if i % 2 else "right", va="top")
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
  p.add_argument("--first_seed", type=int, default=0,
                 help="seeds --first_seed, ..., --first_seed + --seeds - 1")
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
  p.add_argument("--report_only", action="store_true",
                 help="run nothing: print the tables again from --out's results.json and its "
                      "auto runs' summaries (the simulator run anew on them)")
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
  if args.compute_ms < 0:
    p.error(f"--compute_ms must be >= 0 (0: no floor), got {args.compute_ms:g}")
  if args.steps is None and not args.compute_ms and not (args.replot or args.report_only):
    p.error("--compute_ms=0 (no floor) needs --steps: there is no floor to derive it from")
  if args.dry_run:
    print(f"benchmarks.auto_mode: dry run: flags valid (modes {args.modes}, {args.seeds} seeds); "
          "nothing run.")
    return None
  if args.replot:
    with open(args.replot) as f:
      plot_timeline(json.load(f), args.plot, args.window_s)
    return None
  if args.report_only:
    return _report_again(args)
  if args.steps is None:
    args.steps = default_steps(args.window_s, args.factor, args.num_workers, args.compute_ms)
  os.makedirs(args.out, exist_ok=True)
  trace = os.path.join(args.out, "trace.json")
  with open(trace, "w") as f:
    json.dump({"window_seconds": args.window_s,
               "workers": {w: [1, args.factor, 1] for w in args.slow_workers.split(",")}}, f)
  rows = []
  for seed in range(args.first_seed, args.first_seed + args.seeds):
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
                   "num_switches": s.get("num_switches"), "switches": s.get("switches"),
                   "switch_seconds": s.get("switch_seconds")}
    if "auto" in runs:
      _simulated_into(row, runs["auto"], args)
    if {"sync", "gba", "auto"} <= set(runs):
      best = min(runs["sync"]["command_seconds"], runs["gba"]["command_seconds"])
      row["auto_vs_best"] = runs["auto"]["command_seconds"] / best
      row["auto_auc_minus_sync"] = runs["auto"]["eval_auc"] - runs["sync"]["eval_auc"]
    if "auto" in runs and seed == 0 and args.plot:
      plot_timeline(runs["auto"], args.plot, args.window_s)
    rows.append(row)
  return _report(rows, args)


def _simulated_into(row: dict, auto_summary: dict, args) -> None:
  """The simulator's figures for a seed's row, and the real seconds they are compared with: the
  training loops', for auto plus its switches' measured cost."""
  row["auto_switches"] = real_switches(auto_summary)
  row["simulated"] = simulate(auto_summary, args)
  for mode in [m for m in ("sync", "gba", "auto") if m in row]:
    row[mode]["real_seconds_for_simulator"] = row[mode]["train_seconds"] + (
        (row["auto"].get("switch_seconds") or 0.0) if mode == "auto" else 0.0)


def _report_again(args):
  """--report_only: the rows of --out's last run, the simulator run anew on its auto runs."""
  path = os.path.join(args.out, "results.json")
  if not os.path.exists(path):
    raise SystemExit(f"benchmarks.auto_mode: --report_only: no {path}; run the benchmark first.")
  with open(path) as f:
    rows = json.load(f)
  args.steps = rows[0]["steps"]
  for row in rows:
    if "auto" in row:
      with open(os.path.join(args.out, f"auto_{row['seed']}", "summary.json")) as f:
        _simulated_into(row, json.load(f), args)
  return _report(rows, args)


def _report(rows, args):
  """Prints the tables and acceptance lines of `rows`, and writes them to --out/results.json."""
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
  w = args.window_s
  for row in rows:
    if "auto_switches" in row:
      switches = ", ".join(f"{x['from']}->{x['to']} at {x['training_s']:.0f} s"
                           for x in row["auto_switches"]) or "none"
      into_and_back = _into_gba_and_back(row["auto_switches"], w)
      print(f"seed {row['seed']}: auto's switches (training clock; slow window [{w:g}, "
            f"{2 * w:g}) s): {switches}; into GBA in the window and back after it: "
            f"{'yes' if into_and_back else 'no'}")
    if "auto_vs_best" in row:
      print(f"seed {row['seed']}: auto / faster pure mode = {row['auto_vs_best']:.3f} (<= 1.10: "
            f"{'met' if row['auto_vs_best'] <= 1.10 else 'NOT met'}), AUC - sync = "
            f"{row['auto_auc_minus_sync']:+.4f}")
  gaps = [row["auto_auc_minus_sync"] for row in rows if "auto_auc_minus_sync" in row]
  if gaps:
    mean = float(np.mean(gaps))
    print(f"AUC: auto - sync over the seeds' mean {mean:+.4f} (>= -0.001: "
          f"{'met' if mean >= -0.001 else 'NOT met'})")
  sim_rows = [row for row in rows if "simulated" in row]
  if sim_rows:
    print("\nThe simulator given the auto run's step overheads, switch cost and quiet step times "
          "(real: the training loops' seconds, for auto plus its switches' measured cost; by "
          "efficiency: each mode at its measured efficiency instead of its overhead):\n")
    print("| seed | mode | real s | simulated s | simulated / real | by efficiency s (/ real) | "
          "switches, real | switches, simulated | switches, by efficiency |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in sim_rows:
      sim = row["simulated"]
      by_eff = sim.get("by_efficiency", {})
      for mode in [m for m in args.modes.split(",") if m in row]:
        real = row[mode]["real_seconds_for_simulator"]
        sw = ("", "", "")
        if mode == "auto":
          sw = tuple(", ".join(f"{x['from']}->{x['to']} {x['training_s']:.0f} s" for x in xs)
                     or "none" for xs in (row["auto_switches"], sim["auto_switches"],
                                          by_eff.get("auto_switches", [])))
        eff_s = (f"{by_eff[mode]:.1f} ({by_eff[mode] / real:.2f})" if mode in by_eff else "-")
        print(f"| {row['seed']} | {mode} | {real:.1f} | {sim[mode]:.1f} | "
              f"{sim[mode] / real:.2f} | {eff_s} | {sw[0]} | {sw[1]} | {sw[2]} |")
    for row in sim_rows:
      sim = row["simulated"]
      if "overhead_s" in sim:
        print(f"seed {row['seed']}: overhead per step sync {sim['overhead_s']['sync'] * 1e3:.1f} "
              f"ms, gba {sim['overhead_s']['gba'] * 1e3:.1f} ms; efficiency sync "
              f"{sim['efficiency']['sync']:.2f}, gba {sim['efficiency']['gba']:.2f}; switch cost "
              f"{sim['switch_cost_s']:.1f} s")
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(rows, f, indent=2)
  return rows


if __name__ == "__main__":
  main()
