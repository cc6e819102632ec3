"""How many workers one coordinator and P parameter servers of c cores drive, by simulation.

  python -m benchmarks.sim_capacity [--costs=before,after_k1,...,riders_k50 (COSTS)]
                                    [--num_ps=1,2,4,8] [--ps_cores=1,4,16] [--fraction=0.9] [--stragglers=paper]
                                    [--steps=200] [--max_workers=65536] [--out=...] [--dry_run]

For each set of measured per-role costs (COSTS: the coordinator's CPU per closure and per step,
the PS's per push, per aggregation and per closure, k steps per closure), each P and each c: the
largest N for which GBA's simulated global QPS is at least `fraction` of the workers' own: the
same N workers with the same costs where nothing queues (a coordinator and servers of as many
cores as workers), so that a step's own dispatch and service count as part of its time and only
the queueing on the one coordinator and the P x c cores is lost (at k = 1 the base's 7.6 ms of
dispatch and 11 ms of service would otherwise cost a lone worker of 141-ms steps 12 %). N is
searched by doubling, then bisection, which assumes that the fraction falls as N grows (the
coordinator and the servers are queues of fixed capacity). See docs/simulator.md, "The
coordinator and the parameter servers' CPU".
"""

import argparse
import dataclasses
import json
import os
from typing import Callable, Dict

from benchmarks.simulate import profile_string
from tf_gba.simulate import SimConfig, simulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Per-role CPU in ms, whole model (all PS together), fitted from benchmarks.step_cost at N = 4,
# 1 PS, DeepFM, local batch 256 (docs/simulator.md, "The coordinator and the parameter servers'
# CPU"): the coordinator's per closure and per worker step, the PS's per push (with its RPC),
# per aggregation (the ops' own, benchmarks/ps_service.py) and per closure.
COSTS: Dict[str, dict] = {
    # The base commit 26215b6, one step per closure: coordinator 7.57 ms and PS 8.28 ms of CPU
    # per worker step at N = 4 (mean of two runs), the PS's less 3.919 / 4 for the aggregation.
    "before": dict(coord_ms_per_closure=7.57, coord_ms_per_step=0.0, steps_per_execution=1,
                   ps_push_ms=7.30, ps_apply_ms=3.919, ps_ms_per_closure=0.0),
    # This tree, from its runs at k = 1 and k = 20 (N = 4, two runs each): the coordinator
    # 6.78 ms per closure + 0.79 per step, the PS 4.77 per push + 5.63 per closure.
    "after_k1": dict(coord_ms_per_closure=6.78, coord_ms_per_step=0.79, steps_per_execution=1,
                     ps_push_ms=4.77, ps_apply_ms=3.919, ps_ms_per_closure=5.63),
    # The same costs, --steps_per_execution=20.
    "after_k20": dict(coord_ms_per_closure=6.78, coord_ms_per_step=0.79, steps_per_execution=20,
                      ps_push_ms=4.77, ps_apply_ms=3.919, ps_ms_per_closure=5.63),
    # With the tf.data dispatcher in a process of its own and cheaper progress lines (N = 4, one
    # run each at k = 1 and 20): the coordinator 4.42 ms per closure + 0.28 per step, the PS
    # 3.23 per push + 4.73 per closure.
    "dispatcher_apart_k20": dict(coord_ms_per_closure=4.42, coord_ms_per_step=0.28,
                                 steps_per_execution=20, ps_push_ms=3.23, ps_apply_ms=3.919,
                                 ps_ms_per_closure=4.73),
    # The binary's defaults since: up to 50 steps per closure and a progress line every 200
    # worker steps (N = 4, one run each at k = 1 and 50, another 2-core machine): the coordinator
    # 3.93 ms per closure + 0.11 per step, the PS 2.18 per push + 4.72 per closure.
    "defaults_k50": dict(coord_ms_per_closure=3.93, coord_ms_per_step=0.11,
                         steps_per_execution=50, ps_push_ms=2.18, ps_apply_ms=3.919,
                         ps_ms_per_closure=4.72),
    # With 14 transfers per step at the server where there were 30 (packed reads, the embedding
    # gradient in the one gradient transfer, the metrics once per function; N = 4, one run each
    # at k = 1 and 50): the coordinator 3.39 ms per closure + 0.11 per step, the PS 1.19 per
    # push + 3.39 per closure.
    "fewer_transfers_k50": dict(coord_ms_per_closure=3.39, coord_ms_per_step=0.11,
                                steps_per_execution=50, ps_push_ms=1.19, ps_apply_ms=3.919,
                                ps_ms_per_closure=3.39),
    # With 8 transfers per step (the step loop without a tf.cond per step, the loss tracker's adds
    # and the rerun ledger's mark in the gradient transfer; N = 4, one run each at k = 1 and 50),
    # and the aggregation's ops measured again on a quiet machine (benchmarks.ps_service: 0.496
    # ms; the 3.919 above was measured at a load average of 16): the coordinator 3.52 ms per
    # closure + 0.14 per step, the PS 1.73 per push + 2.73 per closure.
    "riders_k50": dict(coord_ms_per_closure=3.52, coord_ms_per_step=0.14, steps_per_execution=50,
                       ps_push_ms=1.73, ps_apply_ms=0.496, ps_ms_per_closure=2.73),
}


