"""Periodic checkpoints in every mode, and what a crash in the middle of writing one leaves."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
from tests import script_process
import pytest
import tensorflow as tf

from tf_gba.training import preflight


def _train(*args, timeout=400):
  return script_process.run(["--stragglers=none", "--local_batch_size=64", "--eval_examples=512",
                             "--data_options=num_examples=20000", "--export_dir=", *args],
                            timeout=timeout)


def _listed(model_dir):
  state = tf.train.get_checkpoint_state(model_dir)
  return [int(p.rsplit("-", 1)[1]) for p in state.all_model_checkpoint_paths]


@pytest.mark.parametrize("mode", ["gba", "async"])
def test_periodic_checkpoints_in_parameter_server_modes(tmp_path, mode):
  model_dir = str(tmp_path / "m")
  proc = _train(f"--mode={mode}", "--num_workers=2", "--steps=80", "--log_every=20",
                "--checkpoint_every_steps=20", "--keep_checkpoints=2", f"--model_dir={model_dir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(os.path.join(model_dir, "summary.json")) as f:
    summary = json.load(f)
  # After worker steps 20, 40 and 60; the one after 80 is the run's last checkpoint. Only the
  # newest two are kept: after 60 and 80 worker steps, i.e. global steps 60 / M and 80 / M.
  assert summary["periodic_checkpoints"] == 3
  m = summary["num_aggregate"]
  assert _listed(model_dir) == [60 // m, 80 // m] and summary["global_step"] == 80 // m


def test_periodic_checkpoints_in_sync_mode(tmp_path):
  model_dir = str(tmp_path / "m")
  # 2 workers, 40 worker steps = 20 global steps; every 10 worker steps = every 5 global steps.
  proc = _train("--mode=sync", "--num_workers=2", "--steps=40", "--log_every=10",
                "--checkpoint_every_steps=10", "--keep_checkpoints=10", f"--model_dir={model_dir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert _listed(model_dir) == [5, 10, 15, 20]


_WRITER = """
import sys, numpy as np, tensorflow as tf
v = tf.Variable(np.zeros((%d,), np.float32))
manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=v), sys.argv[1], max_to_keep=2)
n = int(sys.argv[2])  # each process numbers its checkpoints after the last one's
print("ready", flush=True)
while True:
  n += 1
  v.assign(tf.fill(v.shape, float(n)))
  manager.save(checkpoint_number=n)
"""


def test_a_crash_mid_write_leaves_the_previous_checkpoint_usable(tmp_path):
  """kill -9 of a process writing 64 MB checkpoints back to back, at random moments: each time
  the newest listed checkpoint reads back whole, with the values of its own number."""
  rng = random.Random(0)
  model_dir = str(tmp_path / "m")
  size = 16 << 20  # floats: 64 MB, so that a kill lands inside a write most of the time
  kills = 0
  for _ in range(4):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER % size, model_dir, str(kills * 10**6)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
      assert proc.stdout.readline().strip() == "ready"
      time.sleep(rng.uniform(0.5, 3.0))
    finally:
      proc.send_signal(signal.SIGKILL)
      proc.wait()
    kills += 1
    v = tf.Variable(np.zeros((size,), np.float32))

    def restore(path, v=v):
      tf.train.Checkpoint(v=v).read(path).assert_existing_objects_matched()

    path, skipped = preflight.restore_latest_usable(model_dir, restore, lambda line: None)
    if path is None:
      continue  # killed before the first save completed
    assert skipped == []
    number = int(path.rsplit("-", 1)[1])
    values = v.numpy()
    assert values[0] == number and values[-1] == number and np.all(values == number)
  assert kills == 4
  assert tf.train.get_checkpoint_state(model_dir) is not None  # at least one save completed
