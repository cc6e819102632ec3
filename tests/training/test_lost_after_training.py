"""A parameter server lost after the run's last checkpoint, while the final evaluation reads the
model (the chaos drill killed one while the last checkpoint was written, and the command ended
with exit 1 and a line asking to evaluate the checkpoint by hand): the checkpoint holds the
model, and the final evaluation reads it instead, with one line. Real servers (1 PS, 2 workers),
the run in this process."""

import json
import os
import signal
import time

import numpy as np
import tf_keras as keras

from benchmarks import process_tree
from tf_gba.training import recovery
from tf_gba.training import runner
from tf_gba.training.config import TrainConfig


def _config(model_dir):
  return TrainConfig(mode="gba", num_workers=2, num_ps=1, local_batch_size=64, log_every=10,
                     steps=20, eval_examples=512, model_dir=str(model_dir), stragglers="none",
                     export_dir="")


class _KillPsBeforeEvaluation(keras.callbacks.Callback):
  """At the end of training (the final checkpoint comes next), makes the job's evaluation kill
  ps:0 first: the checkpoint is whole, the evaluation finds the server gone."""

  def on_train_end(self, logs=None):
    evaluate = self.job.evaluate

    def kill_then_evaluate(**kwargs):
      pid = process_tree.servers(os.getpid()).get("ps:0")
      if pid is not None:
        os.kill(pid, signal.SIGKILL)
        deadline = time.time() + 10
        while process_tree.alive(pid) and time.time() < deadline:
          time.sleep(0.05)
      return evaluate(**kwargs)

    self.job.evaluate = kill_then_evaluate


def test_a_parameter_server_lost_in_the_final_evaluation_evaluates_the_checkpoint(tmp_path,
                                                                                capsys):
  summary = runner.run_parameter_server(_config(tmp_path / "m"),
                                        callbacks=[_KillPsBeforeEvaluation()])
  target = 20 // 2  # 20 worker steps, M = 2 workers
  saved = str(tmp_path / "m" / f"ckpt-{target}")
  assert summary["global_step"] == target and summary["checkpoint"] == saved, summary
  assert np.isfinite(summary["eval_auc"]) and summary["eval_examples"] > 0, summary
  out = capsys.readouterr()
  assert (f"tf_gba: ps:0 died after the run's last checkpoint; the final evaluation reads that "
          f"checkpoint ({saved}) instead.") in out.out + out.err, out
  assert json.loads((tmp_path / "m" / recovery.PROGRESS_FILE).read_text())["finished"]

  # A job that died after that checkpoint but before the run was recorded finished leaves this
  # record: its restart resumes at the target, trains nothing and evaluates.
  record = json.loads((tmp_path / "m" / recovery.PROGRESS_FILE).read_text())
  record["finished"] = False
  (tmp_path / "m" / recovery.PROGRESS_FILE).write_text(json.dumps(record))
  resumed = runner.run_parameter_server(_config(tmp_path / "m"))
  assert resumed["start_global_step"] == resumed["global_step"] == target, resumed
  assert resumed["restarts"] == 1 and resumed["steps_redone"] == 0, resumed
  assert resumed["checkpoint"] == saved and np.isfinite(resumed["eval_auc"]), resumed
  assert "tf_gba: the run had trained to its target global step; evaluating it" in (
      capsys.readouterr().out)
