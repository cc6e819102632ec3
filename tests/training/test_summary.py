"""The run summary's one schema: what the parameter-server, sync and DTS jobs build from it."""

import json
import types

from tf_gba.training import runner
from tf_gba.training import summary as summary_lib
from tf_gba.training import sync_job
from tf_gba.training.config import TrainConfig


def _ps_summary(mode="gba"):
  stats = {"global_step": 5, "dense": {"pushes": 20, "mean_staleness": 0.5, "staleness_max": 2,
                                       "histogram": [1, 2], "dropped": 1, "duplicates": 0},
           "dense_all_variables": {"dropped": 3, "nonfinite": 1}, "sparse": {"dropped": 2,
                                                                              "nonfinite": 4}}
  return runner._summary(  # pylint: disable=protected-access
      TrainConfig(mode=mode, steps=20), types.SimpleNamespace(num_ps=1, num_workers=2),
      types.SimpleNamespace(history={"loss": [0.5]}), stats,
      [{"worker": 0, "steps": 10, "measured_steps": 8, "delay_seconds": 0.25,
        "max_step_seconds": 0.5}],
      {"auc": 0.6, "logloss": 0.7, "examples": 100}, 2.0, 16, 3.0, 1, "ckpt-5")


def _sync_summary():
  chief = {"task": 0, "num_workers": 2, "steps_run": 6, "measured_steps": 4,
           "measured_seconds": 2.0, "delay_seconds": 0.0, "worker_steps": 6,
           "train_seconds": 3.0, "global_qps": 64.0, "global_step": 6, "start_global_step": 0,
           "final_train_loss": 0.6, "eval_auc": 0.55, "eval_logloss": 0.69,
           "eval_examples": 100, "checkpoint": "ckpt-6"}
  return sync_job.summarize(TrainConfig(mode="sync", num_workers=2, local_batch_size=16,
                                        steps=12), [chief, dict(chief, task=1)])


def test_every_job_fills_the_schema_in_its_order_and_adds_only_declared_keys():
  for summary in (_ps_summary("gba"), _ps_summary("hop_bw"), _sync_summary()):
    assert list(summary)[:len(summary_lib.SCHEMA)] == list(summary_lib.SCHEMA)
    assert summary_lib.unknown_keys(summary) == []
  assert set(_sync_summary()) == set(_ps_summary())


def test_ps_summary_values():
  s = _ps_summary("gba")
  assert (s["mode"], s["num_ps"], s["num_workers"], s["num_aggregate"]) == ("gba", 1, 2, 4)
  # 1 epoch: --steps=20 is shorter than --log_every=100, so the interval is --steps itself.
  assert s["steps"] == 20 and s["examples"] == 20 * 256
  assert s["global_qps"] == 16 * 256 / 2.0 and s["per_worker"][0]["qps"] == 8 * 256 / 2.0
  assert (s["pushes"], s["dropped_batches"], s["dropped_gradients"],
          s["dropped_embedding_rows"], s["nonfinite_gradients"]) == (20, 1, 3, 2, 5)
  assert s["ignored_gradients"] == 0 and _ps_summary("hop_bw")["ignored_gradients"] == 1
  assert (s["eval_auc"], s["eval_logloss"], s["eval_examples"]) == (0.6, 0.7, 100)


def test_a_restarted_worker_is_not_measured_and_the_restarts_say_why(capsys):
  stats = {"global_step": 5, "dense": None, "dense_all_variables": None, "sparse": None}
  workers = [{"worker": 0, "steps": 3, "measured_steps": None, "measured_in_step_seconds": None,
              "delay_seconds": 0.0, "unreachable": True, "max_step_seconds": 0.0},
             {"worker": 1, "steps": 9, "measured_steps": 8, "measured_in_step_seconds": 1.5,
              "delay_seconds": 0.0, "max_step_seconds": 0.25}]
  s = runner._summary(  # pylint: disable=protected-access
      TrainConfig(mode="gba", steps=20), types.SimpleNamespace(num_ps=1, num_workers=2),
      types.SimpleNamespace(history={"loss": [0.5]}), stats, workers,
      {"auc": 0.6, "logloss": 0.7, "examples": 100}, 2.0, 16, 3.0, 1, "ckpt-5")
  assert [(w["qps"], w["in_step_fraction"]) for w in s["per_worker"]] == [
      (None, None), (8 * 256 / 2.0, 0.75)]
  s.update(restarts=2, restart_causes=["WorkerLost", "RuntimeFault"], steps_redone=3,
           batches_reread=12, worker_restarts=1, tfdata_worker_restarts=0)
  assert summary_lib.unknown_keys(s) == []
  summary_lib.print_summary(s)
  out = capsys.readouterr().out
  assert "w0=?  w1=1,024  (?: restarted, not measured)" in out
  assert "recovery              2 restarts (WorkerLost, RuntimeFault), 3 global steps" in out


