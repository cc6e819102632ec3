"""A parameter server lost after the run's last checkpoint (the chaos drill killed one while the
last checkpoint was written, and the command ended with exit 1 and a line asking to evaluate the
checkpoint by hand): the checkpoint holds the model, so the serving export, which reads it, is
written, and the final evaluation reads it instead of the servers, with one line. Real servers
(1 PS, 2 workers), the run in this process."""

import json
import os
import signal
import time

import numpy as np
import tensorflow as tf
import tf_keras as keras

from benchmarks import process_tree
from tf_gba.training import recovery
from tf_gba.training import runner
from tf_gba.training.config import TrainConfig


def _config(model_dir, export_dir="", embedding="vocab"):
  return TrainConfig(mode="gba", num_workers=2, num_ps=1, local_batch_size=64, log_every=10,
                     steps=20, eval_examples=512, model_dir=str(model_dir), stragglers="none",
                     export_dir=export_dir, embedding=embedding)


class _KillPsAfterTheLastCheckpoint(keras.callbacks.Callback):
  """At the end of training, makes the job's next checkpoint (the final one) kill ps:0 once it is
  written: the checkpoint is whole, the export and the evaluation find the server gone."""

  def on_train_end(self, logs=None):
    save = self.job.save_checkpoint

    def save_then_kill(*args, **kwargs):
      saved = save(*args, **kwargs)
      pid = process_tree.servers(os.getpid()).get("ps:0")
      if pid is not None:
        os.kill(pid, signal.SIGKILL)
        deadline = time.time() + 10
        while process_tree.alive(pid) and time.time() < deadline:
          time.sleep(0.05)
      return saved

    self.job.save_checkpoint = save_then_kill


def test_a_hash_table_job_reports_its_tables_missing_in_one_line(tmp_path, capsys):
  # The tables' sizes are read from the servers after the checkpoint, for the summary.
  summary = runner.run_parameter_server(_config(tmp_path / "m", embedding="hash"),
                                        callbacks=[_KillPsAfterTheLastCheckpoint()])
  assert np.isfinite(summary["eval_auc"]) and "hash_tables" not in summary, summary
  out = capsys.readouterr()
  assert ("tf_gba: ps:0 died after the run's last checkpoint; the summary has no hash table "
          "sizes (the checkpoint holds the tables).") in out.out + out.err, out


def test_a_parameter_server_lost_after_the_last_checkpoint_exports_and_evaluates_it(tmp_path,
                                                                                   capsys):
  export = tmp_path / "export"
  summary = runner.run_parameter_server(_config(tmp_path / "m", str(export)),
                                        callbacks=[_KillPsAfterTheLastCheckpoint()])
  target = 20 // 2  # 20 worker steps, M = 2 workers
  saved = str(tmp_path / "m" / f"ckpt-{target}")
  assert summary["global_step"] == target and summary["checkpoint"] == saved, summary
  assert np.isfinite(summary["eval_auc"]) and summary["eval_examples"] > 0, summary
  # The serving export of that checkpoint, written although the server is gone.
  served = tf.saved_model.load(str(export / str(target)))
  assert "serving_default" in served.signatures
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
