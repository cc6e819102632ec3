"""The --mode=auto switching policy: its throughput model against NumPy and the simulator; its
hysteresis, confirmation and dwell time on hand-made sequences of step times; the measured
efficiencies and the switch cost rule against hand-computed and NumPy references."""

import dataclasses

import numpy as np
import pytest

from tf_gba.simulate import SimConfig, predicted_qps, simulate
from tf_gba.simulate import auto as simulate_auto
from tf_gba.training.auto_policy import AutoPolicy, PolicyConfig, describe, expected_switch_cost


def reference(times: np.ndarray, batch: int):
  """Sync: each of S steps as long as its slowest worker; GBA: each worker at its own pace."""
  s, n = times.shape
  sync_time = sum(max(times[i, j] for j in range(n)) for i in range(s))
  gba_rate = sum(s / sum(times[i, j] for i in range(s)) for j in range(n))
  return s * n * batch / sync_time, gba_rate * batch


def test_prediction_matches_numpy_reference():
  rng = np.random.default_rng(3)
  for shape in ((1, 4), (7, 3), (20, 8)):
    times = rng.uniform(0.05, 0.5, size=shape)
    sync, gba = reference(times, 128)
    got = predicted_qps(times, 128)
    assert got["sync_qps"] == pytest.approx(sync, rel=1e-12)
    assert got["gba_qps"] == pytest.approx(gba, rel=1e-12)
    assert got["gain"] == pytest.approx(gba / sync, rel=1e-12)


def test_prediction_by_hand():
  # Two of four workers 4x slower: Sync runs at the slow pace, GBA at 1 + 1 + 1/4 + 1/4.
  got = predicted_qps([0.1, 0.1, 0.4, 0.4], 256)
  assert got["sync_qps"] == pytest.approx(4 * 256 / 0.4)
  assert got["gba_qps"] == pytest.approx(256 * (10 + 10 + 2.5 + 2.5))
  assert got["gain"] == pytest.approx(2.5)
  assert predicted_qps([0.2] * 5, 64)["gain"] == pytest.approx(1.0)


def test_prediction_is_the_simulators_model():
  # Persistent slowdowns, no communication: the simulator's Sync and GBA QPS are what the
  # policy predicts from the workers' step times (GBA: up to the run's last partial steps).
  profile = "persistent:3@1+persistent:2@2"
  cfg = SimConfig(num_workers=4, steps=2000, compute_ms=100, pull_ms=0, push_ms=0, latency_ms=0,
                  stragglers=profile, local_batch_size=256)
  times = np.array([0.1, 0.3, 0.2, 0.1])
  want = predicted_qps(times, 256)
  assert simulate("sync", cfg).global_qps == pytest.approx(want["sync_qps"], rel=1e-9)
  assert simulate("gba", cfg).global_qps == pytest.approx(want["gba_qps"], rel=2e-3)


def test_prediction_refuses_bad_times():
  with pytest.raises(ValueError, match="step times must be > 0"):
    predicted_qps([0.1, 0.0], 8)


def two_workers(gain: float):
  """Step times of two workers whose predicted gain is `gain`: (b/a + 1) / 2 = gain."""
  return [0.1, 0.1 * (2 * gain - 1)]


def model_qps(mode: str, times, batch=256) -> float:
  return predicted_qps(times, batch)["sync_qps" if mode == "sync" else "gba_qps"]


def observe(policy: AutoPolicy, trained_s, times, efficiency=1.0):
  """An observation whose measured QPS is `efficiency` x the current mode's model QPS."""
  return policy.observe(trained_s, times, efficiency * model_qps(policy.mode, times,
                                                                  policy.local_batch_size))


def run(policy: AutoPolicy, gains, start_s=100.0):
  """Feeds one observation per second, each mode at its model QPS; the index of the first
  switch, or None."""
  for i, g in enumerate(gains):
    if observe(policy, start_s + i, two_workers(g)) is not None:
      return i
  return None


# The rules of the model alone: efficiencies 1, switches free.
FREE = dict(switch_cost_s=0.0)


def test_sync_to_gba_needs_the_margin_and_confirmation():
  cfg = PolicyConfig(margin=0.3, hysteresis=0.15, dwell_s=0, confirm=2, **FREE)
  # Just under 1.3 never switches; 1.35 twice in a row does, at the second.
  assert run(AutoPolicy(cfg, "sync", 256), [1.29] * 10) is None
  assert run(AutoPolicy(cfg, "sync", 256), [1.0, 1.35, 1.35, 1.0]) == 2
  # An interruption resets the count.
  assert run(AutoPolicy(cfg, "sync", 256), [1.35, 1.0, 1.35, 1.0, 1.35]) is None
  decision = AutoPolicy(cfg, "sync", 256)
  run(decision, [1.4, 1.4])
  last = decision.observations[-1]
  assert last["predicted_gain"] == pytest.approx(1.4)
  assert last["per_worker_step_seconds"] == pytest.approx(two_workers(1.4))


def test_gba_to_sync_needs_sync_to_be_faster():
  cfg = PolicyConfig(margin=0.3, hysteresis=0.15, dwell_s=0, confirm=2, **FREE)
  # Each mode at its model QPS: GBA is never slower (model gain >= 1), so it stays, inside the
  # hysteresis band and below it: a switch to a mode expected no faster saves nothing.
  assert run(AutoPolicy(cfg, "gba", 256), [1.2] * 10) is None
  assert run(AutoPolicy(cfg, "gba", 256), [1.0] * 10) is None
  # GBA measured at 0.8 of its model, Sync expected at its model: at a model gain of 1.0 Sync is
  # 1 / 0.8 = 1.25x faster; the second agreeing observation goes back.
  policy = AutoPolicy(cfg, "gba", 256)
  assert observe(policy, 100, two_workers(1.0), efficiency=0.8) is None
  decision = observe(policy, 101, two_workers(1.0), efficiency=0.8)
  assert decision["from"] == "gba" and decision["to"] == "sync"
  assert decision["threshold"] == pytest.approx(1.15)
  assert decision["predicted_gain"] == pytest.approx(1.0)
  assert decision["expected_gain"] == pytest.approx(0.8)
  assert decision["saved_s"] == pytest.approx(60.0 * (1 / 0.8 - 1))
  # At 0.9 of its model and a model gain of 1.2 GBA is expected 1.08x Sync: it stays.
  assert run(AutoPolicy(cfg, "gba", 256), [1.2] * 10) is None
  policy = AutoPolicy(cfg, "gba", 256)
  assert all(observe(policy, 100 + i, two_workers(1.2), 0.9) is None for i in range(5))


def test_dwell_time():
  cfg = PolicyConfig(margin=0.3, hysteresis=0.15, dwell_s=10.0, confirm=1, **FREE)
  policy = AutoPolicy(cfg, "sync", 256)
  # Strong gains before 10 s in the mode: no switch; the first observation at 10 s switches.
  for t in (1.0, 5.0, 9.9):
    assert observe(policy, t, two_workers(3.0)) is None
  assert observe(policy, 10.0, two_workers(3.0))["to"] == "gba"
  # After the dwell time a gain that does not qualify still does not switch.
  assert observe(AutoPolicy(cfg, "sync", 256), 50.0, two_workers(1.2)) is None


