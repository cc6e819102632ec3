"""When `--mode=auto` moves between Sync and GBA: a pure decision rule on measured step times and
measured throughput.

Each observation is every worker's own step time (its compute plus its slowdown, without the
time it spends waiting for others) over the last logging interval, and the QPS the job measured
in that interval. From the step times the cluster simulator's model
(`tf_gba.simulate.predicted_qps`; the arithmetic below is `tf_gba.simulate.auto`'s, which replays
this rule) gives both modes' throughput on an ideal cluster: Sync paced by the slowest worker of
each step, GBA by the sum of the workers' rates. A real cluster reaches a fraction of that, its
efficiency, which differs between the modes (Sync's all-reduce, GBA's parameter-server round
trips) and is known only by running them:

  efficiency of a mode     = measured QPS / its model QPS from the same interval's step times
  step overhead of a mode  = the seconds o a step took beyond the workers' own step times: the
                             model on the own times plus o gives the measured QPS
                             (`step_overhead_seconds`)
  expected QPS, this mode  = its measured QPS (with efficiencies held, `learn_efficiency`
                             False: its model QPS x its efficiency, as the other's)
  expected QPS, other mode = the model on the step times plus its step overhead (the median over
                             its last stay, `stretched_qps`); before its first stay (or with
                             efficiencies held) its model QPS x its efficiency
                             (`sync_efficiency` / `gba_efficiency`)
  expected gain            = expected GBA QPS / expected Sync QPS

An overhead, once measured, because most of a step can lie beyond the workers' own step times
(without a compute floor here a Sync step is 48-50 ms of all-reduce, input and waiting for a
core on 3-8 ms of its own): with two workers 4x slower, Sync's efficiency from a quiet stay
(0.09) predicted it at 4,500-4,700 QPS, where it trained at 17,600-18,100; the overhead stays
about the same across such a window (`tf_gba.simulate.auto.stretched_qps`).

A step's own time depends on the mode: a GBA step holds its parameter-server round trips, a Sync
step not its all-reduce (here, with no compute floor, about 22 ms against 7.6 ms). So the other
mode's model QPS is computed from this interval's step times scaled by the ratio of the modes'
base step times (each the fastest worker's median step time: the current mode's over this stay
so far, the other's over its last stay; 1 until the other has had a stay). Without it a job in
GBA predicts Sync from GBA's longer steps, and stays in GBA where Sync is faster.

The job wants the other mode when

  Sync -> GBA   the expected gain is at least 1 + margin,
  GBA  -> Sync  the expected gain is below 1 + margin - hysteresis,

and a switch pays when the time it saves over the next stay exceeds what a switch costs (a
checkpoint, a new set of processes, restore and tracing; measured by the job, before the first
switch `switch_cost_s`; the mean of the last two measured, the one into this stay included once
its first interval has ended):

  saved_s = H x (expected QPS of the other mode / expected QPS of this one - 1) > switch cost,

H = max(horizon_s, dwell_s): the next stay trains at least dwell_s seconds, and about horizon_s
(the time a cluster's state is expected to last). The job switches after `confirm` consecutive
observations that want the other mode and find that it pays, once it has trained at least
`dwell_s` seconds in its current mode.

With step times given as per-worker means over an interval ([N]), "the slowest worker of each
step" becomes the slowest mean: exact for slowdowns that last the interval (a busy machine), an
underestimate of Sync's waiting when each step's straggler is another worker (transient
slowdowns), which makes the policy slower to leave Sync, never quicker.
"""

import dataclasses
from typing import Dict, List, Optional, Sequence

import numpy as np

from tf_gba.simulate import auto as auto_sim

