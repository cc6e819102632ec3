"""--mode=auto on real local clusters: a straggler trace slows one worker in its middle window; the
job leaves Sync for GBA while the worker is slow and comes back once it is not, through the
checkpoint in model_dir, and the summary counts both switches, with their measured costs. Without
a straggler profile (the binary's default) auto still measures every worker's step time."""

import json
import os

import numpy as np

from tests import script_process
import pytest
import tensorflow as tf

from tf_gba.training import runner
from tf_gba.training.config import TrainConfig

WINDOW_S = 10.0  # the trace's window: worker 1 is 4x slower between 10 s and 20 s of its clock
STEPS = 480


def test_auto_switches_to_gba_and_back_on_a_trace(tmp_path):
  trace = tmp_path / "trace.json"
  trace.write_text(json.dumps({"window_seconds": WINDOW_S, "workers": {"1": [1, 4, 1]}}))
  model_dir = str(tmp_path / "model")
  # A 100 ms compute floor: each worker paces as on a machine of its own, whatever else this
  # machine runs; the trace's slowdown is then 4x that floor, far from the thresholds.
  cfg = TrainConfig(mode="auto", model="deepfm", data="synthetic",
                    data_options="num_examples=4000,vocab_size=8000", num_ps=1, num_workers=2,
                    local_batch_size=32, steps=STEPS, log_every=8, eval_examples=512,
                    model_dir=model_dir, stragglers=f"compute:100+trace:{trace}", export_dir="",
                    auto_dwell_s=0.0, auto_confirm=2, auto_margin=0.1, auto_hysteresis=0.05,
                    # Held efficiencies (both modes predicted as model QPS x efficiency,
                    # whatever this machine's load): GBA at 0.5 of its model, Sync at its model,
                    # so that Sync is the faster mode on quiet workers (expected gain 0.5) and
                    # GBA while worker 1 is slow (2.5 x 0.5 = 1.25). Over 600 s the first switch
                    # saves 150 s, the second 600 s: more than a switch costs here (65-90 s
                    # measured on a loaded machine).
                    auto_sync_efficiency=1.0, auto_gba_efficiency=0.5,
                    auto_learn_efficiency=False, auto_switch_cost_s=0.0, auto_horizon_s=600.0)
  summary = runner.run(cfg)

  assert summary["mode"] == "auto"
  assert summary["num_switches"] == 2
  first, second = summary["switches"]
  assert (first["from"], first["to"], second["from"], second["to"]) == ("sync", "gba", "gba",
                                                                        "sync")
  # Worker 1 at 4x the floor: predicted gain (4 + 1) / 2 = 2.5 from the measured step times.
  assert first["predicted_gain"] >= 1.3
  slow, fast = first["per_worker_step_seconds"][1], first["per_worker_step_seconds"][0]
  assert slow > 2.5 * fast
  # Worker 1 back at the floor: the gain the model predicts has fallen. How far depends on how the
  # observations that confirmed the switch straddle the window's end (measured 1.0-1.5 on a
  # loaded machine), so the check is the fall itself and the policy's own bound below.
  assert second["predicted_gain"] < first["predicted_gain"]
  assert second["per_worker_step_seconds"][1] < slow
  # Expected gains from the held efficiencies: 0.5 x the model's.
  for switch in (first, second):
    assert switch["expected_gain"] == pytest.approx(
        0.5 * switch["predicted_gba_qps"] / switch["predicted_sync_qps"], rel=1e-9)
    assert switch["efficiency"] == pytest.approx(
        switch["measured_qps"] / switch[f"predicted_{switch['from']}_qps"], rel=1e-9)
  assert first["expected_gain"] >= 1.1
  assert second["expected_gain"] < 1.05
  # The first switch's cost is measured (decision to the next mode's first observed interval)
  # and is what the second decision expected; its parts add up to it.
  assert first["expected_switch_cost_s"] == 0.0
  assert first["cost_s"] > 0
  assert second["expected_switch_cost_s"] == pytest.approx(first["cost_s"])
  parts = first["cost_breakdown_s"]
  assert set(parts) >= {"end_stay_s", "start_s", "first_interval_s", "to_checkpoint_s",
                        "checkpoint_s", "exit_s"}
  assert all(v >= 0 for v in parts.values())
  # Up to the job's own bookkeeping between two stays.
  assert parts["end_stay_s"] + parts["start_s"] + parts["first_interval_s"] == pytest.approx(
      first["cost_s"], abs=0.5)
  assert parts["to_checkpoint_s"] + parts["checkpoint_s"] + parts["exit_s"] == pytest.approx(
      parts["end_stay_s"], abs=1e-6)
  assert 0 < first["at_step"] < second["at_step"] < STEPS

  stays = summary["stays"]
  assert [s["mode"] for s in stays] == ["sync", "gba", "sync"]
  assert sum(s["steps"] for s in stays) == summary["steps"] >= STEPS
  # Each stay continues the previous one's checkpoint: the global step carries over.
  for before, after in zip(stays, stays[1:]):
    assert after["start_global_step"] == before["global_step"]
  assert stays[1]["start_step"] == first["at_step"]
  # Global steps of N local batches: (worker steps) / N over the whole run.
  assert stays[-1]["global_step"] == summary["steps"] // 2

  # The trace's clock went on across the switches (each stay restored it from the checkpoint):
  # GBA was left only once the window had passed, so the clock is past 2 windows.
  reader = tf.train.load_checkpoint(summary["checkpoint"])
  elapsed = reader.get_tensor("straggler_position/elapsed_ns/.ATTRIBUTES/VARIABLE_VALUE")
  assert elapsed.min() * 1e-9 > 2 * WINDOW_S

  with open(os.path.join(model_dir, "summary.json")) as f:
    written = json.load(f)
  assert written["num_switches"] == 2 and written["switches"] == summary["switches"]
  assert 0.5 < summary["eval_auc"] <= 1.0
  assert [p["mode"] for p in summary["timeline"]][0] == "sync"
  assert {p["mode"] for p in summary["timeline"]} == {"sync", "gba"}