@pytest.mark.parametrize("kwargs, flag", [
    (dict(margin=0.0), "--auto_margin"), (dict(margin=0.2, hysteresis=0.3), "--auto_hysteresis"),
    (dict(hysteresis=-0.1), "--auto_hysteresis"), (dict(dwell_s=-1), "--auto_dwell_s"),
    (dict(confirm=0), "--auto_confirm"), (dict(sync_efficiency=0), "--auto_sync_efficiency"),
    (dict(gba_efficiency=-1), "--auto_gba_efficiency"),
    (dict(switch_cost_s=-1), "--auto_switch_cost_s"), (dict(horizon_s=0), "--auto_horizon_s"),
    (dict(probe_s=-1), "--auto_probe_s"), (dict(measure_s=-1), "--auto_measure_s"),
    (dict(probe_s=5, learn_efficiency=False), "--noauto_learn_efficiency")])
def test_bad_parameters(kwargs, flag):
  with pytest.raises(ValueError, match=flag):
    PolicyConfig(**kwargs)


def test_unknown_mode():
  with pytest.raises(ValueError, match="between 'sync' and 'gba'"):
    AutoPolicy(PolicyConfig(), "async", 8)


def test_config_refuses_another_global_batch():
  from tf_gba.training.config import TrainConfig  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="--mode=auto trains Sync's global batch"):
    TrainConfig(mode="auto", num_workers=4, local_batch_size=64, global_batch_size=512).validate()
  with pytest.raises(ValueError, match="--auto_confirm"):
    TrainConfig(mode="auto", auto_confirm=0).validate()


def reference_decision(mode, times, measured_qps, efficiency, cost, horizon, enter, leave,
                       batch=256):
  """The rule written out with NumPy: (expected gain, time saved, whether it switches)."""
  t = np.asarray(times, np.float64)
  model = {"sync": len(t) * batch / t.max(), "gba": batch * np.sum(1.0 / t)}
  other = "gba" if mode == "sync" else "sync"
  return reference_rule(mode, {mode: measured_qps, other: model[other] * efficiency[other]},
                        cost, horizon, enter, leave)


def reference_rule(mode, expected, cost, horizon, enter, leave):
  """The rule on both modes' expected QPS: (expected gain, time saved, whether it switches)."""
  other = "gba" if mode == "sync" else "sync"
  gain = expected["gba"] / expected["sync"]
  saved = horizon * (expected[other] / expected[mode] - 1.0)
  wants = gain >= enter if mode == "sync" else gain < leave
  return gain, saved, bool(wants and saved > cost)


def test_measured_efficiency_by_hand():
  # The quiet cluster with a 100 ms floor measured on this machine: four equal workers, Sync
  # measured at 7,400 QPS (model 4 x 256 / 0.1 = 10,240), GBA known to reach 0.85 of its model.
  cfg = PolicyConfig(margin=0.1, hysteresis=0.05, dwell_s=0, confirm=1, switch_cost_s=20.0,
                     horizon_s=120.0)
  policy = AutoPolicy(cfg, "sync", 256, efficiency={"gba": 0.85})
  decision = policy.observe(30.0, [0.1] * 4, 7400.0)
  # Expected GBA: 10,240 x 0.85 = 8,704; gain 8,704 / 7,400 = 1.1762 >= 1.1; saves
  # 120 x 0.1762 = 21.15 s > 20 s: switches.
  assert decision is not None and decision["to"] == "gba"
  assert decision["predicted_gain"] == pytest.approx(1.0)
  assert decision["expected_gba_qps"] == pytest.approx(8704.0)
  assert decision["expected_gain"] == pytest.approx(8704.0 / 7400.0)
  assert decision["efficiency"] == pytest.approx(7400.0 / 10240.0)
  assert decision["saved_s"] == pytest.approx(120.0 * (8704.0 / 7400.0 - 1.0))
  # The same with a switch that costs 25 s: not worth it.
  costly = AutoPolicy(cfg, "sync", 256, {"gba": 0.85}, [25.0])
  assert costly.observe(30.0, [0.1] * 4, 7400.0) is None
  # No compute floor: Sync measured 27,650, GBA 23,311 at the same step times: Sync's efficiency
  # is higher, and in GBA the job wants Sync back.
  times = [0.03, 0.032, 0.031, 0.033]
  sync_model, gba_model = model_qps("sync", times), model_qps("gba", times)
  eff = {"sync": 27650.0 / sync_model}
  policy = AutoPolicy(cfg, "gba", 256, eff, [5.0])
  decision = policy.observe(40.0, times, 23311.0)
  assert decision is not None and decision["to"] == "sync"
  assert decision["expected_sync_qps"] == pytest.approx(27650.0)
  assert decision["efficiency"] == pytest.approx(23311.0 / gba_model)


def test_decisions_match_numpy_reference():
  rng = np.random.default_rng(7)
  cfg = PolicyConfig(margin=0.2, hysteresis=0.1, dwell_s=0, confirm=1, horizon_s=90.0)
  switched = stayed = 0
  for _ in range(300):
    mode = "sync" if rng.random() < 0.5 else "gba"
    times = rng.uniform(0.05, 0.4, size=int(rng.integers(2, 9)))
    efficiency = {"sync": rng.uniform(0.3, 1.0), "gba": rng.uniform(0.3, 1.0)}
    own_model = model_qps(mode, times)
    measured = own_model * rng.uniform(0.3, 1.0)
    cost = rng.uniform(0.0, 60.0)
    gain, saved, switch = reference_decision(mode, times, measured, efficiency, cost, 90.0,
                                             1.2, 1.1)
    policy = AutoPolicy(cfg, mode, 256, efficiency, [cost])
    got = policy.observe(10.0, times, measured)
    record = policy.observations[-1]
    assert record["expected_gain"] == pytest.approx(gain, rel=1e-12)
    assert record["saved_s"] == pytest.approx(saved, rel=1e-9, abs=1e-9)
    assert record["efficiency"] == pytest.approx(measured / own_model, rel=1e-12)
    assert (got is not None) == switch
    switched += switch
    stayed += not switch
  assert switched > 20 and stayed > 20  # both outcomes exercised


def test_horizon_is_at_least_the_dwell_time():
  cfg = PolicyConfig(margin=0.1, hysteresis=0.05, dwell_s=200.0, confirm=1, horizon_s=10.0,
                     switch_cost_s=50.0)
  policy = AutoPolicy(cfg, "sync", 256, {"gba": 1.0})
  # Gain 1.5 (two workers, one 2x slower): saves 200 x 0.5 = 100 s > 50 s (over 10 s: 5 s).
  assert policy.observe(250.0, [0.1, 0.2], model_qps("sync", [0.1, 0.2]))["saved_s"] == (
      pytest.approx(100.0))


