"""When `--mode=auto` moves between Sync and GBA: a pure decision rule on measured step times.

Each observation is every worker's own step time (its compute plus its slowdown, without the
time it spends waiting for others) over the last logging interval. From these the cluster
simulator's model (`tf_gba.simulate.predicted_qps`) predicts both modes' throughput: Sync is paced
by the slowest worker of each step, GBA by the sum of the workers' rates. The predicted gain is
GBA's QPS over Sync's; it is 1 when every worker is equally fast and grows with stragglers.

  Sync -> GBA   when the gain is at least 1 + margin,
  GBA  -> Sync  when the gain is below 1 + margin - hysteresis,

and only after `confirm` consecutive observations agree and the job has trained at least
`dwell_s` seconds in its current mode: a switch costs a checkpoint and a new set of processes, so
a short burst of slow steps, or a gain hovering near the threshold, must not make the job flap.

With step times given as per-worker means over an interval ([N]), "the slowest worker of each
step" becomes the slowest mean: exact for slowdowns that last the interval (a busy machine), an
underestimate of Sync's waiting when each step's straggler is another worker (transient
slowdowns), which makes the policy slower to leave Sync, never quicker.
"""

import dataclasses
from typing import List, Optional

import numpy as np

from tf_gba.simulate import predicted_qps

SYNC = "sync"
GBA = "gba"


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  margin: float = 0.3        # Sync -> GBA at a predicted gain >= 1 + margin
  hysteresis: float = 0.15   # GBA -> Sync below 1 + margin - hysteresis
  dwell_s: float = 20.0      # training seconds in a mode before it may be left
  confirm: int = 2           # consecutive observations that must agree

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

  @property
  def enter_gba(self) -> float:
    return 1.0 + self.margin

  @property
  def leave_gba(self) -> float:
    return 1.0 + self.margin - self.hysteresis


class AutoPolicy:
  """The switching rule for one stay in one mode (a switch starts a new job, and a new policy).

  `observe` is called once per logging interval with the seconds trained in this mode so far and
  the workers' step times; it returns None, or the switch to make as a dict.
  """

  def __init__(self, config: PolicyConfig, mode: str, local_batch_size: int):
    if mode not in (SYNC, GBA):
      raise ValueError(f"auto switches between {SYNC!r} and {GBA!r}, got {mode!r}.")
    self.config = config
    self.mode = mode
    self.local_batch_size = local_batch_size
    self._agreeing = 0
    self.observations: List[dict] = []

  def wants_other_mode(self, gain: float) -> bool:
    if self.mode == SYNC:
      return gain >= self.config.enter_gba
    return gain < self.config.leave_gba

  def observe(self, trained_s: float, step_seconds) -> Optional[dict]:
    times = np.asarray(step_seconds, np.float64)
    prediction = predicted_qps(times, self.local_batch_size)
    gain = prediction["gain"]
    self._agreeing = self._agreeing + 1 if self.wants_other_mode(gain) else 0
    per_worker = times if times.ndim == 1 else times.mean(axis=0)
    record = {"trained_s": float(trained_s), "mode": self.mode, "predicted_gain": gain,
              "predicted_sync_qps": prediction["sync_qps"],
              "predicted_gba_qps": prediction["gba_qps"],
              "per_worker_step_seconds": [float(x) for x in per_worker]}
    self.observations.append(record)
    if self._agreeing < self.config.confirm or trained_s < self.config.dwell_s:
      return None
    return dict(record, **{"from": self.mode, "to": GBA if self.mode == SYNC else SYNC,
                           "threshold": (self.config.enter_gba if self.mode == SYNC
                                         else self.config.leave_gba)})
