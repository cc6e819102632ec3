"""`--mode=auto`'s decisions replayed on given step times, with measured efficiencies and a
switch cost: what the job would decide, and what its run would cost, without running it.

`expected_qps` and `saved_seconds` are the arithmetic of `tf_gba.training.auto_policy` (which
uses them): the current mode's expected QPS is what it measured; the other mode's is the model
(`predicted_qps`) on the current step times stretched by that mode's step overhead, measured in
its last stay (`stretched_qps`, `step_overhead_seconds`), and before its first stay its model
QPS times the efficiency assumed for it. An overhead and not an efficiency (measured / model
QPS), because most of a step here can be beyond the workers' own step times (a Sync step
without a compute floor: 48-50 ms of all-reduce and waiting for a core on 3-8 ms of its own):
when stragglers stretch the own times, the overhead stays and the efficiency does not (Sync's
0.09 measured on quiet workers predicted it at 4,500-4,700 QPS with two workers 4x slower, where
it trained at 17,600-18,100).

A step's own time depends on the mode (a GBA step holds its parameter-server round trips, a Sync
step not its all-reduce), so the other mode's step times are predicted from the current ones
scaled by `step_scale`: the ratio of the two modes' base step times (each the fastest worker's
median step time, `BaseStepSeconds`: the current mode's over this stay so far, the other's over
its last stay), 1 until the other has had a stay. The fastest worker's, so that stragglers in
one stay and not the other do not enter the ratio; a ratio, because a slowdown stretches a
step's whole own time.

`replay` walks a sequence of logging intervals (each a vector of the workers' own step times,
`interval_s` seconds of training) through the same rule: the current mode's measured QPS is its
model QPS times its efficiency (or stretched by a given overhead), the first interval of each
stay is not an observation (start-up), and a switch stops training for `switch_cost_s` seconds.
Intervals are on the workers' training clock (a trace's clock, which a switch does not advance).
"""

import dataclasses
import heapq
from typing import Dict, List, Optional, Sequence

import numpy as np

from tf_gba.simulate.cluster import predicted_qps

SYNC = "sync"
GBA = "gba"


def other_mode(mode: str) -> str:
  return GBA if mode == SYNC else SYNC


def stay_role(modes_before: Sequence[str], mode: str, probe_s: float,
              learns_efficiency: bool) -> Optional[str]:
  """A stay's `probe` role, given the modes of the stays before it: "first", the start's probe
  (`probe_s` > 0), which hands over to measure the other mode; "second", a mode's first stay
  after another (after the probe, or entered on the efficiency assumed for it), which measures
  that efficiency and may be left after measure_s instead of dwell_s, when the job learns
  efficiencies; None, a plain stay."""
  if probe_s > 0 and not modes_before:
    return "first"
  if modes_before and mode not in modes_before and learns_efficiency:
    return "second"
  return None


class BaseStepSeconds:
  """A stay's base step time: the median over its intervals so far of the fastest worker's step
  time, kept as intervals come. The policy and `replay` need it after every interval;
  recomputing it over the whole stay each time made an interval's cost grow with the stay (a
  day-long stay observed every second: 86,400 intervals rescanned at each). Two heaps around the
  median: an interval costs O(log n)."""

  def __init__(self):
    self._low: List[float] = []   # the smaller half, negated (a max-heap); one more if odd
    self._high: List[float] = []  # the larger half

  def __len__(self) -> int:
    return len(self._low) + len(self._high)

  def add(self, step_seconds) -> None:
    """One interval's per-worker step times: its fastest worker's enters the median."""
    fastest = float(np.min(np.asarray(step_seconds, np.float64)))
    if self._low and fastest > -self._low[0]:
      heapq.heappush(self._high, fastest)
    else:
      heapq.heappush(self._low, -fastest)
    if len(self._low) > len(self._high) + 1:
      heapq.heappush(self._high, -heapq.heappop(self._low))
    elif len(self._high) > len(self._low):
      heapq.heappush(self._low, -heapq.heappop(self._high))

  def value(self) -> Optional[float]:
    """The median (the mean of the middle two for an even count); None before any interval."""
    if not self._low:
      return None
    if len(self._low) > len(self._high):
      return -self._low[0]
    return 0.5 * (self._high[0] - self._low[0])


def step_scale(base: Dict[str, Optional[float]], mode: str) -> float:
  """What the other mode's step times are, as a multiple of `mode`'s: the ratio of their base
  step times, 1 until both are known (None or absent)."""
  own, other = base.get(mode), base.get(other_mode(mode))
  return float(other) / float(own) if own and other else 1.0