def test_stay_efficiency_is_the_mean_of_its_observations():
  policy = AutoPolicy(PolicyConfig(dwell_s=1e9), "gba", 256)
  effs = [0.8, 0.9, 0.7]
  times = [[0.1, 0.2], [0.12, 0.1], [0.3, 0.3]]
  for i, (e, t) in enumerate(zip(effs, times)):
    observe(policy, i, t, e)
  assert policy.stay_efficiency() == pytest.approx(np.mean(effs))
  assert AutoPolicy(PolicyConfig(), "sync", 8).stay_efficiency() is None


def test_interval_without_timed_steps_is_skipped():
  # Workers whose steps carry no timing op report 0 s: not an observation, never an error.
  policy = AutoPolicy(PolicyConfig(dwell_s=0, confirm=1, **FREE), "sync", 256)
  assert policy.observe(5.0, [[0.0, 0.0, 0.0, 0.0]], 1000.0) is None
  assert policy.observe(6.0, [0.1, float("nan")], 1000.0) is None
  assert policy.observe(7.0, [0.1, 0.1], 0.0) is None
  assert policy.skipped == 3 and not policy.observations


def test_policy_round_trips_through_a_dict():
  cfg = PolicyConfig(margin=0.2, hysteresis=0.1, gba_efficiency=0.6, switch_cost_s=12.0)
  policy = AutoPolicy(cfg, "sync", 64, {"sync": 0.7}, [8.0], 123.0,
                      overhead_s={"gba": 0.031}, base_step_s={"gba": 0.012})
  again = AutoPolicy.from_dict(policy.to_dict())
  assert again.overhead_s == {"gba": 0.031} and again.base_step_s == {"gba": 0.012}
  assert again.config == cfg and again.mode == "sync" and again.local_batch_size == 64
  assert again.efficiency == {"sync": 0.7, "gba": 0.6} and again.switch_cost_s == 8.0
  assert again.decided_unix == 123.0


def test_simulator_replays_the_policys_decisions():
  # Four workers at a 100 ms floor; workers 0 and 1 4x slower in intervals 10-19. Measured
  # efficiencies: Sync 0.75 of its model, GBA 0.85; a switch costs 20 s.
  quiet, slow = [0.1] * 4, [0.4, 0.4, 0.1, 0.1]
  intervals = [quiet] * 10 + [slow] * 10 + [quiet] * 10
  eff = {"sync": 0.75, "gba": 0.85}
  rule = dict(margin=0.1, hysteresis=0.05, dwell_s=0.0, confirm=1)

  def policy_decisions(horizon_s):
    """AutoPolicy fed the same intervals, a new policy per stay, its first interval skipped."""
    cfg = PolicyConfig(horizon_s=horizon_s, switch_cost_s=20.0, **rule)
    mode, policy, out = "sync", None, []
    for i, times in enumerate(intervals):
      if policy is None:
        policy = AutoPolicy(cfg, mode, 256, eff, [20.0])
        continue
      d = observe(policy, float(i), times, eff[mode])
      if d is not None:
        out.append((i, d["from"], d["to"], d["expected_gain"]))
        mode, policy = d["to"], None
    return out

  for horizon_s in (60.0, 200.0):
    got = simulate_auto.replay(intervals, 5.0, 256, eff, 20.0, horizon_s=horizon_s, **rule)
    want = policy_decisions(horizon_s)
    assert [(d["interval"], d["from"], d["to"]) for d in got.decisions] == [w[:3] for w in want]
    assert [d["expected_gain"] for d in got.decisions] == pytest.approx([w[3] for w in want])
  # By hand, over 60 s: quiet Sync expects GBA at 8,704 / 7,680 = 1.133 (saves 8 s < 20 s):
  # stays; in the window GBA's 6,400 x 0.85 = 5,440 against Sync's 1,920 (saves 110 s): switches
  # at the window's first interval (10), and GBA (8,704 quiet) never goes back to Sync (7,680).
  got = simulate_auto.replay(intervals, 5.0, 256, eff, 20.0, horizon_s=60.0, **rule)
  (only,) = got.decisions
  assert (only["interval"], only["from"], only["to"]) == (10, "sync", "gba")
  assert only["expected_gain"] == pytest.approx(5440.0 / 1920.0)
  assert only["saved_s"] == pytest.approx(60.0 * (5440.0 / 1920.0 - 1))
  assert got.modes == ["sync"] * 11 + ["gba"] * 19
  assert got.seconds == pytest.approx(30 * 5.0 + 20.0)
  assert got.examples == pytest.approx(5.0 * (10 * 7680 + 1920 + 9 * 5440 + 10 * 8704))
  # Over 200 s the quiet Sync's 13 % pays for 20 s (saves 26.7 s): GBA from the first
  # observation (interval 1), and it stays.
  got = simulate_auto.replay(intervals, 5.0, 256, eff, 20.0, horizon_s=200.0, **rule)
  assert [(d["interval"], d["to"]) for d in got.decisions] == [(1, "gba")]
  assert got.decisions[0]["saved_s"] == pytest.approx(200.0 * (8704.0 / 7680.0 - 1))


def test_simulator_replays_each_modes_own_step_times():
  # A GBA step's own time is 3x a Sync step's (its parameter-server round trips); efficiencies
  # are each mode's measured QPS over its model from its own times. Workers 0 and 1 4x slower
  # in intervals 10-19.
  def trace(base):
    quiet, slow = [base] * 4, [4 * base, 4 * base, base, base]
    return [quiet] * 10 + [slow] * 10 + [quiet] * 10

  times = {"sync": trace(0.1), "gba": trace(0.3)}
  eff = {"sync": 0.75, "gba": 0.85}
  rule = dict(margin=0.1, hysteresis=0.05, dwell_s=0.0, confirm=1)
  cfg = PolicyConfig(horizon_s=60.0, switch_cost_s=20.0, **rule)
  mode, policy, want, base = "sync", None, [], {}
  for i in range(30):  # the job: it sees the current mode's own step times only
    if policy is None:
      policy = AutoPolicy(cfg, mode, 256, eff, [20.0], base_step_s=base)
      continue
    d = observe(policy, float(i), times[mode][i], eff[mode])
    if d is not None:
      want.append((i, d["from"], d["to"], round(d["other_step_scale"], 6)))
      base = dict(base, **{mode: policy.stay_base_step_s()})  # as auto_job learns it
      mode, policy = d["to"], None
  got = simulate_auto.replay(times, 5.0, 256, eff, 20.0, horizon_s=60.0, **rule)
  assert [(d["interval"], d["from"], d["to"], round(d["step_scale"], 6))
          for d in got.decisions] == want
  # By hand: quiet Sync (7,680) expects GBA at 10,240 x 0.85 = 8,704 from Sync's own times (GBA
  # not visited: scale 1): saves 8 s < 20 s, stays; in the window Sync measures 1,920 and
  # expects GBA at 6,400 x 0.85 = 5,440: switches at interval 10. In GBA, Sync's times are GBA's
  # x 0.1 / 0.3 (the fastest workers' step times): in the window [0.4, 0.4, 0.1, 0.1], Sync
  # expected at 2,560 x 0.75 = 1,920 against GBA's 256 x (2 / 1.2 + 2 / 0.3) x 0.85 = 1,813:
  # it wants Sync, but 60 s x (1,920 / 1,813 - 1) = 3.5 s saved < 20 s; after the window GBA
  # measures 2,901 against Sync's 7,680: back to Sync at interval 20, where GBA is expected at
  # 3,413 x 0.85 = 2,901 from Sync's times x 3: it stays.
  assert want == [(10, "sync", "gba", 1.0), (20, "gba", "sync", round(1 / 3, 6))]
  assert got.modes == ["sync"] * 11 + ["gba"] * 10 + ["sync"] * 9
  gba_quiet, gba_slow = 256 * 4 / 0.3 * 0.85, 256 * (2 / 1.2 + 2 / 0.3) * 0.85
  assert got.examples == pytest.approx(
      5.0 * (10 * 7680 + 1920 + 9 * gba_slow + gba_quiet + 9 * 7680))


