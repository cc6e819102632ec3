"""--mode=auto on real local clusters: a straggler trace slows one worker in its middle window; the
job leaves Sync for GBA while the worker is slow and comes back once it is not, through the
checkpoint in model_dir, and the summary counts both switches."""

import json
import os

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
                    model_dir=model_dir, stragglers=f"compute:100+trace:{trace}",
                    auto_dwell_s=0.0, auto_confirm=2)
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
  assert second["predicted_gain"] < 1.15
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