def test_auto_measures_step_times_without_a_profile(tmp_path):
  # The binary's default profile (none): the stays run `timed`, so every worker's own step time
  # is measured; no switch within a dwell time longer than the run.
  cfg = TrainConfig(mode="auto", model="deepfm", data="synthetic",
                    data_options="num_examples=2000,vocab_size=4000", num_ps=1, num_workers=2,
                    local_batch_size=32, steps=96, log_every=8, eval_examples=256,
                    model_dir=str(tmp_path / "model"), auto_dwell_s=1e6, export_dir="")
  summary = runner.run(cfg)
  assert summary["num_switches"] == 0 and summary["stragglers"] == "none"
  (stay,) = summary["stays"]
  assert stay["mode"] == "sync" and stay["skipped_observations"] == 0
  # 48 global steps logged every 8: 6 intervals, the first not an observation, nor the last
  # (the run's end).
  assert stay["observations"] == 4
  times = np.array(stay["step_seconds"])
  assert times.shape == (4, 2) and np.all(times > 0)
  # The efficiency is the measured QPS over the model's, N x B / slowest step.
  assert 0 < stay["efficiency"] == pytest.approx(summary["efficiency"]["sync"])
  assert summary["steps"] == 96 and 0.5 < summary["eval_auc"] <= 1.0


def test_binary_without_a_profile_measures_both_modes_and_the_switch(tmp_path):
  # The command, `examples/train.py --mode=auto` with no --stragglers, ended in
  # `ValueError: step times must be > 0 seconds`: its steps carried no timing op. Here it runs as
  # a user runs it, small, with GBA assumed at 10x its model (Sync measures at most its model),
  # so that it switches at its first observation and both modes are measured.
  model_dir = str(tmp_path / "model")
  proc = script_process.run(
      ["--mode=auto", "--model=deepfm", "--data=synthetic",
       "--data_options=num_examples=2000,vocab_size=4000", "--num_workers=2",
       "--local_batch_size=32", "--steps=128", "--log_every=16", "--eval_examples=256",
       "--auto_dwell_s=0", "--auto_confirm=1", "--auto_gba_efficiency=10", "--export_dir=",
       f"--model_dir={model_dir}"], timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "step times must be > 0" not in proc.stdout + proc.stderr
  with open(os.path.join(model_dir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["mode"] == "auto" and summary["stragglers"] == "none"
  assert summary["steps"] == 128
  sync, gba = summary["stays"][:2]
  assert (sync["mode"], gba["mode"]) == ("sync", "gba")
  for stay in (sync, gba):
    assert stay["observations"] > 0 and stay["skipped_observations"] == 0
    times = np.array(stay["step_seconds"])
    assert times.shape == (stay["observations"], 2) and np.all(times > 0)
    assert stay["efficiency"] > 0
  # Sync's 2 x 32 every 16 global steps: its first observation, at worker step 64, switches.
  first = summary["switches"][0]
  assert (first["from"], first["to"], first["at_step"]) == ("sync", "gba", 64)
  # Before any switch was measured: the binary's default first estimate.
  assert first["other_efficiency"] == 10.0 and first["expected_switch_cost_s"] == 15.0
  # Its cost, from the decision to the end of GBA's first interval, and where it went.
  assert first["cost_s"] > 0
  breakdown, events = first["cost_breakdown_s"], first["cost_events_s"]
  assert set(breakdown) >= {"end_stay_s", "to_checkpoint_s", "checkpoint_s", "exit_s", "start_s",
                            "processes_s", "restore_s", "to_train_s", "first_interval_s"}
  assert all(v >= 0 for v in breakdown.values()), breakdown
  assert events["first_interval_end"] == pytest.approx(first["cost_s"])
  assert list(events.values()) == sorted(events.values())  # in the order a switch passes them
  assert breakdown["end_stay_s"] + breakdown["start_s"] + breakdown["first_interval_s"] <= (
      first["cost_s"] + 1e-6)
  assert summary["switch_seconds"] == pytest.approx(
      sum(s["cost_s"] for s in summary["switches"] if s.get("cost_s") is not None))
  assert "auto: switching sync -> gba" in proc.stdout
  assert f"cost {first['cost_s']:.1f} s (end stay" in proc.stdout