def kept_fraction(n: int, costs: dict, **config) -> float:
  """GBA's simulated QPS of `n` workers with `costs`, over the same workers' where neither the
  coordinator nor the servers queue (as many cores as workers)."""
  base = SimConfig(num_workers=n, **config, **costs)
  own = simulate("gba", dataclasses.replace(base, ps_cores=n, coordinator_cores=n)).global_qps
  return simulate("gba", base).global_qps / own


def largest(ok: Callable[[int], bool], limit: int) -> int:
  """The largest n in [1, limit] with ok(n), for ok true up to some n and false beyond; 0 if
  ok(1) is false, `limit` if ok(limit)."""
  if not ok(1):
    return 0
  lo = 1
  while lo < limit:           # doubling: ok(lo), and ok(hi) is false or hi is past the limit
    hi = min(2 * lo, limit)
    if not ok(hi):
      break
    lo = hi
  else:
    return limit
  while hi - lo > 1:          # ok(lo), not ok(hi)
    mid = (lo + hi) // 2
    if ok(mid):
      lo = mid
    else:
      hi = mid
  return lo


def largest_workers(costs: dict, fraction: float, limit: int, **config) -> int:
  return largest(lambda n: kept_fraction(n, costs, **config) >= fraction, limit)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--costs", default=",".join(COSTS), help=f"comma-separated, of {list(COSTS)}")
  p.add_argument("--num_ps", default="1,2,4,8")
  p.add_argument("--ps_cores", default="1,4,16")
  p.add_argument("--fraction", type=float, default=0.9)
  p.add_argument("--stragglers", default="paper")
  p.add_argument("--compute_ms", type=float, default=100.0)
  p.add_argument("--pull_ms", type=float, default=5.0)
  p.add_argument("--push_ms", type=float, default=5.0)
  p.add_argument("--steps", type=int, default=200, help="global batches of N x B per run")
  p.add_argument("--max_workers", type=int, default=65536)
  p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_sim_capacity"))
  p.add_argument("--dry_run", action="store_true",
                 help="check the flags, print one line and exit without simulating")
  args = p.parse_args(argv)
  names = args.costs.split(",")
  for name in names:
    if name not in COSTS:
      p.error(f"--costs: {name!r} is not one of {list(COSTS)}")
  ps_list = [int(x) for x in args.num_ps.split(",")]
  cores_list = [int(x) for x in args.ps_cores.split(",")]
  config = dict(steps=args.steps, stragglers=profile_string(args.stragglers),
                compute_ms=args.compute_ms, pull_ms=args.pull_ms, push_ms=args.push_ms)
  try:
    for ps in ps_list:
      for c in cores_list:
        for name in names:
          SimConfig(num_workers=1, num_ps=ps, **config, **dict(COSTS[name], ps_cores=c))
  except ValueError as e:
    p.error(str(e))
  if args.dry_run:
    print(f"benchmarks.sim_capacity: dry run: flags valid ({len(names)} cost sets x "
          f"{len(ps_list)} x {len(cores_list)} clusters); nothing simulated.")
    return []
  print(f"largest N with GBA's QPS >= {args.fraction} x the workers' own; "
        f"{config['stragglers']}, pull {args.pull_ms} ms, push {args.push_ms} ms, "
        f"{args.steps} global batches")
  print("| costs | " + " | ".join(f"{ps} PS x {c} cores" for ps in ps_list for c in cores_list)
        + " |")
  print("|---|" + "---|" * (len(ps_list) * len(cores_list)))
  rows = []
  for name in names:
    cells = []
    for ps in ps_list:
      for c in cores_list:
        costs = dict(COSTS[name], ps_cores=c)
        n = largest_workers(costs, args.fraction, args.max_workers, num_ps=ps, **config)
        rows.append(dict(costs=name, num_ps=ps, largest_workers=n, **costs))
        cells.append(str(n))
    print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"args": vars(args), "rows": rows}, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