def test_sync_summary_defaults_are_those_of_a_synchronous_run():
  s = _sync_summary()
  assert (s["mode"], s["num_ps"], s["num_aggregate"], s["global_batch_size"]) == (
      "sync", 0, 2, 32)
  assert s["steps"] == 12 and s["pushes"] == 12 and s["examples"] == 12 * 16
  assert (s["mean_staleness"], s["max_staleness"], s["dropped_batches"],
          s["blocked_seconds"], s["max_lead"]) == (0.0, 0, 0, 0.0, None)
  assert s["sparse_normalize"] == "num_aggregate"
  assert [w["worker"] for w in s["per_worker"]] == [0, 1]
  assert s["per_worker"][0]["qps"] == 4 * 16 / 2.0


def test_unknown_keys_name_a_drifted_key():
  s = dict(_sync_summary(), eval_log_loss=0.7)
  assert summary_lib.unknown_keys(s) == ["eval_log_loss"]
  dts = summary_lib.new(TrainConfig(mode="dts", steps=8), steps=8, exchanges=2, dts_delay=4)
  assert summary_lib.unknown_keys(dts) == []
  assert summary_lib.unknown_keys(dict(dts, mode="sync")) == ["dts_delay", "exchanges"]


def test_write_and_print(tmp_path, capsys):
  s = dict(_sync_summary(), **summary_lib.data_fields(
      {"malformed_rows": 3, "rows_checked": 600, "fully_checked": True}))
  summary_lib.write(str(tmp_path), s)
  with open(tmp_path / "summary.json") as f:
    assert json.load(f) == json.loads(json.dumps(s))
  summary_lib.print_summary(s)
  out = capsys.readouterr().out
  assert "summary (sync, deepfm, synthetic): 12 worker steps, 192 examples" in out
  assert "eval logloss          0.6900" in out
  assert "malformed rows        3 of 600 rows checked, skipped" in out


def _printable(config, **fields):
  return summary_lib.new(config, num_aggregate=1, steps=8, examples=128, wall_seconds=1.0,
                         global_qps=128.0, qps_measured_over_steps=8, global_step=8,
                         per_worker=[{"worker": 0, "qps": 128.0}], eval_auc=0.6,
                         eval_logloss=0.7, checkpoint="ckpt-8", **fields)


def test_dts_and_shadow_summaries_print_the_common_block_with_their_own_line(capsys):
  summary_lib.print_summary(_printable(TrainConfig(mode="dts", steps=8), dts_delay=4,
                                       dts_period=2, exchanges=4))
  out = capsys.readouterr().out
  assert out.startswith("=" * 72) and "summary (dts, deepfm, synthetic): 8 worker steps" in out
  assert "  dts                   delay 4, period 2: 4 all-reduces" in out
  assert "dense replicas" not in out
  shadow = _printable(TrainConfig(mode="shadow_easgd", steps=8), sync={"mean_sync_gap": 1.25},
                      replica_spread_before_final_sync=0.0565,
                      replica_spread_after_final_sync=7.07e-7)
  assert summary_lib.unknown_keys(shadow) == []
  summary_lib.print_summary(shadow)
  out = capsys.readouterr().out
  assert "summary (shadow_easgd, deepfm, synthetic): 8 worker steps" in out
  assert ("  dense replicas        mean sync gap 1.25 steps; spread 0.0565 -> 7.07e-07 at the "
          "final sync") in out
  assert "  dts " not in out
  # A resumed run with nothing left to train has no gap and no spread to report.
  summary_lib.print_summary(dict(shadow, sync={"mean_sync_gap": None},
                                 replica_spread_before_final_sync=None))
  assert "mean sync gap - steps; spread - -> 7.07e-07" in capsys.readouterr().out
