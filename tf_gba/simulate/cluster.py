"""Discrete-event simulation of N workers and P parameter servers in each training mode.

A worker step is: pull the parameters (and fetch a token) from the PS, compute, push the
gradient. Its duration is

    pull + compute x factor + push,   pull = latency + pull_ms / P,  push = latency + push_ms / P

(the variables are sharded over the P servers, which transfer their shares in parallel), where
compute is `compute_ms` or the profile's `compute:<ms>` floor, whichever is larger, and factor is
the straggler slowdown of that worker at that step, taken from the project's own profiles
(`tf_gba.distribute.stragglers.parse` and the `GBA>StragglerFactors` op, which shares its draw
with the op that slows real workers). The PS's own work (aggregating, applying) and the
coordinator's are not modelled by default; with their costs set (`ps_push_ms`, `ps_apply_ms`,
`ps_cores`, `coord_ms_per_closure`, `coord_ms_per_step`, `steps_per_execution`) the pushes queue
on the P parameter servers' c cores and every closure of k worker steps waits for the one
coordinator process to dispatch it (`_queued_free_running`).

The modes (SPEC section 1, "Baselines"):
  sync    every step waits for all N workers (all-reduce); staleness 0.
  async   every gradient applied on arrival (a buffer of M = 1).
  gba     buffer of M (default N), token per step, dense staleness k - token, weight 0 beyond iota.
  bsp     buffer of b2 (default max(1, round(N / 5))) gradients of any version.
  hop_bs  buffer of N, and a worker may not start a step while it has finished more than b1
          steps beyond the slowest worker (it blocks; no timeout).
  hop_bw  per-version barrier: version k takes the first N - b3 (default b3 = max(1, round(N/5)))
          gradients computed on version k; a worker that pushed for version k waits for version
          k + 1; later gradients of version k are dropped on arrival.

In the buffered modes workers never wait for the buffer (GBA, async, BSP) or only through their
own barrier (Hop-BS, Hop-BW), so their timelines are simulated first, vectorised over workers one
step (or one version) at a time, and the buffer decisions are then taken by replaying the fetches
and pushes, in time order, through `tf_gba.simulate.logic` (the real ops' rules).

A run ends when `steps x N` worker steps (steps global batches of the synchronous size N x B) have
been pushed; QPS counts every pushed batch (as benchmarks/mode_qps.py does), `effective_qps` only
those aggregated with a non-zero weight.
"""

import dataclasses
import heapq
from typing import Dict, List, Optional

import numpy as np

from tf_gba.distribute import stragglers as stragglers_lib
# The baselines' defaults (b2, b3) are those of the real modes.
from tf_gba.distribute.modes import DEFAULT_HOP_BS_BOUND
from tf_gba.distribute.modes import default_bsp_aggregate
from tf_gba.distribute.modes import default_hop_bw_backup
from tf_gba.ops import gba_ops
from tf_gba.simulate import logic

