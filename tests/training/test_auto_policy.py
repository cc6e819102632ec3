"""The --mode=auto switching policy: its throughput model against NumPy and the simulator, and
its hysteresis, confirmation and dwell time on hand-made sequences of step times."""

import numpy as np
import pytest

from tf_gba.simulate import SimConfig, predicted_qps, simulate
from tf_gba.training.auto_policy import AutoPolicy, PolicyConfig


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


def run(policy: AutoPolicy, gains, start_s=100.0):
  """Feeds one observation per second; the index of the first switch, or None."""
  for i, g in enumerate(gains):
    if policy.observe(start_s + i, two_workers(g)) is not None:
      return i
  return None


def test_sync_to_gba_needs_the_margin_and_confirmation():
  cfg = PolicyConfig(margin=0.3, hysteresis=0.15, dwell_s=0, confirm=2)
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


def test_gba_to_sync_uses_the_lower_threshold():
  cfg = PolicyConfig(margin=0.3, hysteresis=0.15, dwell_s=0, confirm=2)
  # Between 1.15 and 1.3 GBA stays (hysteresis); below 1.15 it goes back.
  assert run(AutoPolicy(cfg, "gba", 256), [1.2] * 10) is None
  assert run(AutoPolicy(cfg, "gba", 256), [2.0, 1.1, 1.1]) == 2
  policy = AutoPolicy(cfg, "gba", 256)
  policy.observe(100, two_workers(1.0))
  decision = policy.observe(101, two_workers(1.0))
  assert decision["from"] == "gba" and decision["to"] == "sync"
  assert decision["threshold"] == pytest.approx(1.15)
  assert decision["predicted_gain"] == pytest.approx(1.0)


def test_dwell_time():
  cfg = PolicyConfig(margin=0.3, hysteresis=0.15, dwell_s=10.0, confirm=1)
  policy = AutoPolicy(cfg, "sync", 256)
  # Strong gains before 10 s in the mode: no switch; the first observation at 10 s switches.
  for t in (1.0, 5.0, 9.9):
    assert policy.observe(t, two_workers(3.0)) is None
  assert policy.observe(10.0, two_workers(3.0))["to"] == "gba"
  # After the dwell time a gain that does not qualify still does not switch.
  assert AutoPolicy(cfg, "sync", 256).observe(50.0, two_workers(1.2)) is None


@pytest.mark.parametrize("kwargs, flag", [
    (dict(margin=0.0), "--auto_margin"), (dict(margin=0.2, hysteresis=0.3), "--auto_hysteresis"),
    (dict(hysteresis=-0.1), "--auto_hysteresis"), (dict(dwell_s=-1), "--auto_dwell_s"),
    (dict(confirm=0), "--auto_confirm")])
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
