"""--full_checkpoint_every with --embedding=hash on real servers (2 workers, 2 parameter servers)
and the real Criteo sample: periodic checkpoints alternate full and delta, the run's last one is
full and the deltas of older full checkpoints go; a copy of model_dir taken right after a delta
was written (as a killed job leaves it) resumes from full + delta at the delta's global step with
the table the delta held, row by row. The refusals are at the end."""

import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tests import script_process
from tests import shared_data
from tf_gba.ops import hash_table_ops
from tf_gba.training import delta_checkpoints
from tf_gba.training import runner
from tf_gba.training.config import TrainConfig


def _config(model_dir, **overrides):
  values = dict(mode="gba", embedding="hash", num_workers=2, num_ps=2, local_batch_size=200,
                log_every=10, eval_examples=2000, model_dir=str(model_dir), stragglers="none",
                data=f"criteo:{shared_data.require('criteo_sample')}", steps=40,
                checkpoint_every_steps=10, full_checkpoint_every=3, keep_checkpoints=2,
                export_dir="")
  values.update(overrides)
  return TrainConfig(**values)


def _table_rows(job):
  table = delta_checkpoints.tables(job.model)[0]
  rows = {f: v.numpy() for f, v in table.export().items()}
  order = np.argsort(rows["keys"])
  return {f: rows[f][order] for f in hash_table_ops.EXPORT_FIELDS}


class _SnapshotAfterDelta(keras.callbacks.Callback):
  """Copies model_dir right after the first delta is written (a job killed there leaves it so),
  with the table's rows and the global step at that moment."""

  def __init__(self, snapshot_dir):
    super().__init__()
    self.snapshot_dir = snapshot_dir
    self.rows = self.step = self.delta = None

  def on_epoch_end(self, epoch, logs=None):
    if self.delta is None and self.job.latest_delta is not None:
      self.delta = self.job.latest_delta
      self.step = int(self.job.optimizer.iterations.numpy())
      self.rows = _table_rows(self.job)
      shutil.copytree(self.job.config.model_dir, self.snapshot_dir)


class _RowsAtStart(keras.callbacks.Callback):
  def on_train_begin(self, logs=None):
    self.rows = _table_rows(self.job)


def _bytes(prefix):
  return sum(os.path.getsize(f) for f in (prefix + ".index",) +
             tuple(os.path.join(os.path.dirname(prefix), n)
                   for n in os.listdir(os.path.dirname(prefix))
                   if n.startswith(os.path.basename(prefix) + ".data")))


def _saved_rows(prefix) -> int:
  """Rows of the hash table in the checkpoint at `prefix` (its keys' length)."""
  shapes = tf.train.load_checkpoint(prefix).get_variable_to_shape_map()
  (keys,) = [n for n in shapes if n.endswith("/table/.ATTRIBUTES/keys")]
  return shapes[keys][0]


def test_full_and_deltas_alternate_and_a_rerun_resumes_from_the_last_delta(tmp_path):
  snapshot = _SnapshotAfterDelta(str(tmp_path / "killed"))
  summary = runner.run_parameter_server(_config(tmp_path / "m"), callbacks=[snapshot])
  # Worker steps 10 (full), 20 (delta), 30 (delta), 40 (the last: full).
  assert snapshot.delta is not None and snapshot.delta.endswith(f"delta-{snapshot.step}")
  assert summary["periodic_checkpoints"] == 3
  final = summary["checkpoint"]
  assert os.path.basename(final) == f"ckpt-{summary['global_step']}"
  # The deltas of the older full checkpoint went with the new full one.
  assert os.listdir(tmp_path / "m" / delta_checkpoints.DELTAS_DIR) == []
  killed = str(tmp_path / "killed")
  deltas_dir = os.path.dirname(snapshot.delta.replace(str(tmp_path / "m"), killed))
  full = os.path.join(killed, os.path.basename(deltas_dir))
  assert os.path.exists(full + ".index")
  delta_prefix = os.path.join(deltas_dir, os.path.basename(snapshot.delta))
  assert delta_checkpoints.deltas_after(killed, full) == [delta_prefix]
  # A delta holds the rows changed since the full checkpoint, fewer than the table had then.
  # (Against the full checkpoint itself, 5 global steps older and smaller, it is about as big:
  # 13,347 rows against 13,508 in one run, as many to the byte in another.)
  delta_rows = _saved_rows(delta_prefix)
  assert 0 < delta_rows < len(snapshot.rows["keys"]), (delta_rows, len(snapshot.rows["keys"]))
  assert _bytes(delta_prefix) < _bytes(final)

  at_start = _RowsAtStart()
  resumed = runner.run_parameter_server(_config(killed), callbacks=[at_start])
  assert resumed["start_global_step"] == snapshot.step
  for f in hash_table_ops.EXPORT_FIELDS:
    np.testing.assert_array_equal(at_start.rows[f], snapshot.rows[f], err_msg=f)
  assert resumed["global_step"] > snapshot.step


def _train_subprocess(*args):
  return script_process.run(list(args), timeout=120)


@pytest.mark.parametrize("args,message", [
    (("--full_checkpoint_every=2", "--checkpoint_every_steps=10"),
     "train.py: error: --full_checkpoint_every=2 writes hash-table deltas between full "
     "checkpoints: it needs --embedding=hash (with --embedding=vocab every checkpoint is full; "
     "drop the flag)."),
    (("--full_checkpoint_every=2", "--embedding=hash"),
     "train.py: error: --full_checkpoint_every=2 counts periodic checkpoints: set "
     "--checkpoint_every_steps or --checkpoint_every_secs."),
    (("--mode=sync", "--embedding=hash", "--full_checkpoint_every=2",
      "--checkpoint_every_steps=10"),
     "train.py: error: --mode=sync does not use --full_checkpoint_every (used by gba, async, bsp, "
     "hop_bs, hop_bw, async_tuned); drop it."),
    (("--full_checkpoint_every=0",),
     "train.py: error: --full_checkpoint_every must be >= 1 (1: every checkpoint full), got 0."),
])
def test_refusals_in_one_line(tmp_path, args, message):
  proc = _train_subprocess("--mode=gba", *args, f"--model_dir={tmp_path / 'm'}")
  assert proc.returncode == 2
  assert proc.stderr.strip() == message
  assert not os.path.exists(tmp_path / "m")