def expected_qps(step_seconds, local_batch_size: int, mode: str, measured_qps: float,
                 efficiency: Dict[str, float], scale: float = 1.0,
                 overhead_s: Optional[Dict[str, float]] = None) -> dict:
  """Both modes' expected QPS while training in `mode`: its own measured (model QPS times its
  efficiency if `measured_qps` is None: efficiencies held); the other's from the step times
  times `scale` (`step_scale`): `stretched_qps` with its step overhead where `overhead_s` has
  one for it (measured in its last stay), else its model QPS times its efficiency. With the
  model's QPS and, from the step times alone, the model's gain (`predicted_qps`); `other_by`
  says which prediction the other mode had ("overhead" or "efficiency")."""
  times = np.asarray(step_seconds, np.float64)
  model = predicted_qps(times, local_batch_size)
  other = other_mode(mode)
  other_times = times if scale == 1.0 else times * scale
  other_model = model if scale == 1.0 else predicted_qps(other_times, local_batch_size)
  model_qps = {mode: model[f"{mode}_qps"], other: other_model[f"{other}_qps"]}
  own = model_qps[mode] * efficiency[mode] if measured_qps is None else float(measured_qps)
  other_overhead = (overhead_s or {}).get(other)
  if other_overhead is None:
    other_qps, by = model_qps[other] * efficiency[other], "efficiency"
  else:
    other_qps, by = stretched_qps(other_times, local_batch_size, other, other_overhead), "overhead"
  expected = {mode: own, other: other_qps}
  return {"model": model_qps, "model_gain": model["gain"], "expected": expected,
          "gain": expected[GBA] / expected[SYNC], "scale": float(scale), "other_by": by}


def stretched_qps(step_seconds, local_batch_size: int, mode: str, overhead_s: float) -> float:
  """A mode's QPS when each step takes `overhead_s` seconds beyond the workers' own step times
  (a Sync step max_i t_i + o, a GBA worker's step t_i + o): the model on the stretched times.
  Where the own step times change (a straggler window), an overhead stays about what it was,
  while an efficiency (measured / model QPS) does not: with a 7.6-ms own step and 29 ms beyond
  it, Sync reaches 0.21 of its model; with the workers 4x slower, 0.51."""
  times = np.asarray(step_seconds, np.float64) + float(overhead_s)
  return predicted_qps(times, local_batch_size)[f"{mode}_qps"]


def step_overhead_seconds(step_seconds, measured_qps: float, local_batch_size: int,
                          mode: str) -> float:
  """The overhead o >= 0 at which `stretched_qps` is `measured_qps`: what a step took beyond the
  workers' own step times (the all-reduce, the parameter-server round trips, waiting for a
  core); 0 where the model from the own times is at or below the measurement."""
  times = np.asarray(step_seconds, np.float64)
  qps = float(measured_qps)
  if not qps > 0:
    raise ValueError(f"measured QPS must be > 0, got {measured_qps}")
  if stretched_qps(times, local_batch_size, mode, 0.0) <= qps:
    return 0.0
  if mode == SYNC:
    return times.size * local_batch_size / qps - float(times.max())
  # GBA: B x sum_i 1 / (t_i + o) falls with o, and is at most N x B / o: bisect on [0, N B / qps].
  lo, hi = 0.0, times.size * local_batch_size / qps
  for _ in range(100):
    mid = 0.5 * (lo + hi)
    if stretched_qps(times, local_batch_size, mode, mid) > qps:
      lo = mid
    else:
      hi = mid
  return 0.5 * (lo + hi)


def saved_seconds(expected: Dict[str, float], mode: str, horizon_s: float) -> float:
  """Seconds saved by training `horizon_s` seconds' worth of the other mode's examples there
  instead of in `mode`: horizon x (other's QPS / this one's - 1) (negative if slower)."""
  return horizon_s * (expected[other_mode(mode)] / expected[mode] - 1.0)


@dataclasses.dataclass
class Replay:
  decisions: List[dict]      # each: interval, from, to, expected gain, saved_s, other_by
  modes: List[str]           # the mode each interval trained in
  seconds: float             # training plus switches
  examples: float