SYNC = auto_sim.SYNC
GBA = auto_sim.GBA
MODES = (SYNC, GBA)


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  margin: float = 0.3        # Sync -> GBA at an expected gain >= 1 + margin
  hysteresis: float = 0.15   # GBA -> Sync below 1 + margin - hysteresis
  dwell_s: float = 20.0      # training seconds in a mode before it may be left
  confirm: int = 2           # consecutive observations that must agree
  # Each mode's measured QPS over its model QPS before its first stay, and whether each stay's
  # measurements (its efficiency and step overhead) replace it (False: these values hold
  # throughout).
  sync_efficiency: float = 1.0
  gba_efficiency: float = 1.0
  learn_efficiency: bool = True
  switch_cost_s: float = 15.0  # a switch's cost until the job has measured one
  horizon_s: float = 60.0      # the stay over which a switch must pay (at least dwell_s)
  # Training seconds of a probe stay in each mode at the start (0: none): the first stay moves
  # to the other mode after this long and one observation, whatever the gain; that mode's first
  # stay may then be left after measure_s instead of dwell_s, by the usual rule.
  probe_s: float = 0.0
  # Training seconds before a mode's first stay after another ("second": entered on the
  # efficiency assumed for it, or after the probe) may be left, instead of dwell_s. The dwell
  # keeps noise from making the job flap; such a stay was entered on an assumption, not on a
  # measurement, and is left as soon as a few observations have measured it.
  measure_s: float = 5.0

  def __post_init__(self):
    if not self.margin > 0:
      raise ValueError(f"--auto_margin must be > 0, got {self.margin}.")
    if not 0 <= self.hysteresis <= self.margin:
      raise ValueError(f"--auto_hysteresis must be in [0, --auto_margin={self.margin}] (GBA is "
                       f"left below a gain of 1 + margin - hysteresis >= 1), got "
                       f"{self.hysteresis}.")
    if self.dwell_s < 0:
      raise ValueError(f"--auto_dwell_s must be >= 0, got {self.dwell_s}.")
    if self.confirm < 1:
      raise ValueError(f"--auto_confirm must be >= 1, got {self.confirm}.")
    for flag, value in (("--auto_sync_efficiency", self.sync_efficiency),
                        ("--auto_gba_efficiency", self.gba_efficiency)):
      if not 0 < value <= 10:
        raise ValueError(f"{flag} (measured QPS / model QPS before a mode's first stay) must be "
                         f"in (0, 10], got {value}.")
    if not self.switch_cost_s >= 0:
      raise ValueError(f"--auto_switch_cost_s must be >= 0, got {self.switch_cost_s}.")
    if not self.horizon_s > 0:
      raise ValueError(f"--auto_horizon_s must be > 0, got {self.horizon_s}.")
    if not self.probe_s >= 0:
      raise ValueError(f"--auto_probe_s must be >= 0, got {self.probe_s}.")
    if not self.measure_s >= 0:
      raise ValueError(f"--auto_measure_s must be >= 0, got {self.measure_s}.")
    if self.probe_s > 0 and not self.learn_efficiency:
      raise ValueError("--auto_probe_s measures each mode's efficiency at the start; with "
                       "--noauto_learn_efficiency the measured values would not be used. Set one "
                       "of them only.")

  @property
  def enter_gba(self) -> float:
    return 1.0 + self.margin

  @property
  def leave_gba(self) -> float:
    return 1.0 + self.margin - self.hysteresis

  @property
  def horizon(self) -> float:
    return max(self.horizon_s, self.dwell_s)

  def initial_efficiency(self) -> Dict[str, float]:
    return {SYNC: self.sync_efficiency, GBA: self.gba_efficiency}


# How many of the last measured switch costs the expected cost of the next switch averages.
COST_MEMORY = 2


def expected_switch_cost(config: PolicyConfig, costs: Sequence[float]) -> float:
  """The mean of the last `COST_MEMORY` measured switch costs; the configured one before any."""
  costs = list(costs)[-COST_MEMORY:]
  return float(np.mean(costs)) if costs else config.switch_cost_s


