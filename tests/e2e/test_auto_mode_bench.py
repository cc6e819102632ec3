"""benchmarks/auto_mode.py's arithmetic: the trace's step times, the simulator's seconds for a mode
and for auto, where a switch fell on the training clock, and its flags. (The runs themselves are
real clusters of several minutes each; tests/training/test_auto_cluster.py runs auto's job.)"""

import argparse
import json

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
  stays = [{"mode": "sync", "step_seconds": [quiet, slow, quiet], "train_seconds": 8.0},
           {"mode": "gba", "step_seconds": [quiet, quiet, quiet], "train_seconds": 8.0}]
  switches = [{"from": "sync", "to": "gba", "trained_s_in_mode": 6.0, "cost_s": 2.0}]
  summary = _summary(stays, switches, {"sync": 1.0, "gba": 1.0})
  args = _args(slow_workers="0", window_s=10.0, steps=400, local_batch_size=8)
  sim = auto_mode.simulate(summary, args)
  assert sim["interval_s"] == pytest.approx(16.0 / 8)  # 6 observations + 2 first intervals
  for mode in ("sync", "gba"):
    np.testing.assert_allclose(sim["base_step_seconds"][mode], [0.1, 0.1])
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


def test_each_mode_is_simulated_from_its_own_step_times():
  # Sync's steps 10 ms, GBA's 30 ms (its parameter-server round trips); one slow Sync
  # observation among three. A mode's base is the median of its own stays' observations.
  stays = [{"mode": "sync", "step_seconds": [[0.01, 0.01], [0.04, 0.01], [0.01, 0.01]],
            "train_seconds": 4.0},
           {"mode": "gba", "step_seconds": [[0.03, 0.03]] * 3, "train_seconds": 4.0}]
  switches = [{"from": "sync", "to": "gba", "trained_s_in_mode": 3.0, "cost_s": 1.0}]
  summary = _summary(stays, switches, {"sync": 0.5, "gba": 0.8})
  args = _args(slow_workers="1", window_s=100.0, steps=2000, local_batch_size=8)
  sim = auto_mode.simulate(summary, args)
  np.testing.assert_allclose(sim["base_step_seconds"]["sync"], [0.01, 0.01])
  np.testing.assert_allclose(sim["base_step_seconds"]["gba"], [0.03, 0.03])
  # All before the window: Sync 2 x 8 / 0.01 x 0.5 = 800 QPS, GBA 8 x (2 / 0.03) x 0.8 = 426.7.
  assert sim["sync"] == pytest.approx(2000 * 8 / 800.0)
  assert sim["gba"] == pytest.approx(2000 * 8 / (8 * 2 / 0.03 * 0.8))
  # Only GBA's stay observed: Sync takes GBA's times.
  summary["stays"] = summary["stays"][1:]
  sim = auto_mode.simulate(summary, args)
  np.testing.assert_allclose(sim["base_step_seconds"]["sync"], [0.03, 0.03])


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


def test_report_only_reads_the_last_run_and_simulates_it_anew(tmp_path, capsys):
  stays = [{"mode": "sync", "step_seconds": [[0.1, 0.1]] * 3, "train_seconds": 8.0},
           {"mode": "gba", "step_seconds": [[0.1, 0.1]] * 3, "train_seconds": 8.0}]
  switches = [{"from": "sync", "to": "gba", "trained_s_in_mode": 6.0, "cost_s": 2.0,
               "at_step": 96}]
  (tmp_path / "auto_0").mkdir()
  (tmp_path / "auto_0" / "summary.json").write_text(
      json.dumps(_summary(stays, switches, {"sync": 1.0, "gba": 1.0})))

  def run(seconds, auc, **kw):
    return dict(command_seconds=seconds, train_seconds=seconds - 5, eval_auc=auc, global_qps=1.0,
                num_switches=None, switches=None, switch_seconds=None, **kw)

  row = {"seed": 0, "steps": 400, "sync": run(40.0, 0.70), "gba": run(30.0, 0.71),
         "auto": dict(run(32.0, 0.7005), num_switches=1, switches=switches, switch_seconds=2.0),
         "auto_vs_best": 32.0 / 30.0, "auto_auc_minus_sync": 0.0005}
  (tmp_path / "results.json").write_text(json.dumps([row]))
  rows = auto_mode.main(["--report_only", f"--out={tmp_path}", "--slow_workers=0",
                         "--window_s=10", "--local_batch_size=8"])
  out = capsys.readouterr().out
  assert "seed 0: auto / faster pure mode = 1.067 (<= 1.10: met)" in out
  assert "over the seeds' mean +0.0005 (>= -0.001: met)" in out
  assert "| 0 | auto | 29.0 | " in out  # training 27 s + the switch's 2 s
  assert rows[0]["simulated"]["switch_cost_s"] == 2.0
  assert rows[0]["auto_switches"] == [{"from": "sync", "to": "gba", "training_s": 6.0}]
  assert json.loads((tmp_path / "results.json").read_text())[0]["simulated"]["sync"] > 0