def test_other_modes_step_times_are_scaled_by_the_base_step_times():
  # In GBA with Sync's base step time known (0.01 s) and this stay's fastest worker at 0.03 s
  # (the median over its observations, this one included): Sync predicted from these times
  # x 1/3, by a NumPy reference of the model (Sync paced by the slowest, GBA the sum of rates).
  cfg = PolicyConfig(switch_cost_s=0.0, dwell_s=0.0, confirm=1)
  policy = AutoPolicy(cfg, "gba", 100, {"sync": 0.8, "gba": 0.9}, base_step_s={"sync": 0.01})
  observed = [[0.03, 0.031, 0.05], [0.029, 0.04, 0.06], [0.032, 0.033, 0.09]]
  for i, t in enumerate(observed):
    measured = 0.9 * 100 * np.sum(1.0 / np.asarray(t))
    d = policy.observe(float(i), t, measured)
    base_gba = np.median([min(o) for o in observed[:i + 1]])
    scale = 0.01 / base_gba
    sync_expected = 0.8 * 3 * 100 / (max(t) * scale)
    rec = policy.observations[-1]
    assert rec["other_step_scale"] == pytest.approx(scale)
    assert rec["expected_sync_qps"] == pytest.approx(sync_expected)
    assert rec["expected_gain"] == pytest.approx(measured / sync_expected)
    # The model's gain is still that of these times alone (what the simulator predicts).
    assert rec["predicted_gain"] == pytest.approx(np.sum(1.0 / np.asarray(t)) * max(t) / 3)
  assert policy.stay_base_step_s() == pytest.approx(0.03)
  # Before the other mode has had a stay: scale 1.
  fresh = AutoPolicy(cfg, "gba", 100, {"sync": 0.8, "gba": 0.9})
  fresh.observe(0.0, observed[0], 1000.0)
  assert fresh.observations[-1]["other_step_scale"] == 1.0
  assert fresh.observations[-1]["expected_sync_qps"] == pytest.approx(0.8 * 300 / 0.05)
  # The known base step times travel with the policy.
  assert AutoPolicy.from_dict(policy.to_dict()).base_step_s == {"sync": 0.01}


def test_base_step_time_kept_as_it_comes_is_numpys_median_of_the_fastest():
  rng = np.random.default_rng(7)
  base = simulate_auto.BaseStepSeconds()
  assert base.value() is None
  rows = []
  # Ties and repeated values too: the two heaps must agree with a sort at every count.
  for _ in range(301):
    row = np.round(rng.uniform(0.005, 0.05, size=4), 3)
    rows.append(row)
    base.add(row)
    assert len(base) == len(rows)
    assert base.value() == pytest.approx(np.median([r.min() for r in rows]))


def test_an_observation_does_not_rescan_the_stay(monkeypatch):
  # Each observation needs the stay's base step time so far; it is kept as observations come,
  # not recomputed from all of them (which made a long stay's observations ever slower).
  calls = []
  real_add = simulate_auto.BaseStepSeconds.add
  monkeypatch.setattr(simulate_auto.BaseStepSeconds, "add",
                      lambda self, t: (calls.append(1), real_add(self, t))[1])
  policy = AutoPolicy(PolicyConfig(), "sync", 100, {"sync": 0.8, "gba": 0.9})
  for i in range(500):
    policy.observe(float(i), [0.01, 0.012, 0.011], 20000.0)
  assert len(calls) == 500
  assert policy.stay_base_step_s() == pytest.approx(0.01)


def test_switch_cost_accounting_by_hand():
  from tf_gba.training import auto_job  # pylint: disable=g-import-not-at-top
  cfg = PolicyConfig(switch_cost_s=30.0)
  # Before any measured switch: the configured estimate; then the mean of the last two.
  assert expected_switch_cost(cfg, []) == 30.0
  switches = [{"cost_s": 12.0}, {"cost_s": 49.0}, {"cost_s": 20.0}, {"cost_s": None}]
  assert auto_job.switch_costs(switches) == [12.0, 49.0, 20.0]
  assert expected_switch_cost(cfg, auto_job.switch_costs(switches)) == pytest.approx(34.5)
  # A stay's policy measures the switch into it at its first interval's end, and uses it.
  policy = AutoPolicy(cfg, "gba", 8, costs=[12.0], decided_unix=1000.0)
  assert policy.switch_cost_s == 12.0
  policy.started(1026.0)
  assert policy.costs == [12.0, 26.0] and policy.switch_cost_s == pytest.approx(19.0)
  policy.started(2000.0)  # only the first interval is the switch's
  assert policy.costs == [12.0, 26.0]
  assert AutoPolicy(cfg, "sync", 8).switch_cost_s == 30.0
  # Decided at 100 s; the Sync stay began its checkpoint at 101, saved at 103, was gone at 110;
  # the next stay was called at 110.2, trained from 121 and ended its first interval at 126.
  switch = {"decided_unix": 100.0, "checkpoint_begin_unix": 101.0, "saved_unix": 103.0,
            "returned_unix": 110.0, "next_call_unix": 110.2, "cost_s": None}
  auto_job.account_switch(switch, {"train_begin_unix": 121.0, "first_interval_end_unix": 126.0})
  assert switch["cost_s"] == pytest.approx(26.0)
  assert switch["cost_breakdown_s"] == pytest.approx({
      "end_stay_s": 10.0, "start_s": 10.8, "first_interval_s": 5.0, "to_checkpoint_s": 1.0,
      "checkpoint_s": 2.0, "exit_s": 7.0})
  # A next stay that ended before its first observation leaves the cost unmeasured.
  unmeasured = dict(switch, cost_s=None)
  del unmeasured["cost_breakdown_s"]
  auto_job.account_switch(unmeasured, {"train_begin_unix": 121.0,
                                       "first_interval_end_unix": None})
  assert unmeasured["cost_s"] is None and "cost_breakdown_s" not in unmeasured


