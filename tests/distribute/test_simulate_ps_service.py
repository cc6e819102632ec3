"""The simulator's parameter-server queue (`ps_push_ms`, `ps_apply_ms`): against a hand-computed
timeline, a NumPy FIFO reference written here, the saturation closed form, and the unqueued model
when the service times are 0."""

import numpy as np
import pytest

from tf_gba.simulate import SimConfig, simulate
from tf_gba.simulate import cluster


def _by_step(ev):
  order = np.lexsort((ev.index, ev.worker))
  return {(int(w), int(i)): (float(s), float(f)) for w, i, s, f in
          zip(ev.worker[order], ev.index[order], ev.start[order], ev.finish[order])}


def test_two_workers_by_hand():
  # Both compute 10 ms; a push takes 4 ms of the PS, the push completing a batch (M = 2) 3 ms
  # more. Worker 0 (served first at a tie) 10-14; worker 1 14-21 (completes); worker 0 back at
  # 24: 24-28; worker 1 back at 31: 31-38 (completes); worker 0 at 38: 38-42; worker 1 at 48:
  # 48-55.
  config = SimConfig(num_workers=2, steps=3, compute_ms=10, pull_ms=0, push_ms=0, latency_ms=0,
                     ps_push_ms=4, ps_apply_ms=3, gba_num_aggregate=2)
  r = simulate("gba", config)
  got = _by_step(r.extra["events"])
  want = {(0, 0): (0, 14), (1, 0): (0, 21), (0, 1): (14, 28), (1, 1): (21, 38), (0, 2): (28, 42),
          (1, 2): (38, 55)}
  for key, (start, finish) in want.items():
    assert got[key] == pytest.approx((start * 1e-3, finish * 1e-3), abs=1e-12), key
  assert r.pushes == 6 and r.global_steps == 3
  assert r.seconds == pytest.approx(0.055)
  # Tokens in fetch order: starts 0, 0, 14, 21, 28, 38 -> 0, 0, 1, 1, 2, 2.
  ev = r.extra["events"]
  assert [int(ev.token[np.flatnonzero((ev.worker == w) & (ev.index == i))[0]])
          for w, i in [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]] == [0, 0, 1, 1, 2, 2]


def _numpy_fifo(compute, pull, push, service, apply, m, num_ps, pushes):
  """A FIFO reference: per push, the worker whose push arrives first (lowest index at a tie) is
  served; returns {(worker, step): (start, finish)} in seconds."""
  n = compute.size
  start = np.zeros(n)
  arrival = start + pull + compute + push
  step = np.zeros(n, np.int64)
  free = 0.0
  out = {}
  for j in range(pushes):
    w = int(np.lexsort((np.arange(n), arrival))[0])
    finish = max(arrival[w], free) + service / num_ps
    if (j + 1) % m == 0:
      finish += apply / num_ps
    free = finish
    out[(w, int(step[w]))] = (float(start[w]), finish)
    step[w] += 1
    start[w] = finish
    arrival[w] = finish + pull + compute[w] + push
  return out


@pytest.mark.parametrize("num_ps", [1, 3])
@pytest.mark.parametrize("mode,m", [("gba", 6), ("async", 1), ("bsp", 2)])
def test_matches_numpy_fifo_reference(mode, m, num_ps):
  # Persistent stragglers: worker 0 twice as slow, worker 3 three times (deterministic factors).
  config = SimConfig(num_workers=6, steps=20, compute_ms=50, pull_ms=2, push_ms=3,
                     latency_ms=0.5, stragglers="persistent:2@0+persistent:3@3", num_ps=num_ps,
                     ps_push_ms=6, ps_apply_ms=9, bsp_aggregate=2)
  r = simulate(mode, config)
  compute = np.full(6, 0.050)
  compute[0] *= 2
  compute[3] *= 3
  pull = (0.5 + 2 / num_ps) * 1e-3
  push = (0.5 + 3 / num_ps) * 1e-3
  want = _numpy_fifo(compute, pull, push, 6e-3, 9e-3, m, num_ps, r.pushes)
  got = _by_step(r.extra["events"])
  for key, value in want.items():
    assert got[key] == pytest.approx(value, abs=1e-9), key
  assert r.seconds == pytest.approx(max(f for _, f in want.values()), abs=1e-9)


def test_zero_service_equals_the_unqueued_model():
  config = SimConfig(num_workers=8, steps=40, stragglers="compute:100+transient:0.1:4", seed=3)
  dur = cluster._Durations(config)  # pylint: disable=protected-access
  free = _by_step(cluster._free_running(config, dur, None))  # pylint: disable=protected-access
  queued = _by_step(cluster._queued_free_running(config, dur, 8))  # pylint: disable=protected-access
  common = set(free) & set(queued)
  assert len(common) >= 8 * 40
  for key in common:
    assert queued[key] == pytest.approx(free[key], abs=1e-12)


def test_saturated_ps_gives_the_closed_form_and_more_ps_lift_it():
  # 64 workers at 100 ms want 640 pushes/s; one PS serves 1 / (5 + 20 / 64) ms = 188 pushes/s.
  base = dict(num_workers=64, steps=60, compute_ms=100, pull_ms=0, push_ms=0, latency_ms=0,
              ps_push_ms=5, ps_apply_ms=20, local_batch_size=10)
  one = simulate("gba", SimConfig(num_ps=1, **base))
  capacity = 1000.0 / (5 + 20 / 64)
  assert one.global_qps == pytest.approx(capacity * 10, rel=0.01)
  two = simulate("gba", SimConfig(num_ps=2, **base))
  assert two.global_qps == pytest.approx(2 * capacity * 10, rel=0.01)
  # Enough PS: the workers' own limit, 64 x 10 / (100 ms + the service of their own push).
  many = simulate("gba", SimConfig(num_ps=64, **base))
  limit = simulate("gba", SimConfig(**{**base, "ps_push_ms": 0, "ps_apply_ms": 0}))
  assert many.global_qps <= limit.global_qps
  assert many.global_qps >= 0.9 * limit.global_qps
  # Workers of one speed: the FIFO queue serves pushes in the order their steps fetched tokens,
  # so a saturated PS adds waiting but no staleness.
  assert limit.mean_staleness == 0 and one.mean_staleness == 0


def test_bad_service_times_are_refused():
  with pytest.raises(ValueError, match="ps_push_ms must be >= 0"):
    SimConfig(ps_push_ms=-1)
  with pytest.raises(ValueError, match="not hop_bs"):
    simulate("hop_bs", SimConfig(num_workers=4, steps=2, ps_push_ms=1))
  # Sync (all-reduce) has no PS: unaffected.
  a = simulate("sync", SimConfig(num_workers=4, steps=5, ps_push_ms=1, ps_apply_ms=1))
  b = simulate("sync", SimConfig(num_workers=4, steps=5))
  assert a.global_qps == b.global_qps