class AutoPolicy:
  """The switching rule for one stay in one mode (a switch starts a new job, and a new policy).

  `efficiency`: each mode's efficiency as the job knows it (measured in its last stay, or the
  configured value); `costs`: the job's measured switch costs so far; `decided_unix`: when the
  switch that started this stay was decided (None for the first stay), so that its cost, known at
  this stay's first observed interval (`started`), counts in this stay's decisions.
  `observe` is called once per logging interval with the seconds trained in this mode so far, the
  workers' step times and the measured QPS; it returns None, or the switch to make as a dict.

  `probe`: this stay is the start's probe of its mode (`PolicyConfig.probe_s`): "first", it
  moves to the other mode after probe_s seconds and one observation whatever the gain (the
  decision has `probe` True); "second", this mode's first stay after another (after the probe, or
  entered on the efficiency assumed for it): it may be left after measure_s seconds instead of
  dwell_s, by the usual rule.

  `base_step_s`: each mode's base step time as the job knows it (`stay_base_step_s` of its last
  stay; absent before one), from which the other mode's step times are predicted.
  `overhead_s`: each mode's step overhead as the job knows it (`stay_overhead_s` of its last
  stay; absent before one, and unused with efficiencies held), by which the other mode is
  predicted once known.
  """

  def __init__(self, config: PolicyConfig, mode: str, local_batch_size: int,
               efficiency: Optional[Dict[str, float]] = None,
               costs: Sequence[float] = (), decided_unix: Optional[float] = None,
               probe: Optional[str] = None,
               base_step_s: Optional[Dict[str, float]] = None,
               overhead_s: Optional[Dict[str, float]] = None):
    if mode not in MODES:
      raise ValueError(f"auto switches between {SYNC!r} and {GBA!r}, got {mode!r}.")
    self.config = config
    self.mode = mode
    self.other = GBA if mode == SYNC else SYNC
    self.local_batch_size = local_batch_size
    self.efficiency = dict(config.initial_efficiency(), **(efficiency or {}))
    self.costs = [float(c) for c in costs]
    self.decided_unix = decided_unix
    if probe not in (None, "first", "second"):
      raise ValueError(f"probe is None, 'first' or 'second', got {probe!r}.")
    self.probe = probe
    self.base_step_s = {m: float(v) for m, v in (base_step_s or {}).items() if v}
    self.overhead_s = {m: float(v) for m, v in (overhead_s or {}).items() if v is not None}
    self._agreeing = 0
    self.observations: List[dict] = []
    self._base_step = auto_sim.BaseStepSeconds()  # of the observations' per-worker step times
    self.skipped = 0  # intervals without a usable step time (no step timed)

  @property
  def switch_cost_s(self) -> float:
    return expected_switch_cost(self.config, self.costs)

  def started(self, first_interval_end_unix: float) -> None:
    """This stay's first interval (start-up, tracing) ended: the switch into it is measured."""
    if self.decided_unix is not None:
      self.costs.append(first_interval_end_unix - self.decided_unix)
      self.decided_unix = None

  def to_dict(self) -> dict:
    """What a process that evaluates this policy elsewhere needs (`from_dict`)."""
    return {"config": dataclasses.asdict(self.config), "mode": self.mode,
            "local_batch_size": self.local_batch_size, "efficiency": self.efficiency,
            "costs": self.costs, "decided_unix": self.decided_unix, "probe": self.probe,
            "base_step_s": self.base_step_s, "overhead_s": self.overhead_s}

  @classmethod
  def from_dict(cls, d: dict) -> "AutoPolicy":
    return cls(PolicyConfig(**d["config"]), d["mode"], d["local_batch_size"], d["efficiency"],
               d["costs"], d["decided_unix"], d.get("probe"), d.get("base_step_s"),
               d.get("overhead_s"))

  def wants_other_mode(self, gain: float) -> bool:
    if self.mode == SYNC:
      return gain >= self.config.enter_gba
    return gain < self.config.leave_gba

  def stay_efficiency(self) -> Optional[float]:
    """This stay's efficiency: the mean of its observations' (None before any)."""
    if not self.observations:
      return None
    return float(np.mean([o["efficiency"] for o in self.observations]))

  def stay_overhead_s(self) -> Optional[float]:
    """This stay's step overhead: the median of its observations' (None before any)."""
    if not self.observations:
      return None
    return float(np.median([o["overhead_s"] for o in self.observations]))

  def stay_base_step_s(self) -> Optional[float]:
    """This stay's base step time: the median of its observations' fastest worker's step time
    (None before any)."""
    return self._base_step.value()

  def observe(self, trained_s: float, step_seconds, measured_qps: float) -> Optional[dict]:
    times = np.asarray(step_seconds, np.float64)
    if times.size == 0 or not np.all(np.isfinite(times) & (times > 0)) or not measured_qps > 0:
      # No step timed in the interval (nothing to predict from): not an observation.
      self.skipped += 1
      return None
    per_worker = times if times.ndim == 1 else times.mean(axis=0)
    # This mode's base step time from this stay so far (this interval included: it is an
    # observation from here on), the other's from its last stay.
    self._base_step.add(per_worker)
    base = dict(self.base_step_s, **{self.mode: self._base_step.value()})
    # Efficiencies held (not learned): the current mode too is its model QPS times its own, and
    # the other is predicted by its efficiency, never by an overhead.
    learns = self.config.learn_efficiency
    e = auto_sim.expected_qps(times, self.local_batch_size, self.mode,
                              measured_qps if learns else None,
                              self.efficiency, auto_sim.step_scale(base, self.mode),
                              self.overhead_s if learns else None)
    model_qps, expected, gain = e["model"], e["expected"], e["gain"]
    saved_s = auto_sim.saved_seconds(expected, self.mode, self.config.horizon)
    wants, pays = self.wants_other_mode(gain), saved_s > self.switch_cost_s
    self._agreeing = self._agreeing + 1 if wants and pays else 0
    record = {"trained_s": float(trained_s), "mode": self.mode,
              "measured_qps": float(measured_qps),
              "efficiency": float(measured_qps) / model_qps[self.mode],
              "overhead_s": auto_sim.step_overhead_seconds(per_worker, measured_qps,
                                                           self.local_batch_size, self.mode),
              # The model's gain from the step times alone (what the simulator predicts).
              "predicted_gain": e["model_gain"],
              "predicted_sync_qps": model_qps[SYNC], "predicted_gba_qps": model_qps[GBA],
              "expected_sync_qps": expected[SYNC], "expected_gba_qps": expected[GBA],
              "expected_gain": gain,
              "other_efficiency": self.efficiency[self.other],
              # How the other mode was predicted: "overhead" (at other_overhead_s) or
              # "efficiency" (at other_efficiency).
              "other_by": e["other_by"],
              "other_overhead_s": self.overhead_s.get(self.other) if learns else None,
              # The other mode's step times as a multiple of these (1 before its first stay).
              "other_step_scale": e["scale"],
              "saved_s": saved_s, "switch_cost_s": self.switch_cost_s,
              "horizon_s": self.config.horizon, "wants": wants, "pays": pays,
              "per_worker_step_seconds": [float(x) for x in per_worker]}
    self.observations.append(record)
    threshold = self.config.enter_gba if self.mode == SYNC else self.config.leave_gba
    if self.probe == "first":
      # The other mode is to be measured, whatever this one predicts: after probe_s seconds.
      if trained_s < self.config.probe_s:
        return None
      return dict(record, **{"from": self.mode, "to": self.other, "threshold": threshold,
                             "probe": True})
    min_stay_s = self.config.measure_s if self.probe == "second" else self.config.dwell_s
    if self._agreeing < self.config.confirm or trained_s < min_stay_s:
      return None
    return dict(record, **{"from": self.mode, "to": self.other, "threshold": threshold,
                           "probe": False})