def test_held_efficiencies_predict_the_current_mode_too():
  # --noauto_learn_efficiency: the measured QPS does not enter the decision (recorded only).
  cfg = PolicyConfig(margin=0.1, hysteresis=0.05, dwell_s=0, confirm=1, switch_cost_s=10.0,
                     learn_efficiency=False, sync_efficiency=0.8, gba_efficiency=0.6)
  times = [0.1, 0.25]  # model: Sync 2 x 256 / 0.25 = 2,048; GBA 256 x 14 = 3,584
  for measured in (100.0, 5000.0):
    policy = AutoPolicy(cfg, "sync", 256, {"sync": 0.3})  # a held value given by the job
    decision = policy.observe(5.0, times, measured)
    assert decision["expected_sync_qps"] == pytest.approx(2048 * 0.3)
    assert decision["expected_gba_qps"] == pytest.approx(3584 * 0.6)
    assert decision["expected_gain"] == pytest.approx(3584 * 0.6 / (2048 * 0.3))
    assert decision["efficiency"] == pytest.approx(measured / 2048)


def test_switch_cost_breakdown_of_every_moment_by_hand():
  from tf_gba.training import auto_job  # pylint: disable=g-import-not-at-top
  # Decided at 100 s; checkpoint begun at 100.5, written at 102, processes gone at 104; the next
  # stay called at 104.5, its processes up at 120, restored at 131, training from 133, its first
  # worker step at 140 (tracing) and its first interval over at 146.
  switch = {"decided_unix": 100.0, "checkpoint_begin_unix": 100.5, "saved_unix": 102.0,
            "returned_unix": 104.0, "next_call_unix": 104.5, "cost_s": None}
  info = {"started_unix": 120.0, "restored_unix": 131.0, "train_begin_unix": 133.0,
          "first_step_unix": 140.0, "first_interval_end_unix": 146.0}
  auto_job.account_switch(switch, info)
  assert switch["cost_s"] == pytest.approx(46.0)
  assert switch["cost_events_s"] == pytest.approx({
      "checkpoint_begin": 0.5, "checkpoint_written": 2.0, "processes_exited": 4.0,
      "next_stay_called": 4.5, "started": 20.0, "restored": 31.0, "train_begin": 33.0,
      "first_step": 40.0, "first_interval_end": 46.0})
  breakdown = switch["cost_breakdown_s"]
  assert breakdown == pytest.approx({
      "end_stay_s": 4.0, "to_checkpoint_s": 0.5, "checkpoint_s": 1.5, "exit_s": 2.0,
      "start_s": 28.5, "processes_s": 15.5, "restore_s": 11.0, "to_train_s": 2.0,
      "first_interval_s": 13.0, "to_first_step_s": 7.0, "first_steps_s": 6.0})
  # The three parts and the call between the stays (0.5 s) add up to the cost.
  assert (breakdown["end_stay_s"] + 0.5 + breakdown["start_s"] + breakdown["first_interval_s"]
          == pytest.approx(switch["cost_s"]))
  assert auto_job.describe_breakdown(breakdown) == (
      "end stay 4.0 (to checkpoint 0.5, checkpoint 1.5, exit 2.0), start 28.5 (processes 15.5, "
      "restore 11.0, to train 2.0), first interval 13.0 (to first step 7.0, first steps 6.0)")
  # A first step outside the stay's first interval (a counter from before it) is left out.
  early = dict(switch, cost_s=None)
  auto_job.account_switch(early, dict(info, first_step_unix=90.0))
  assert "first_step" not in early["cost_events_s"]
  assert "to_first_step_s" not in early["cost_breakdown_s"]
  assert early["cost_breakdown_s"]["first_interval_s"] == pytest.approx(13.0)
  assert auto_job.describe_breakdown({"end_stay_s": 1.0, "start_s": 2.0}) == (
      "end stay 1.0, start 2.0")


def test_probe_stays_by_hand():
  cfg = PolicyConfig(margin=0.1, hysteresis=0.05, dwell_s=100.0, confirm=2, switch_cost_s=20.0,
                     horizon_s=200.0, probe_s=10.0)
  quiet = [0.1] * 4  # model: Sync 4 x 256 / 0.1 = GBA 256 x 40 = 10,240
  # The first stay, a probe of Sync: nothing before 10 s, even at a gain that pays ...
  first = AutoPolicy(cfg, "sync", 256, probe="first")
  assert observe(first, 5.0, [0.1, 0.1, 0.4, 0.4], 0.75) is None
  # ... then GBA, after one observation, at a gain of 1 (a Sync stay would not switch).
  decision = observe(first, 10.0, quiet, 0.75)
  assert decision["probe"] is True and (decision["from"], decision["to"]) == ("sync", "gba")
  assert decision["expected_gain"] == pytest.approx(10240.0 / 7680.0)
  assert observe(AutoPolicy(cfg, "sync", 256), 10.0, quiet, 0.75) is None
  # The second stay, GBA measured at 0.5 of its model against Sync's 0.75: expected gain
  # 5,120 / 7,680 = 0.667 < 1.05, saves 200 x (7,680 / 5,120 - 1) = 100 s > 20 s: back to Sync
  # after probe_s (10 s) and `confirm` observations, not after dwell_s (100 s).
  second = AutoPolicy(cfg, "gba", 256, {"sync": 0.75}, [20.0], probe="second")
  assert observe(second, 6.0, quiet, 0.5) is None  # one agreeing observation
  back = observe(second, 11.0, quiet, 0.5)
  assert back["probe"] is False and back["to"] == "sync"
  assert back["expected_gain"] == pytest.approx(5120.0 / 7680.0)
  assert back["saved_s"] == pytest.approx(100.0)
  plain = AutoPolicy(cfg, "gba", 256, {"sync": 0.75}, [20.0])
  assert observe(plain, 6.0, quiet, 0.5) is None and observe(plain, 11.0, quiet, 0.5) is None
  # GBA measured at 0.85 instead: gain 8,704 / 7,680 = 1.133, not below 1.05: it stays.
  stays = AutoPolicy(cfg, "gba", 256, {"sync": 0.75}, [20.0], probe="second")
  assert all(observe(stays, t, quiet, 0.85) is None for t in (6.0, 11.0, 16.0, 200.0))
  # The role travels to the Sync workers with the rest of the policy.
  assert AutoPolicy.from_dict(second.to_dict()).probe == "second"
  with pytest.raises(ValueError, match="probe"):
    AutoPolicy(cfg, "sync", 256, probe="third")