def test_observed_pairs_from_measured_qps_or_the_timeline():
  rows = [[0.01, 0.01], [0.02, 0.01]]
  with_qps = {"mode": "sync", "step_seconds": rows, "measured_qps": [800.0, 500.0]}
  # An older summary: the stay's timeline points, one per observed interval.
  from_timeline = {"mode": "gba", "step_seconds": rows, "start_seconds": 10.0, "seconds": 5.0,
                   "skipped_observations": 0}
  timeline = [{"mode": "sync", "seconds": 3.0, "qps": 1.0},
              {"mode": "gba", "seconds": 12.0, "qps": 600.0},
              {"mode": "gba", "seconds": 13.0, "qps": 700.0},
              {"mode": "sync", "seconds": 16.0, "qps": 1.0}]
  pairs = auto_mode.observed_pairs({"stays": [with_qps, from_timeline], "timeline": timeline})
  assert pairs["sync"] == [(rows[0], 800.0), (rows[1], 500.0)]
  assert pairs["gba"] == [(rows[0], 600.0), (rows[1], 700.0)]
  # Points that do not match the observations one to one: none taken.
  pairs = auto_mode.observed_pairs({"stays": [from_timeline], "timeline": timeline[:2]})
  assert pairs["gba"] == []
  skipped = dict(from_timeline, skipped_observations=1)
  pairs = auto_mode.observed_pairs({"stays": [skipped], "timeline": timeline})
  assert pairs["gba"] == []


def test_simulate_with_the_step_overhead_each_mode_measured():
  # Sync's observations: own steps 10 ms, measured at 2 x 8 / 0.03 (20 ms beyond the slowest
  # worker); GBA's: 30 ms, measured at 8 x 2 / 0.035 (5 ms beyond). Worker 1 is 4x slower in
  # [2, 4) s of a 3,000-step run.
  sync_rows, gba_rows = [[0.01, 0.01]] * 3, [[0.03, 0.03]] * 3
  stays = [{"mode": "sync", "step_seconds": sync_rows, "measured_qps": [16 / 0.03] * 3,
            "train_seconds": 4.0},
           {"mode": "gba", "step_seconds": gba_rows, "measured_qps": [16 / 0.035] * 3,
            "train_seconds": 4.0}]
  switches = [{"from": "sync", "to": "gba", "trained_s_in_mode": 3.0, "cost_s": 1.0}]
  summary = _summary(stays, switches, {"sync": 1 / 3, "gba": 0.03 / 0.035})
  args = _args(slow_workers="1", window_s=2.0, steps=3000, local_batch_size=8)
  sim = auto_mode.simulate(summary, args)
  assert sim["overhead_s"] == pytest.approx({"sync": 0.02, "gba": 0.005})
  interval = sim["interval_s"]
  n = 400
  times = auto_mode.trace_step_seconds([0.01, 0.01], [1], 4.0, 2.0, interval, n)
  rates = 2 * 8 / (times.max(axis=1) + 0.02)
  done = np.cumsum(rates * interval)
  i = int(np.searchsorted(done, 3000 * 8))
  want = i * interval + (3000 * 8 - (done[i - 1] if i else 0.0)) / rates[i]
  assert sim["sync"] == pytest.approx(want)
  # By efficiency the slow window costs Sync more: 1/3 of 2 x 8 / 0.04 there, not 2 x 8 / 0.06.
  assert sim["by_efficiency"]["sync"] > sim["sync"]
  assert set(sim["by_efficiency"]) >= {"sync", "gba", "auto", "auto_switches"}