def describe(decision: dict) -> str:
  """The log line of a decision."""
  if decision.get("probe"):
    return (f"auto: probing {decision['to']} (its efficiency is not measured yet): "
            f"{decision['from']} measured {decision['measured_qps']:,.0f} QPS, "
            f"{decision['efficiency']:.2f} of its model; expected gain "
            f"{decision['expected_gain']:.2f} (GBA {decision['expected_gba_qps']:,.0f} vs Sync "
            f"{decision['expected_sync_qps']:,.0f} QPS, {decision['to']} assumed at "
            f"{decision['other_efficiency']:.2f}); model gain {decision['predicted_gain']:.2f}, "
            "per-worker step seconds "
            + " ".join(f"{x:.3f}" for x in decision["per_worker_step_seconds"]))
  op = ">=" if decision["from"] == SYNC else "<"
  return (f"auto: switching {decision['from']} -> {decision['to']}: expected gain "
          f"{decision['expected_gain']:.2f} {op} {decision['threshold']:.2f} (GBA "
          f"{decision['expected_gba_qps']:,.0f} vs Sync {decision['expected_sync_qps']:,.0f} "
          f"QPS; {decision['to']} {_other_prediction(decision)} "
          f"on {decision['other_step_scale']:.2f}x these steps' times, "
          f"{decision['from']} measured at {decision['efficiency']:.2f}); saves "
          f"{decision['saved_s']:.1f} s over {decision['horizon_s']:g} s > switch cost "
          f"{decision['switch_cost_s']:.1f} s; model gain {decision['predicted_gain']:.2f}, "
          "per-worker step seconds "
          + " ".join(f"{x:.3f}" for x in decision["per_worker_step_seconds"]))


def _other_prediction(decision: dict) -> str:
  """How a decision predicted the other mode, for its log line."""
  if decision.get("other_by") == "overhead":
    return f"at its step overhead {decision['other_overhead_s'] * 1e3:.1f} ms"
  return f"at efficiency {decision['other_efficiency']:.2f} of its model"