def job_decisions(intervals, eff, assumed, cfg, overhead_s=None):
  """AutoPolicy fed `intervals` as the job (auto_job.run) feeds it: a new policy per stay, its
  first interval skipped, each mode measured at its true efficiency `eff` (or, with
  `overhead_s`, at the model on its step times plus that overhead), its efficiency, step
  overhead and base step time known to the next stays from its last stay (`assumed` before),
  the first stay a probe with cfg.probe_s and a mode's first stay after another 'second'.
  `intervals`: [N] step times per interval, or {mode: [intervals, N]}, each mode's own."""
  per_mode = intervals if isinstance(intervals, dict) else {"sync": intervals, "gba": intervals}
  mode, policy, out, known, visited, in_mode = "sync", None, [], dict(assumed), [], 0.0
  overhead, base = {}, {}
  for i in range(len(per_mode["sync"])):
    times = per_mode[mode][i]
    in_mode += 5.0  # seconds trained in this mode at the interval's end
    if policy is None:
      probe = None
      if cfg.probe_s > 0 and not visited:
        probe = "first"
      elif visited and mode not in visited:
        probe = "second"
      policy = AutoPolicy(cfg, mode, 256, known, [cfg.switch_cost_s], probe=probe,
                          base_step_s=base, overhead_s=overhead)
      visited.append(mode)
      continue
    if overhead_s is None:
      d = observe(policy, in_mode, times, eff[mode])
    else:
      d = policy.observe(in_mode, times,
                         simulate_auto.stretched_qps(times, 256, mode, overhead_s[mode]))
    if d is not None:
      out.append((i, d["from"], d["to"], d["expected_gain"], d["probe"]))
      known[mode] = policy.stay_efficiency()
      overhead[mode] = policy.stay_overhead_s()
      base[mode] = policy.stay_base_step_s()
      mode, policy, in_mode = d["to"], None, 0.0
  return out


def test_simulator_replays_the_probe_and_the_learned_efficiencies():
  # 60 quiet intervals of 5 s (four workers at 100 ms): Sync reaches 0.75 of its model, GBA 0.85,
  # but the job assumes GBA at 0.5 before it has run it. A switch costs 20 s.
  quiet = [[0.1] * 4] * 60
  eff, assumed = {"sync": 0.75, "gba": 0.85}, {"sync": 1.0, "gba": 0.5}
  rule = dict(margin=0.1, hysteresis=0.05, dwell_s=0.0, confirm=1, horizon_s=200.0)
  # Without a probe the job expects GBA at 5,120 against Sync's measured 7,680: it never tries.
  plain = simulate_auto.replay(quiet, 5.0, 256, eff, 20.0, assumed_efficiency=assumed, **rule)
  assert plain.decisions == [] and plain.modes == ["sync"] * 60
  assert plain.examples / plain.seconds == pytest.approx(7680.0)
  # A 10-s probe: Sync's first observation (interval 1, 10 s in) hands over to GBA, which
  # measures 8,704 against Sync's 7,680 (gain 1.133 >= 1.05) and stays: 20 s lost once, then
  # 13 % faster.
  probed = simulate_auto.replay(quiet, 5.0, 256, eff, 20.0, assumed_efficiency=assumed,
                                probe_s=10.0, **rule)
  assert [(d["interval"], d["to"], d["probe"]) for d in probed.decisions] == [(1, "gba", True)]
  assert probed.modes == ["sync"] * 2 + ["gba"] * 58
  assert probed.seconds == pytest.approx(300.0 + 20.0)
  assert probed.examples == pytest.approx(5.0 * (2 * 7680 + 58 * 8704))
  assert probed.examples / probed.seconds > plain.examples / plain.seconds
  # GBA truly at 0.5: the probe finds it slower and goes back after probe_s, not dwell_s.
  slow = {"sync": 0.75, "gba": 0.5}
  back = simulate_auto.replay(quiet, 5.0, 256, slow, 20.0, assumed_efficiency=assumed,
                              probe_s=10.0, **dict(rule, dwell_s=100.0))
  assert [(d["interval"], d["to"], d["probe"]) for d in back.decisions] == [
      (1, "gba", True), (3, "sync", False)]
  assert back.decisions[1]["saved_s"] == pytest.approx(200.0 * (7680.0 / 5120.0 - 1))
  # The policy, fed as the job feeds it, decides the same in all three.
  for e, probe_s, dwell_s, got in ((eff, 0.0, 0.0, plain), (eff, 10.0, 0.0, probed),
                                   (slow, 10.0, 100.0, back)):
    cfg = PolicyConfig(switch_cost_s=20.0, probe_s=probe_s, sync_efficiency=1.0,
                       gba_efficiency=0.5, **dict(rule, dwell_s=dwell_s))
    want = job_decisions(quiet, e, assumed, cfg)
    assert [(d["interval"], d["from"], d["to"], d["probe"]) for d in got.decisions] == [
        (w[0], w[1], w[2], w[4]) for w in want]
    assert [d["expected_gain"] for d in got.decisions] == pytest.approx([w[3] for w in want])


def test_a_stay_entered_on_an_assumed_efficiency_is_left_once_measured():
  # 60 quiet intervals of 5 s (four workers at 100 ms): Sync reaches 0.75 of its model, GBA only
  # 0.5, but the job assumes both at 1.0 before it has run them. A switch costs 20 s.
  quiet = [[0.1] * 4] * 60
  eff, assumed = {"sync": 0.75, "gba": 0.5}, {"sync": 1.0, "gba": 1.0}
  rule = dict(margin=0.1, hysteresis=0.05, dwell_s=100.0, confirm=1, horizon_s=200.0)
  # Sync measures 7,680 against GBA's assumed 10,240 (gain 1.33, saves 200 x (10,240 / 7,680 - 1)
  # = 66.7 s > 20 s) and leaves after its dwell: interval 19, 100 s in. GBA's first stay measures
  # 5,120 against Sync's learned 7,680 (gain 0.67 < 1.05, saves 100 s > 20 s): it goes back at
  # its first observation, 10 s in (>= measure_s 5 s), not after another dwell of 100 s.
  measured = simulate_auto.replay(quiet, 5.0, 256, eff, 20.0, assumed_efficiency=assumed,
                                  measure_s=5.0, **rule)
  assert [(d["interval"], d["to"]) for d in measured.decisions] == [(19, "gba"), (21, "sync")]
  assert measured.modes == ["sync"] * 20 + ["gba"] * 2 + ["sync"] * 38
  assert measured.seconds == pytest.approx(300.0 + 2 * 20.0)
  assert measured.examples == pytest.approx(5.0 * (58 * 7680 + 2 * 5120))
  dwelt = simulate_auto.replay(quiet, 5.0, 256, eff, 20.0, assumed_efficiency=assumed,
                               measure_s=100.0, **rule)
  assert [(d["interval"], d["to"]) for d in dwelt.decisions] == [(19, "gba"), (39, "sync")]
  assert dwelt.examples == pytest.approx(5.0 * (40 * 7680 + 20 * 5120))
  # Known efficiencies (no assumption): nothing to measure, GBA is never entered.
  assert simulate_auto.replay(quiet, 5.0, 256, eff, 20.0, **rule).decisions == []
  # The policy, fed as the job feeds it, decides the same.
  for measure_s, got in ((5.0, measured), (100.0, dwelt)):
    cfg = PolicyConfig(switch_cost_s=20.0, measure_s=measure_s, **rule)
    want = job_decisions(quiet, eff, assumed, cfg)
    assert [(d["interval"], d["from"], d["to"]) for d in got.decisions] == [
        w[:3] for w in want]
    assert [d["expected_gain"] for d in got.decisions] == pytest.approx([w[3] for w in want])