def replay(step_seconds: Sequence, interval_s: float, local_batch_size: int,
           efficiency: Dict[str, float], switch_cost_s: float, *, margin: float = 0.3,
           hysteresis: float = 0.15, dwell_s: float = 20.0, confirm: int = 2,
           horizon_s: float = 60.0, start: str = SYNC, probe_s: float = 0.0,
           measure_s: float = 5.0, assumed_efficiency: Optional[Dict[str, float]] = None,
           overhead_s: Optional[Dict[str, float]] = None) -> Replay:
  """Replays `--mode=auto` over intervals of per-worker step times ([intervals, N]), or of each
  mode's own ({mode: [intervals, N]}): a step's own time depends on the mode (a GBA step holds
  its parameter-server round trips, a Sync step not its all-reduce), and the job sees the
  current mode's, from which it predicts both.

  `probe_s` > 0: the first stay moves to the other mode after `probe_s` seconds and one
  observation whatever the gain (a decision with `probe` True). `assumed_efficiency`: what the
  job assumes of a mode before its first stay (the flags; default `efficiency`, known from the
  start): a mode observed in a stay is known at its true `efficiency` from that stay's end on,
  as the job learns it, and so is its base step time (`BaseStepSeconds` of the stay's observed
  intervals). With `assumed_efficiency`, a mode's first stay after another (after the probe, or
  entered on the assumption) may be left after `measure_s` seconds instead of `dwell_s`.

  `overhead_s`: each mode trains at `stretched_qps` with this overhead per step instead of at its
  model QPS times `efficiency`; a stay then teaches the job the mean of its observed intervals'
  efficiencies (measured / model QPS), as the job learns it.

  A job that learns (`assumed_efficiency` given) also learns each stay's step overhead, the
  median over its observed intervals of `step_overhead_seconds`, and from then on predicts that
  mode by it (`expected_qps`), as the job does.
  """
  horizon = max(horizon_s, dwell_s)
  mode, in_mode, agreeing, first = start, 0.0, 0, True
  learns = assumed_efficiency is not None
  stays = [mode]  # the mode of each stay so far
  probe = stay_role([], mode, probe_s, learns)
  known = dict(efficiency if assumed_efficiency is None else assumed_efficiency)
  known_overhead: Dict[str, float] = {}  # each mode's step overhead from its last stay
  base: Dict[str, Optional[float]] = {}
  observed = BaseStepSeconds()  # this stay's observed intervals' base step time
  observed_efficiency: List[float] = []  # and their measured / model QPS
  observed_overhead: List[float] = []    # and their step overhead
  decisions, modes = [], []
  seconds = examples = 0.0
  per_mode = {m: np.asarray(step_seconds[m] if isinstance(step_seconds, dict) else step_seconds,
                            np.float64) for m in (SYNC, GBA)}
  for i in range(min(len(t) for t in per_mode.values())):
    times = per_mode[mode][i]
    model = predicted_qps(times, local_batch_size)
    qps = (model[f"{mode}_qps"] * efficiency[mode] if overhead_s is None
           else stretched_qps(times, local_batch_size, mode, overhead_s[mode]))
    modes.append(mode)
    seconds += interval_s
    examples += qps * interval_s
    in_mode += interval_s
    if first:  # start-up and tracing: not an observation
      first = False
      continue
    observed.add(times)
    observed_efficiency.append(qps / model[f"{mode}_qps"])
    if learns:
      observed_overhead.append(step_overhead_seconds(times, qps, local_batch_size, mode))
    # This mode's base step time from this stay so far, the other's from its last stay.
    e = expected_qps(times, local_batch_size, mode, qps, known,
                     step_scale(dict(base, **{mode: observed.value()}), mode), known_overhead)
    saved = saved_seconds(e["expected"], mode, horizon)
    wants = e["gain"] >= 1 + margin if mode == SYNC else e["gain"] < 1 + margin - hysteresis
    agreeing = agreeing + 1 if wants and saved > switch_cost_s else 0
    if probe == "first":
      switch = in_mode >= probe_s
    else:
      switch = agreeing >= confirm and in_mode >= (measure_s if probe == "second" else dwell_s)
    if switch:
      decisions.append({"interval": i, "from": mode, "to": other_mode(mode),
                        "expected_gain": e["gain"], "saved_s": saved,
                        "step_scale": e["scale"], "other_by": e["other_by"],
                        "probe": probe == "first"})
      # The stay's measured efficiency, learned at its end.
      known[mode] = (efficiency[mode] if overhead_s is None
                     else float(np.mean(observed_efficiency)))
      base[mode] = observed.value()
      if observed_overhead:
        known_overhead[mode] = float(np.median(observed_overhead))
      mode, in_mode, agreeing, first = other_mode(mode), 0.0, 0, True
      observed = BaseStepSeconds()
      observed_efficiency, observed_overhead = [], []
      seconds += switch_cost_s
      probe = stay_role(stays, mode, probe_s, learns)
      stays.append(mode)
  return Replay(decisions, modes, seconds, examples)