MODES = ("sync", "async", "gba", "bsp", "hop_bs", "hop_bw")
# Modes whose pushes queue on the parameter servers when their service times are set: those
# whose buffers count every push (count_dropped, divide by M), so that every M-th push in
# arrival order completes a global batch.
_QUEUED = ("gba", "async", "bsp")


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """One simulated cluster. Times in milliseconds."""
  num_workers: int = 8
  num_ps: int = 1
  steps: int = 1000
  compute_ms: float = 100.0
  pull_ms: float = 5.0
  push_ms: float = 5.0
  latency_ms: float = 0.5
  stragglers: str = "none"
  seed: int = 0
  local_batch_size: int = 256
  iota: int = 3
  gba_num_aggregate: Optional[int] = None    # M; None: N
  bsp_aggregate: Optional[int] = None        # b2; None: max(1, round(N / 5))
  hop_bs_bound: int = DEFAULT_HOP_BS_BOUND   # b1
  hop_bw_backup: Optional[int] = None        # b3; None: max(1, round(N / 5))
  histogram_bins: int = 16
  # Where a step's slowdown lies. False: inside the compute, before the push (a slow machine).
  # True: after the push, as the project's injected stragglers do (GBA>StepEnd sleeps at the end
  # of the step, after the gradient was pushed): the push leaves after pull + work_ms + push, and
  # the worker is free again max(that, compute) x factor after the step began.
  delay_after_push: bool = False
  work_ms: float = 10.0
  # The parameter servers' service time of one push and of one aggregation + apply (whole model,
  # all P servers together; benchmarks/ps_service.py measures them from the real ops).
  ps_push_ms: float = 0.0
  ps_apply_ms: float = 0.0
  # The parameter servers' CPU per scheduled closure beside its pushes (the function's own reads
  # and updates on the servers: Keras' step counter and loss metric), served with the push that
  # ends the closure.
  ps_ms_per_closure: float = 0.0
  # Cores of each parameter server: its pushes are served by c cores in arrival order (a push, and
  # the aggregation it runs, on one core).
  ps_cores: int = 1
  # The coordinator, one process on one core: the CPU it spends to dispatch one scheduled closure
  # of `steps_per_execution` (k) worker steps, and per worker step besides (progress lines and
  # other per-step bookkeeping, charged at the closure's dispatch). Closures are dispatched in the
  # order the workers ask for them; a worker starts a closure's first step when its dispatch ends.
  coord_ms_per_closure: float = 0.0
  coord_ms_per_step: float = 0.0
  steps_per_execution: int = 1
  # Closures the coordinator dispatches at once (1: one Python process). As many as workers: the
  # dispatch is a latency that never queues (benchmarks.sim_capacity's reference).
  coordinator_cores: int = 1

  def __post_init__(self):
    for name in ("num_workers", "num_ps", "steps", "local_batch_size", "ps_cores",
                 "steps_per_execution", "coordinator_cores"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
    for name in ("compute_ms", "pull_ms", "push_ms", "latency_ms", "work_ms", "ps_push_ms",
                 "ps_apply_ms", "ps_ms_per_closure", "coord_ms_per_closure", "coord_ms_per_step"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
    if self.iota < 0:
      raise ValueError(f"iota must be >= 0, got {self.iota}.")
    if self.gba_num_aggregate is not None and self.gba_num_aggregate < 1:
      raise ValueError(f"gba_num_aggregate (M) must be >= 1, got {self.gba_num_aggregate}.")
    if self.bsp_aggregate is not None and self.bsp_aggregate < 1:
      raise ValueError(f"bsp_aggregate (b2) must be >= 1, got {self.bsp_aggregate}.")
    if self.hop_bs_bound < 0:
      raise ValueError(f"hop_bs_bound (b1) must be >= 0, got {self.hop_bs_bound}.")
    b3 = self.hop_bw_backup
    if b3 is not None and not 0 <= b3 < self.num_workers:
      raise ValueError(f"hop_bw_backup (b3) must be in [0, num_workers - 1] = "
                       f"[0, {self.num_workers - 1}], got {b3}.")
    stragglers_lib.parse(self.stragglers)  # a bad profile fails here, with its message

  @property
  def ps_service(self) -> bool:
    """Whether the parameter servers' own work is modelled (a queue per PS)."""
    return self.ps_push_ms > 0 or self.ps_apply_ms > 0 or self.ps_ms_per_closure > 0

  @property
  def closure_ms(self) -> float:
    """The coordinator's CPU to dispatch one closure of k worker steps."""
    return self.coord_ms_per_closure + self.steps_per_execution * self.coord_ms_per_step

  @property
  def queued(self) -> bool:
    """Whether the PS's or the coordinator's work is modelled (the event-driven timeline)."""
    return self.ps_service or self.closure_ms > 0

  @property
  def b2(self) -> int:
    return self.bsp_aggregate or default_bsp_aggregate(self.num_workers)

  @property
  def b3(self) -> int:
    return (self.hop_bw_backup if self.hop_bw_backup is not None
            else default_hop_bw_backup(self.num_workers))

  @property
  def m(self) -> int:
    return self.gba_num_aggregate or self.num_workers


@dataclasses.dataclass
class Events:
  """Every worker step a run started: who, which of its steps, when, and its token."""
  worker: np.ndarray
  index: np.ndarray      # the worker's own step number
  start: np.ndarray      # seconds: pull and token fetch
  finish: np.ndarray     # seconds: push arrives at the PS
  token: np.ndarray      # filled after the timeline (token generator order, or the version read)
  ready: np.ndarray      # when the worker was free after its previous step (start - ready:
                         # blocked)
  end: np.ndarray        # when the worker is free after this step (= finish unless the
                         # slowdown comes after the push)
  # The queued model's busy intervals, seconds: "ps" (one server's share of each push, on one of
  # its cores) and "coordinator" (each closure's dispatch), each an array [start, end] x count.
  busy: Optional[Dict[str, np.ndarray]] = None


@dataclasses.dataclass
class SimResult:
  mode: str
  num_workers: int
  num_ps: int
  seconds: float              # simulated time to push steps x N batches
  pushes: int
  global_steps: int
  global_qps: float
  effective_qps: float        # batches aggregated with a non-zero weight, per second
  mean_staleness: float
  max_staleness: int
  staleness_histogram: List[int]
  dropped_batches: int
  idle_fraction: float        # of N x seconds, workers neither pulling, computing nor pushing
  per_worker_steps: List[int]
  blocked_seconds: float = 0.0   # time blocked at a barrier (hop_bs) or waiting for the
                                 # coordinator's dispatch, summed over workers
  # The queued model (PS or coordinator costs set), over [0, seconds]: CPU per worker step pushed
  # (ms; "ps": all P servers together) and utilisation (busy time / (cores x seconds); "ps": of
  # each server, all alike).
  coordinator_ms_per_step: float = 0.0
  ps_ms_per_step: float = 0.0
  coordinator_utilisation: float = 0.0
  ps_utilisation: float = 0.0
  max_lead: Optional[int] = None
  extra: Dict = dataclasses.field(default_factory=dict)

  def as_dict(self, per_worker: bool = False) -> dict:
    d = dataclasses.asdict(self)
    if not per_worker:
      d.pop("per_worker_steps")
    d.pop("extra")
    return d


class _Durations:
  """Step durations of the simulated workers, from the straggler profile."""

  def __init__(self, config: SimConfig):
    self._profile = stragglers_lib.parse(config.stragglers)
    self.profile_parts = [x for x in self._profile.replace(";", "+").split("+") if x]
    self._seed = int(config.seed)
    _, floor = self.factors(np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1))
    p = config.num_ps
    self.pull = (config.latency_ms + config.pull_ms / p) * 1e-3
    self.push = (config.latency_ms + config.push_ms / p) * 1e-3
    self.compute = max(config.compute_ms * 1e-3, floor)
    self.after_push = config.delay_after_push
    self.work = config.work_ms * 1e-3

  def factors(self, workers, steps, elapsed):
    return stragglers_lib.slowdown_factors(
        np.asarray(workers, np.int64), np.asarray(steps, np.int64),
        np.asarray(elapsed, np.float64), self._profile, self._seed)

  def __call__(self, workers, steps, start):
    """For step `steps[i]` of worker `workers[i]` started at `start[i]`: (push, end), the seconds
    after the start at which its gradient reaches the PS and at which the worker is free for its
    next step."""
    # Every simulated worker starts its first step at time 0: elapsed time is the start time.
    f, _ = self.factors(workers, steps, start)
    if not self.after_push:
      d = self.pull + self.compute * f + self.push
      return d, d
    push = np.full(f.shape, self.pull + self.work + self.push)
    end = np.maximum(push, self.compute) * f
    return push, end


def sync_seconds(step_seconds) -> float:
  """Synchronous training's time for `step_seconds` ([steps, N]: each worker's own time for each
  step): every step lasts as long as its slowest worker (the all-reduce waits for it)."""
  d = np.atleast_2d(np.asarray(step_seconds, np.float64))
  return float(d.max(axis=1).sum())


def free_running_rate(step_seconds) -> float:
  """Worker steps per second when no worker waits for another (GBA, async, BSP): the sum of the
  workers' own rates, each worker's rate being its steps over its time (`step_seconds` as in
  `sync_seconds`)."""
  d = np.atleast_2d(np.asarray(step_seconds, np.float64))
  return float((d.shape[0] / d.sum(axis=0)).sum())


def predicted_qps(step_seconds, local_batch_size: int) -> dict:
  """Examples per second of Sync and of GBA for workers whose own step times are `step_seconds`
  ([steps, N], or [N] for one step or per-worker means): the model this simulator runs
  (`_sync` paces each step by `sync_seconds`; free-running workers add up their rates)."""
  d = np.atleast_2d(np.asarray(step_seconds, np.float64))
  if d.size == 0 or not np.all(d > 0):
    raise ValueError(f"step times must be > 0 seconds, got {d.tolist()}.")
  steps, n = d.shape
  sync = steps * n * local_batch_size / sync_seconds(d)
  gba = free_running_rate(d) * local_batch_size
  return {"sync_qps": sync, "gba_qps": gba, "gain": gba / sync}


def _order(times: np.ndarray, workers: np.ndarray) -> np.ndarray:
  """Event order: by time, simultaneous events by worker index."""
  return np.lexsort((workers, times))


def _cutoff(finish: np.ndarray, target: int) -> float:
  return float(np.partition(finish, target - 1)[target - 1])


class _Timeline:
  """Collects started steps, one vector of workers at a time."""

  def __init__(self):
    self.parts = {k: [] for k in ("worker", "index", "start", "finish", "token", "ready", "end")}

  def add(self, worker, index, start, finish, ready, token=None, end=None):
    """`ready`: when the worker was free after its previous step (start - ready: blocked)."""
    self.parts["worker"].append(np.asarray(worker, np.int32))
    self.parts["index"].append(np.asarray(index, np.int32))
    self.parts["start"].append(np.asarray(start, np.float64))
    self.parts["finish"].append(np.asarray(finish, np.float64))
    self.parts["ready"].append(np.asarray(ready, np.float64))
    self.parts["end"].append(np.asarray(finish if end is None else end, np.float64))
    if token is not None:
      self.parts["token"].append(np.asarray(token, np.int64))

  def events(self):
    cat = {k: (np.concatenate(v) if v else None) for k, v in self.parts.items()}
    ev = Events(cat["worker"], cat["index"], cat["start"], cat["finish"], cat["token"],
                cat["ready"], cat["end"])
    return ev


def _free_running(config: SimConfig, dur: _Durations, barrier_bound: Optional[int]):
  """Workers that start a step as soon as they pushed the last (GBA, async, BSP), or, with
  `barrier_bound` = b1, once every worker has finished at least (own steps - b1) (Hop-BS)."""
  n, target = config.num_workers, config.steps * config.num_workers
  workers = np.arange(n)
  tl = _Timeline()
  prev_end = np.zeros(n)
  all_done = []           # all_done[s]: when every worker has finished its step s
  check_at = config.steps
  s = 0
  while True:
    start = prev_end
    if barrier_bound is not None and s - barrier_bound - 1 >= 0:
      start = np.maximum(prev_end, all_done[s - barrier_bound - 1])
    push, end = dur(workers, np.full(n, s), start)
    finish, end = start + push, start + end
    tl.add(workers, np.full(n, s), start, finish, prev_end, end=end)
    # A worker counts a step as finished (Hop-BS's clock) once it is free again.
    all_done.append(float(end.max()))
    s += 1
    if s >= check_at:
      # Every step finishing before min(finish) has been generated (a worker's later steps
      # finish later): stop once those cover the target. Checked at growing intervals, since a
      # check costs as much as the steps so far.
      ev = tl.events()
      if np.count_nonzero(ev.finish <= float(finish.min())) >= target:
        return ev
      check_at = s + max(1, s // 8)
    prev_end = end


class _FactorCache:
  """Slowdown factors of every worker for blocks of steps, drawn on first use (one op call per
  block; profiles with a trace depend on the start time and are drawn one step at a time)."""

  def __init__(self, dur: _Durations, n: int, block: int = 64):
    self._dur, self._n, self._block = dur, n, block
    self._timed = any(part.startswith("trace") for part in dur.profile_parts)
    self._blocks: Dict[int, np.ndarray] = {}

  def __call__(self, worker: int, step: int, start: float) -> float:
    if self._timed:
      f, _ = self._dur.factors([worker], [step], [start])
      return float(f[0])
    b = step // self._block
    if b not in self._blocks:
      steps = np.repeat(np.arange(b * self._block, (b + 1) * self._block), self._n)
      workers = np.tile(np.arange(self._n), self._block)
      f, _ = self._dur.factors(workers, steps, np.zeros(steps.size))
      self._blocks[b] = f.reshape(self._block, self._n)
    return float(self._blocks[b][step % self._block, worker])


_PUSH, _DISPATCH = 0, 1


def _queued_free_running(config: SimConfig, dur: _Durations, num_aggregate: int) -> Events:
  """Free-running workers whose pushes queue on the parameter servers and whose closures queue on
  the coordinator.

  Pushes are served in arrival order by the first free of each server's c cores (`ps_push_ms / P`,
  the M-th push of a global batch `ps_apply_ms / P` more: the aggregation and apply, and the push
  that ends a closure of k steps `ps_ms_per_closure / P` more); the P
  servers serve equal shares of every push in the same order, so they are one queue of those
  service times. A worker starts its next step when its push returns. With the coordinator's cost
  set, a worker asks for a closure of k steps when it is free after the last one, the coordinator
  serves the requests in order, one at a time (`closure_ms`), and the closure's first step starts
  when its dispatch ends. Busy intervals are in `Events.busy`.
  """
  n, target = config.num_workers, config.steps * config.num_workers
  p = config.num_ps
  push_service = config.ps_push_ms * 1e-3 / p
  apply_service = config.ps_apply_ms * 1e-3 / p
  ps_closure_service = config.ps_ms_per_closure * 1e-3 / p
  closure_service = config.closure_ms * 1e-3
  k = config.steps_per_execution
  factors = _FactorCache(dur, n)
  rows = {k_: [] for k_ in ("worker", "index", "start", "finish", "ready", "end")}
  ps_busy, coord_busy = [], []
  step_of = [0] * n
  start_of = [0.0] * n
  ready_of = [0.0] * n     # when the worker was free before this step (waits for a dispatch)
  compute_of = [0.0] * n   # the step's slowdown-scaled compute
  left_of = [k] * n        # steps left in the worker's closure

  def begin(w: int, t: float):
    f = factors(w, step_of[w], t)
    start_of[w] = t
    compute_of[w] = dur.compute * f
    if dur.after_push:
      return t + dur.pull + dur.work + dur.push
    return t + dur.pull + dur.compute * f + dur.push

  if closure_service > 0:
    heap = [(0.0, _DISPATCH, w) for w in range(n)]
  else:
    heap = [(begin(w, 0.0), _PUSH, w) for w in range(n)]
  heapq.heapify(heap)
  cores = [0.0] * config.ps_cores   # when each core of a server is free (a heap)
  coord = [0.0] * config.coordinator_cores   # the same for the coordinator
  served = 0
  # The `target` earliest finishes so far (negated, a max-heap): the run is cut at the largest.
  earliest: List[float] = []
  while heap:
    t, kind, w = heap[0]
    if served >= target and t > -earliest[0]:
      break   # every later event is past the cut: no push still to come finishes before it
    heapq.heappop(heap)
    if kind == _DISPATCH:
      begin_at = max(t, heapq.heappop(coord))
      dispatched = begin_at + closure_service
      heapq.heappush(coord, dispatched)
      coord_busy.append((begin_at, dispatched))
      left_of[w] = k
      ready_of[w] = t
      heapq.heappush(heap, (begin(w, dispatched), _PUSH, w))
      continue
    served += 1
    serve_at = max(t, heapq.heappop(cores))
    finish = serve_at + push_service
    if served % num_aggregate == 0:
      finish += apply_service
    if left_of[w] == 1:
      finish += ps_closure_service
    heapq.heappush(cores, finish)
    ps_busy.append((serve_at, finish))
    if len(earliest) < target:
      heapq.heappush(earliest, -finish)
    elif finish < -earliest[0]:
      heapq.heapreplace(earliest, -finish)
    start = start_of[w]
    # The slowdown after the push (injected stragglers): free once the padded step is over.
    end = max(finish, start + compute_of[w]) if dur.after_push else finish
    for key, value in (("worker", w), ("index", step_of[w]), ("start", start),
                       ("finish", finish), ("ready", ready_of[w]), ("end", end)):
      rows[key].append(value)
    step_of[w] += 1
    left_of[w] -= 1
    if left_of[w] == 0 and closure_service > 0:
      heapq.heappush(heap, (end, _DISPATCH, w))
    else:
      left_of[w] = left_of[w] or k
      ready_of[w] = end
      heapq.heappush(heap, (begin(w, end), _PUSH, w))
  # Steps in flight at the end: started, not yet served (their pushes come after the cut).
  for t, kind, w in heap:
    if kind == _PUSH:
      finish = max(t, cores[0]) + push_service
      for key, value in (("worker", w), ("index", step_of[w]), ("start", start_of[w]),
                         ("finish", finish), ("ready", ready_of[w]), ("end", finish)):
        rows[key].append(value)
  busy = {"ps": np.asarray(ps_busy, np.float64).reshape(-1, 2),
          "coordinator": np.asarray(coord_busy, np.float64).reshape(-1, 2)}
  return Events(np.asarray(rows["worker"], np.int32), np.asarray(rows["index"], np.int32),
                np.asarray(rows["start"]), np.asarray(rows["finish"]), None,
                np.asarray(rows["ready"]), np.asarray(rows["end"]), busy)


def _busy_within(intervals: np.ndarray, end: float) -> float:
  """Seconds of `intervals` ([start, end] rows) that lie within [0, end]."""
  return float(np.clip(np.minimum(intervals[:, 1], end) - np.minimum(intervals[:, 0], end), 0.0,
                       None).sum())


def _add_costs(result: SimResult, config: SimConfig, busy: Dict[str, np.ndarray]) -> None:
  """Per-role CPU per worker step and utilisation of the queued model, over the run's window."""
  end, pushes = result.seconds, max(1, result.pushes)
  ps = _busy_within(busy["ps"], end)
  coord = _busy_within(busy["coordinator"], end)
  result.ps_ms_per_step = 1e3 * ps * config.num_ps / pushes
  result.coordinator_ms_per_step = 1e3 * coord / pushes
  result.ps_utilisation = ps / (config.ps_cores * end)
  result.coordinator_utilisation = coord / (config.coordinator_cores * end)


def _blocked_seconds(ev: Events, end: float) -> float:
  """Time workers spent between pushing a step and starting the next (barriers), up to `end`."""
  return float(np.clip(np.minimum(ev.start, end) - np.minimum(ev.ready, end), 0.0, None).sum())


def _buffered(mode: str, config: SimConfig, ev: Events,
              buffer_config: gba_ops.BufferConfig, tokens_from_generator: bool) -> SimResult:
  """Cuts the run at steps x N pushes and replays fetches and pushes through the buffer rules."""
  target = config.steps * config.num_workers
  end = _cutoff(ev.finish, target)
  if tokens_from_generator:
    # Tokens are handed out in fetch order; every fetch before `end` was generated.
    fetch_order = _order(ev.start, ev.worker)
    tokens = np.empty(ev.start.size, np.int64)
    tokens[fetch_order] = logic.TokenLogic(buffer_config.num_aggregate).fetch_many(
        ev.start.size)
    ev.token = tokens
  done = np.flatnonzero(ev.finish <= end)
  push_order = done[_order(ev.finish[done], ev.worker[done])][:target]
  buf = logic.DenseBufferLogic(buffer_config)
  dec = buf.push_many(ev.token[push_order])
  kept = int(np.count_nonzero(dec.weight[dec.counted] != 0.0))
  result = _result(mode, config, end, push_order, ev)
  result.global_steps = buf.aggregations
  result.effective_qps = kept * config.local_batch_size / end
  result.mean_staleness = buf.mean_staleness
  result.max_staleness = buf.staleness_max
  result.staleness_histogram = [int(x) for x in buf.histogram]
  result.dropped_batches = buf.dropped
  result.blocked_seconds = _blocked_seconds(ev, end)
  result.extra = {"events": ev, "push_order": push_order, "decisions": dec, "buffer": buf}
  return result


def _result(mode, config, end, push_order, ev) -> SimResult:
  n = config.num_workers
  per_worker = np.bincount(ev.worker[push_order], minlength=n)
  # Busy time within [0, end]: every step's pull + compute + push, clipped at the end.
  d = np.clip(np.minimum(ev.end, end) - ev.start, 0.0, None)
  working = float(d[ev.start < end].sum())
  return SimResult(
      mode=mode, num_workers=n, num_ps=config.num_ps, seconds=float(end),
      pushes=int(push_order.size), global_steps=0,
      global_qps=push_order.size * config.local_batch_size / end, effective_qps=0.0,
      mean_staleness=0.0, max_staleness=0, staleness_histogram=[], dropped_batches=0,
      idle_fraction=max(0.0, 1.0 - working / (n * end)),
      per_worker_steps=[int(x) for x in per_worker])


def _sync(config: SimConfig, dur: _Durations) -> SimResult:
  n = config.num_workers
  workers = np.arange(n)
  t = 0.0
  tl = _Timeline()
  for s in range(config.steps):
    start = np.full(n, t)
    push, end = dur(workers, np.full(n, s), start)
    tl.add(workers, np.full(n, s), start, start + push, start, token=np.full(n, s),
           end=start + end)
    t += sync_seconds(end)
  ev = tl.events()
  order = _order(ev.finish, ev.worker)
  result = _result("sync", config, t, order, ev)
  result.global_steps = config.steps
  result.effective_qps = result.global_qps
  result.staleness_histogram = [order.size] + [0] * (config.histogram_bins - 1)
  result.extra = {"events": ev, "push_order": order}
  return result


def _hop_bw(config: SimConfig, dur: _Durations) -> SimResult:
  """Per-version barrier with N - b3 gradients per version; late ones are dropped on arrival."""
  n, target = config.num_workers, config.steps * config.num_workers
  need = n - config.b3
  workers = np.arange(n)
  tl = _Timeline()
  steps_started = np.zeros(n, np.int64)
  # Each worker either pushed on time for the current version and waits for the next one
  # (`waiting`), or is on an older version (late: its push is dropped). `free`: when it is free
  # after its last step (its push, unless the slowdown comes after the push).
  waiting = np.ones(n, bool)
  free = np.zeros(n)
  version_time = 0.0   # when the current version k became available
  k = 0
  finishes: List[np.ndarray] = []
  total = 0
  check_at = config.steps
  while True:
    # Candidates for version k: waiting workers start when it exists (and they are free), late
    # ones as soon as they are free. Version k + 1 exists once the (N - b3)-th candidate pushed;
    # a worker free only after that does not start on version k, and its candidate, later still,
    # does not change which are the first N - b3.
    start = np.where(waiting, np.maximum(version_time, free), free)
    push, end = dur(workers, steps_started, start)
    cand = start + push
    order = _order(cand, workers)
    next_time = float(cand[order[need - 1]])
    starts = start < next_time
    idx = np.flatnonzero(starts)
    tl.add(idx, steps_started[idx], start[idx], cand[idx], free[idx],
           token=np.full(idx.size, k), end=start[idx] + end[idx])
    finishes.append(cand[idx])
    total += idx.size
    steps_started[idx] += 1
    on_time = np.zeros(n, bool)
    on_time[order[:need]] = True
    waiting = on_time | (waiting & ~starts)
    free = np.where(starts, start + end, free)
    version_time = next_time
    k += 1
    if k >= check_at and total >= target:
      # Every step finishing before the newest version has started by now.
      if np.count_nonzero(np.concatenate(finishes) <= version_time) >= target:
        break
      check_at = k + max(1, k // 8)
  ev = tl.events()
  cfg = gba_ops.BufferConfig(num_aggregate=need, staleness_threshold=0, count_dropped=False,
                             per_id_staleness=False, histogram_bins=config.histogram_bins)
  result = _buffered("hop_bw", config, ev, cfg, tokens_from_generator=False)
  return result


def buffer_config(mode: str, config: SimConfig) -> gba_ops.BufferConfig:
  """The dense buffer each buffered mode runs (tf_gba.distribute.modes.buffer_config_for)."""
  bins = config.histogram_bins
  if mode == "gba":
    return gba_ops.BufferConfig(num_aggregate=config.m, staleness_threshold=config.iota,
                                histogram_bins=bins)
  m = {"async": 1, "bsp": config.b2, "hop_bs": config.num_workers}[mode]
  return gba_ops.BufferConfig(num_aggregate=m, staleness_threshold=gba_ops.NEVER_STALE,
                              histogram_bins=bins)


def simulate(mode: str, config: SimConfig) -> SimResult:
  """Simulates `mode` on `config`; see the module docstring."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
  dur = _Durations(config)
  if mode == "sync":
    return _sync(config, dur)
  if config.queued and mode in _QUEUED:
    cfg = buffer_config(mode, config)
    ev = _queued_free_running(config, dur, cfg.num_aggregate)
    result = _buffered(mode, config, ev, cfg, tokens_from_generator=True)
    _add_costs(result, config, ev.busy)
    return result
  if config.queued:
    raise ValueError(f"PS service times (ps_push_ms, ps_apply_ms) and the coordinator's costs "
                     f"(coord_ms_per_closure, coord_ms_per_step) are modelled for "
                     f"{', '.join(_QUEUED)} and sync (no PS, no coordinator), not {mode}: leave "
                     f"them at 0 for {mode}.")
  if mode == "hop_bw":
    return _hop_bw(config, dur)
  bound = config.hop_bs_bound if mode == "hop_bs" else None
  ev = _free_running(config, dur, bound)
  result = _buffered(mode, config, ev, buffer_config(mode, config),
                     tokens_from_generator=True)
  if mode == "hop_bs":
    result.max_lead = _max_lead(ev, result.seconds)
  return result


def _max_lead(ev: Events, end: float) -> int:
  """Largest (own finished steps - fewest finished steps of any worker) when a step starts."""
  # The fewest finished steps of any worker at time t is the number of s such that every worker
  # has finished its step s by t; a worker starting its step s has finished s steps.
  n_steps = int(ev.index.max()) + 1
  all_done = np.full(n_steps, -np.inf)
  np.maximum.at(all_done, ev.index, ev.end)
  all_done = np.maximum.accumulate(all_done)
  starts = ev.start <= end
  fewest = np.searchsorted(all_done, ev.start[starts], side="right")
  return int((ev.index[starts] - fewest).max())