def test_stretched_qps_and_step_overhead_against_numpy():
  times = np.array([0.01, 0.02, 0.04])
  for o in (0.0, 0.005, 0.03):
    sync_ref = 3 * 8 / (times.max() + o)
    gba_ref = 8 * np.sum(1.0 / (times + o))
    assert simulate_auto.stretched_qps(times, 8, "sync", o) == pytest.approx(sync_ref)
    assert simulate_auto.stretched_qps(times, 8, "gba", o) == pytest.approx(gba_ref)
    # The overhead is the stretch's inverse.
    assert simulate_auto.step_overhead_seconds(times, sync_ref, 8, "sync") == pytest.approx(
        o, abs=1e-9)
    assert simulate_auto.step_overhead_seconds(times, gba_ref, 8, "gba") == pytest.approx(
        o, abs=1e-9)
  # A measurement at or above the model: no overhead.
  assert simulate_auto.step_overhead_seconds(times, 1e9, 8, "gba") == 0.0
  assert simulate_auto.step_overhead_seconds(times, 3 * 8 / 0.04, 8, "sync") == 0.0
  with pytest.raises(ValueError, match="measured QPS"):
    simulate_auto.step_overhead_seconds(times, 0.0, 8, "sync")
  # Why an overhead: Sync with 7.6-ms own steps and 29 ms beyond them reaches 0.21 of its model;
  # with two of four workers 4x slower, the same overhead is 0.51 of the model.
  quiet, slow = np.full(4, 0.0076), np.array([0.0304, 0.0304, 0.0076, 0.0076])
  eff = [simulate_auto.stretched_qps(t, 256, "sync", 0.029) / (4 * 256 / t.max())
         for t in (quiet, slow)]
  assert eff == pytest.approx([0.0076 / 0.0366, 0.0304 / 0.0594])


def test_replay_with_step_overheads():
  # Two of four workers 4x slower in intervals 10-19 of 40. Sync takes 0.1 s beyond its slowest
  # worker: pure Sync (it never leaves: margin 100) trains at 4 x 256 / (max t + 0.1).
  times = np.full((40, 4), 0.1)
  times[10:20, :2] = 0.4
  rule = dict(margin=100.0, hysteresis=0.0, dwell_s=0.0, confirm=1)
  over = {"sync": 0.1, "gba": 0.0}
  pure = simulate_auto.replay(times, 5.0, 256, {"sync": 1.0, "gba": 1.0}, 20.0, overhead_s=over,
                              **rule)
  assert pure.decisions == [] and pure.modes == ["sync"] * 40
  assert pure.examples == pytest.approx(np.sum(5.0 * 4 * 256 / (times.max(axis=1) + 0.1)))
  # With the same pace everywhere an overhead and an efficiency are the same world: Sync at
  # 5,120 = 0.5 of its model, GBA at 10,240 (no overhead); both leave Sync at its first
  # observation and stay in GBA, whose learned efficiency (1.0) keeps the gain at 2.
  quiet = np.full((40, 4), 0.1)
  eager = dict(margin=0.3, hysteresis=0.15, dwell_s=0.0, confirm=1)
  by_overhead = simulate_auto.replay(quiet, 5.0, 256, {"sync": 1.0, "gba": 1.0}, 20.0,
                                     overhead_s=over, assumed_efficiency={"sync": 1.0, "gba": 1.0},
                                     **eager)
  by_efficiency = simulate_auto.replay(quiet, 5.0, 256, {"sync": 0.5, "gba": 1.0}, 20.0,
                                       assumed_efficiency={"sync": 1.0, "gba": 1.0}, **eager)
  for got in (by_overhead, by_efficiency):
    assert [(d["interval"], d["to"]) for d in got.decisions] == [(1, "gba")]
    assert got.examples == pytest.approx(5.0 * (2 * 5120 + 38 * 10240))
  # In the slow window the two differ: Sync by overhead 4 x 256 / 0.5 = 2,048, by efficiency
  # 0.5 x 4 x 256 / 0.4 = 1,280.
  sync_only = dict(rule)
  by_eff = simulate_auto.replay(times, 5.0, 256, {"sync": 0.5, "gba": 1.0}, 20.0, **sync_only)
  assert (pure.examples - by_eff.examples) == pytest.approx(5.0 * 10 * (2048 - 1280))


def test_probe_roles_of_the_stays():
  from tf_gba.training import auto_job  # pylint: disable=g-import-not-at-top
  probing, plain = PolicyConfig(probe_s=5.0), PolicyConfig()
  assert [auto_job.probe_role(probing, before, mode) for before, mode in
          (([], "sync"), (["sync"], "gba"), (["sync", "gba"], "sync"))] == [
              "first", "second", None]
  # Without --auto_probe_s the first stay is plain; GBA's first stay measures the efficiency it
  # was entered on (it may be left after --auto_measure_s); later stays are plain.
  assert [auto_job.probe_role(plain, before, mode) for before, mode in
          (([], "sync"), (["sync"], "gba"), (["sync", "gba"], "sync"),
           (["sync", "gba", "sync"], "gba"))] == [None, "second", None, None]
  # Efficiencies held: nothing is measured, every stay is plain.
  held = PolicyConfig(learn_efficiency=False)
  assert auto_job.probe_role(held, ["sync"], "gba") is None


def test_the_summary_names_each_stays_role(capsys):
  from tf_gba.training import auto_job  # pylint: disable=g-import-not-at-top
  stay = {"start_step": 0, "steps": 40, "seconds": 10.0, "train_seconds": 8.0,
          "global_qps": 1000.0, "efficiency": 0.5}
  auto_job.print_auto({"steps": 120, "wall_seconds": 30.0, "train_seconds": 24.0,
                       "global_qps": 1000.0, "num_switches": 0, "eval_auc": 0.7, "switches": [],
                       "stays": [dict(stay, mode="sync", probe="first"),
                                 dict(stay, mode="gba", probe="second"),
                                 dict(stay, mode="sync", probe=None)]})
  lines = [l for l in capsys.readouterr().out.splitlines() if "from step" in l]
  assert lines[0].endswith("efficiency 0.50) (probe)")
  assert lines[1].endswith("efficiency 0.50) (first stay: measures its efficiency)")
  assert lines[2].endswith("efficiency 0.50)")


