"""benchmarks/auto_mode.py's arithmetic: the trace's step times, the simulator's seconds for a mode
and for auto, where a switch fell on the training clock, and its flags. (The runs themselves are
real clusters of several minutes each; tests/training/test_auto_cluster.py runs auto's job.)"""

import argparse

import numpy as np
import pytest

from benchmarks import auto_mode


def _args(**kw):
  base = dict(slow_workers="0,1", factor=4.0, window_s=10.0, steps=4000, local_batch_size=8)
  base.update(kw)
  return argparse.Namespace(**base)


def test_trace_slows_the_named_workers_in_the_second_window_only():
  times = auto_mode.trace_step_seconds([0.1, 0.2, 0.3], [0, 2], 3.0, 10.0, 4.0, 8)
  # Interval middles: 2, 6, 10, 14, 18, 22, 26, 30 s; the window is [10, 20).
  want = np.array([[0.1, 0.2, 0.3]] * 8)
  want[2:5, 0] = 0.3
  want[2:5, 2] = 0.9
  np.testing.assert_allclose(times, want)


def _reference_seconds(times, interval, batch, target, eff, modes, switch_after=(), cost=0.0):
  """Seconds to `target` examples, walked example by example of each interval's rate."""
  n = times.shape[1]
  rates = []
  for t, m in zip(times, modes):
    rate = n * batch / t.max() if m == "sync" else batch * np.sum(1.0 / t)
    rates.append(rate * eff[m])
  done = np.cumsum(np.asarray(rates) * interval)
  i = int(np.searchsorted(done, target))
  before = done[i - 1] if i else 0.0
  return i * interval + cost * sum(1 for k in switch_after if k < i) + (target - before) / rates[i]


@pytest.mark.parametrize("mode", ["sync", "gba"])
def test_a_pure_mode_trains_the_target_at_its_model_rate_times_its_efficiency(mode):
  times = auto_mode.trace_step_seconds([0.1, 0.1, 0.1, 0.1], [0, 1], 4.0, 10.0, 2.0, 40)
  eff = {"sync": 0.7, "gba": 0.9}
  got = auto_mode.simulated_seconds(times, 2.0, 8, 5000.0, eff, [mode] * 40)
  assert got == pytest.approx(_reference_seconds(times, 2.0, 8, 5000.0, eff, [mode] * 40))
  with pytest.raises(ValueError, match="not 50000"):
    auto_mode.simulated_seconds(times, 2.0, 8, 50000.0, eff, [mode] * 40)


def test_switches_add_their_cost_only_before_the_target():
  times = np.full((30, 2), 0.1)
  eff = {"sync": 1.0, "gba": 1.0}
  modes = ["sync"] * 3 + ["gba"] * 27
  decisions = [{"interval": 2}, {"interval": 25}]  # the second after the target
  got = auto_mode.simulated_seconds(times, 1.0, 10, 2000.0, eff, modes, decisions, 7.0)
  assert got == pytest.approx(_reference_seconds(times, 1.0, 10, 2000.0, eff, modes, [2], 7.0))


def test_into_gba_in_the_window_and_back_after_it():
  into = {"from": "sync", "to": "gba", "training_s": 15.0}
  back = {"from": "gba", "to": "sync", "training_s": 25.0}
  assert auto_mode._into_gba_and_back([into, back], 10.0)
  assert not auto_mode._into_gba_and_back([into], 10.0)
  assert not auto_mode._into_gba_and_back([dict(into, training_s=5.0), back], 10.0)
  assert not auto_mode._into_gba_and_back([into, dict(back, training_s=18.0)], 10.0)


def _summary(stays, switches, efficiency, policy=None):
  base = {"margin": 0.3, "hysteresis": 0.15, "dwell_s": 0.0, "confirm": 1,
          "sync_efficiency": 1.0, "gba_efficiency": 1.0, "learn_efficiency": True,
          "switch_cost_s": 30.0, "horizon_s": 5.0, "probe_s": 0.0}
  base.update(policy or {})
  return {"stays": stays, "switches": switches, "efficiency": efficiency, "policy": base}


def test_simulate_reads_the_auto_run_and_replays_its_policy():
  # Two workers at 0.1 s, three observations of each of two stays (one slow observation), one
  # switch that cost 2 s; both modes measured at their model's rate.
  quiet, slow = [0.1, 0.1], [0.4, 0.1]
  stays = [{"step_seconds": [quiet, slow, quiet], "train_seconds": 8.0},
           {"step_seconds": [quiet, quiet, quiet], "train_seconds": 8.0}]
  switches = [{"from": "sync", "to": "gba", "trained_s_in_mode": 6.0, "cost_s": 2.0}]
  summary = _summary(stays, switches, {"sync": 1.0, "gba": 1.0})
  args = _args(slow_workers="0", window_s=10.0, steps=400, local_batch_size=8)
  sim = auto_mode.simulate(summary, args)
  assert sim["interval_s"] == pytest.approx(16.0 / 8)  # 6 observations + 2 first intervals
  np.testing.assert_allclose(sim["base_step_seconds"], [0.1, 0.1])
  assert sim["switch_cost_s"] == 2.0
  n = 400 * 8
  times = auto_mode.trace_step_seconds([0.1, 0.1], [0], 4.0, 10.0, 2.0, 200)
  eff = {"sync": 1.0, "gba": 1.0}
  for mode in ("sync", "gba"):
    assert sim[mode] == pytest.approx(_reference_seconds(times, 2.0, 8, n, eff, [mode] * 200))
  # Sync (160 QPS) needs 20 s: inside the window [10, 20) worker 0 slows Sync to 40 QPS, GBA
  # runs at 100, so auto moves to GBA once it sees the window (its first interval there is
  # observed: dwell 0, confirm 1) and is back to Sync only after it.
  assert sim["sync"] > sim["gba"]
  assert [(x["from"], x["to"]) for x in sim["auto_switches"]][:1] == [("sync", "gba")]
  assert 10.0 <= sim["auto_switches"][0]["training_s"] <= 14.0
  assert sim["gba"] < sim["auto"] < sim["sync"] + 2.0 * len(sim["auto_switches"])


def test_real_switches_are_placed_on_the_training_clock():
  stays = [{"train_seconds": 30.0}, {"train_seconds": 12.0}, {"train_seconds": 50.0}]
  switches = [{"from": "sync", "to": "gba", "trained_s_in_mode": 29.0},
              {"from": "gba", "to": "sync", "trained_s_in_mode": 11.5}]
  got = auto_mode.real_switches({"stays": stays, "switches": switches})
  assert [x["training_s"] for x in got] == [29.0, 41.5]


def test_no_floor_needs_steps(capsys):
  with pytest.raises(SystemExit):
    auto_mode.main(["--compute_ms=0", "--dry_run"])
  assert "--compute_ms=0 (no floor) needs --steps" in capsys.readouterr().err
  assert auto_mode.main(["--compute_ms=0", "--steps=800", "--dry_run"]) is None