def test_other_mode_is_predicted_by_its_measured_step_overhead():
  # No compute floor, as measured here: a quiet Sync step is the workers' own 5 ms plus 45 ms
  # beyond them (4 x 256 / 0.05 = 20,480 QPS, 0.1 of its model 4 x 256 / 0.005).
  quiet = [0.005] * 4
  sync = AutoPolicy(PolicyConfig(dwell_s=1e9), "sync", 256)
  for qps in (20480.0, 4 * 256 / 0.055, 4 * 256 / 0.04):  # overheads 45, 50 and 35 ms
    sync.observe(10.0, quiet, qps)
  assert [o["overhead_s"] for o in sync.observations] == pytest.approx([0.045, 0.05, 0.035])
  assert sync.stay_overhead_s() == pytest.approx(0.045)  # their median
  assert sync.observations[0]["efficiency"] == pytest.approx(0.1)
  # In GBA, with workers 0 and 1 4x slower: GBA's own steps (15 ms quiet, with its round trips)
  # take 60 ms on the slow ones. Sync's steps are predicted at 1/3 of these (the base step times'
  # ratio, 5 / 15 ms), its slowest 20 ms, plus its 45 ms: 4 x 256 / 0.065 = 15,754 QPS. By its
  # quiet efficiency instead, 0.1 x 4 x 256 / 0.02 = 5,120.
  window = [0.06, 0.06, 0.015, 0.015]
  cfg = PolicyConfig(margin=0.3, hysteresis=0.15, dwell_s=0.0, confirm=1, switch_cost_s=5.0)
  gba = AutoPolicy(cfg, "gba", 256, {"sync": 0.1}, base_step_s={"sync": 0.005},
                   overhead_s={"sync": 0.045})
  decision = gba.observe(30.0, window, 14000.0)
  record = gba.observations[-1]
  assert record["other_by"] == "overhead" and record["other_overhead_s"] == 0.045
  assert record["other_step_scale"] == pytest.approx(1 / 3)
  assert record["expected_sync_qps"] == pytest.approx(4 * 256 / 0.065)
  # Gain 14,000 / 15,754 = 0.889 < 1.15, saves 60 x (15,754 / 14,000 - 1) = 7.5 s > 5 s.
  assert decision is not None and decision["to"] == "sync"
  assert decision["expected_gain"] == pytest.approx(14000.0 * 0.065 / 1024)
  assert "sync at its step overhead 45.0 ms on 0.33x these steps' times" in describe(decision)
  # Before Sync's overhead is known (or with efficiencies held): by its efficiency, as before,
  # where Sync looks 2.7x slower than GBA and the job stays.
  for policy in (AutoPolicy(cfg, "gba", 256, {"sync": 0.1}, base_step_s={"sync": 0.005}),
                 AutoPolicy(dataclasses.replace(cfg, learn_efficiency=False), "gba", 256,
                            {"sync": 0.1}, base_step_s={"sync": 0.005},
                            overhead_s={"sync": 0.045})):
    assert policy.observe(30.0, window, 14000.0) is None
    record = policy.observations[-1]
    assert record["other_by"] == "efficiency"
    assert record["expected_sync_qps"] == pytest.approx(5120.0)
  assert "at efficiency 0.10 of its model" in describe(dict(decision, other_by="efficiency"))


def test_prediction_by_overhead_matches_numpy_reference():
  rng = np.random.default_rng(11)
  cfg = PolicyConfig(margin=0.2, hysteresis=0.1, dwell_s=0, confirm=1, horizon_s=90.0)
  switched = stayed = 0
  for _ in range(300):
    mode = "sync" if rng.random() < 0.5 else "gba"
    other = "gba" if mode == "sync" else "sync"
    n = int(rng.integers(2, 9))
    times = rng.uniform(0.003, 0.4, size=n)
    own_base, other_base = rng.uniform(0.003, 0.05, size=2)
    o = rng.uniform(0.0, 0.1)
    measured = model_qps(mode, times) * rng.uniform(0.1, 1.0)
    cost = rng.uniform(0.0, 30.0)
    policy = AutoPolicy(cfg, mode, 256, {}, [cost], base_step_s={other: other_base},
                        overhead_s={other: o})
    # An earlier observation of this stay, whose fastest worker took own_base: the base step
    # time is then the median of it and this observation's fastest.
    policy._base_step.add([own_base] * n)  # pylint: disable=protected-access
    got = policy.observe(10.0, times, measured)
    record = policy.observations[-1]
    # The other mode's steps: these times x its base / the (two-observation) median of these.
    base_now = np.median([own_base, times.min()])
    t = times * other_base / base_now
    want = n * 256 / (t.max() + o) if other == "sync" else 256 * np.sum(1.0 / (t + o))
    gain, saved, switch = reference_rule(mode, {mode: measured, other: want}, cost, 90.0, 1.2,
                                         1.1)
    assert record[f"expected_{other}_qps"] == pytest.approx(want, rel=1e-12)
    assert record["expected_gain"] == pytest.approx(gain, rel=1e-12)
    assert record["saved_s"] == pytest.approx(saved, rel=1e-9, abs=1e-9)
    # This observation's own overhead solves the model: the stretched steps give what it measured.
    oo = record["overhead_s"]
    back = n * 256 / (times.max() + oo) if mode == "sync" else 256 * np.sum(1.0 / (times + oo))
    assert back == pytest.approx(measured, rel=1e-9)
    assert (got is not None) == switch
    switched += got is not None
    stayed += got is None
  assert switched > 20 and stayed > 20  # both outcomes exercised


def test_simulator_replays_the_policy_learning_step_overheads():
  # No floor: Sync's own steps 5 ms, GBA's 15 ms (its round trips in them), workers 0 and 1 4x
  # slower in intervals 20-39 of 60. Each mode trains at the model plus its overhead: Sync 45 ms,
  # GBA 40 ms. The job assumes both at their model (efficiency 1) before it has run them.
  sync = np.full((60, 4), 0.005)
  gba = np.full((60, 4), 0.015)
  sync[20:40, :2] *= 4
  gba[20:40, :2] *= 4
  per_mode, over = {"sync": sync, "gba": gba}, {"sync": 0.045, "gba": 0.040}
  rule = dict(margin=0.3, hysteresis=0.15, dwell_s=20.0, confirm=2, horizon_s=60.0)
  assumed = {"sync": 1.0, "gba": 1.0}
  got = simulate_auto.replay(per_mode, 5.0, 256, assumed, 5.0, overhead_s=over,
                             assumed_efficiency=assumed, **rule)
  # Sync (20,480 QPS) expects GBA at its model 4 x 256 / 0.005 (gain 10) and leaves after its
  # dwell; GBA's first stay measures 4 x 256 / 0.055 = 18,618 and expects Sync at its overhead,
  # 4 x 256 / (0.015 / 3 + 0.045) = 20,480 (gain 0.909): back at its second observation. In the
  # window Sync (4 x 256 / 0.065 = 15,754) expects GBA at 256 x (2 / 0.1 + 2 / 0.055) = 14,429
  # from its overhead: it stays.
  assert [(d["interval"], d["to"], d["other_by"]) for d in got.decisions] == [
      (3, "gba", "efficiency"), (6, "sync", "overhead")]
  assert got.decisions[1]["expected_gain"] == pytest.approx((1024 / 0.055) / 20480.0)
  assert got.modes == ["sync"] * 4 + ["gba"] * 3 + ["sync"] * 53
  cfg = PolicyConfig(switch_cost_s=5.0, **rule)
  want = job_decisions(per_mode, None, assumed, cfg, overhead_s=over)
  assert [(d["interval"], d["from"], d["to"]) for d in got.decisions] == [w[:3] for w in want]
  assert [d["expected_gain"] for d in got.decisions] == pytest.approx([w[3] for w in want])
