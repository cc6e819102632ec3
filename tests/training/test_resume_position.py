"""Resume positions: the shared data list taken up where the checkpoint left it.

The list's logic against a NumPy reference, and a drill on real processes: a day-mode GBA run
whose coordinator is killed (SIGKILL) mid-day, then rerun with the same command. Over the killed
run and its rerun every batch of the day is trained, and the batches trained twice are exactly
those the killed run trained after its last checkpoint, all counted from the batch ids.
"""

import glob
import os
import signal
import time

import numpy as np
import pytest

from tests.e2e import test_fault_drills as drills
from tf_gba.data import data_list as data_list_lib
from tf_gba.training import recovery


def _reference_remaining(batch_order, passes, num_batches, seen):
  """Pass k keeps the batches trained at most k times, in that pass's order."""
  out = []
  for k in range(passes):
    for b in batch_order[k * num_batches:(k + 1) * num_batches]:
      if seen[b] <= k:
        out.append(int(b))
  return out


@pytest.mark.parametrize("passes", [1, 3])
def test_skip_trained_keeps_the_untrained_entries_of_each_pass(passes):
  rows = 1000
  feats = {"x": np.arange(rows, dtype=np.int64)}
  lst = data_list_lib.DataList(feats, np.zeros(rows, np.float32), batch_size=64, seed=5,
                               passes=passes)
  nb = lst.num_batches
  original = lst.batch_order.copy()
  rng = np.random.default_rng(1)
  seen = rng.integers(0, passes + 1, nb)
  dropped = lst.skip_trained(seen)
  expected = _reference_remaining(original, passes, nb, seen)
  assert lst.batch_order.tolist() == expected
  assert dropped == len(original) - len(expected)
  # Over what was trained and what is left, each batch is listed `passes` times.
  counts = seen + np.bincount(lst.batch_order, minlength=nb)
  assert (counts == passes).all()


def test_skip_trained_adds_passes_for_the_steps_left_and_refuses_another_list():
  rows = 640
  lst = data_list_lib.DataList({"x": np.zeros(rows, np.int64)}, np.zeros(rows, np.float32),
                               batch_size=64, seed=0)
  lst.skip_trained(np.ones(10, np.int64), min_entries=15)
  # One pass trained, two listed anew: three listings of each batch in all.
  assert len(lst.batch_order) == 20 and lst.passes == 3
  assert sorted(lst.batch_order.tolist()) == sorted(list(range(10)) * 2)
  with pytest.raises(ValueError, match="shape"):
    lst.skip_trained(np.zeros(7, np.int64))


_ROWS = 25600   # 400 batches of 64
_BATCH = 64


def _day_command(model_dir):
  cmd = drills._command("gba", model_dir)
  cmd = [c for c in cmd if not c.startswith(("--steps=", "--data_options="))]
  return cmd + [f"--data_options=num_examples={_ROWS}", "--keep_checkpoints=100"]


class _DayRun(drills._Run):

  def __init__(self, model_dir):  # pylint: disable=super-init-not-called
    import subprocess, sys, threading  # pylint: disable=g-import-not-at-top,multiple-imports
    self.proc = subprocess.Popen(_day_command(model_dir), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=drills._env(model_dir),
                                 cwd=drills._ROOT)
    self.out, self.err = [], []
    self._threads = [threading.Thread(target=self._pump, args=(s, b), daemon=True)
                     for s, b in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
    for t in self._threads:
      t.start()


def _position(model_dir, global_step, name="data_position/seen"):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  reader = tf.train.load_checkpoint(os.path.join(model_dir, f"ckpt-{global_step}"))
  return reader.get_tensor(f"{name}/.ATTRIBUTES/VARIABLE_VALUE").astype(np.int64)


def test_killed_coordinator_mid_day_resumes_the_days_list(tmp_path):
  model_dir = str(tmp_path / "m")
  deadline = time.time() + drills._TIME_LIMIT_S
  run = _DayRun(model_dir)
  run.wait_for("step 140/", deadline)
  tree = [run.proc.pid] + drills._descendants(run.proc.pid)
  os.kill(run.proc.pid, signal.SIGKILL)
  run.finish(deadline)
  while time.time() < deadline and any(drills._alive(p) for p in tree):
    time.sleep(0.5)
  assert not any(drills._alive(p) for p in tree)
  # What the killed run had trained at its last progress line (at least).
  recorded = recovery.read_seen(model_dir)
  assert recorded is not None
  assert len(glob.glob(os.path.join(model_dir, "ckpt-*.index"))) >= 1

  rerun = _DayRun(model_dir)
  assert rerun.finish(deadline) == 0, "".join(rerun.err)[-3000:]
  out = "".join(rerun.out)
  assert "resuming an interrupted day (restart 1)" in out, out[-3000:]
  s = drills._summary(model_dir)
  nb = _ROWS // _BATCH
  assert s["restarts"] == 1 and s["start_global_step"] > 0
  before = _position(model_dir, s["start_global_step"])  # the checkpoint resumed from
  after = _position(model_dir, s["global_step"])          # the rerun's last checkpoint
  rerun_counts = after - before
  assert before.shape == (nb,) and set(np.unique(before)) <= {0, 1}
  assert 0 < before.sum() < nb
  # The rerun trained exactly the batches the checkpoint had not: each batch once overall.
  assert (rerun_counts == 1 - before).all()
  assert s["data_list"]["batches"] == nb - before.sum() == s["steps"]
  assert s["data_list"]["missed"] == 0 and s["data_list"]["duplicates"] == 0
  assert s["data_list"]["lost"] == 0 and s["data_list"]["restored_batches"] == before.sum()
  # Over the killed run (as recorded) and the rerun: every batch trained, and the ones trained
  # twice are exactly those trained after the checkpoint.
  overall = recorded + rerun_counts
  assert (overall >= 1).all()
  twice = set(np.flatnonzero(overall == 2).tolist())
  after_checkpoint = set(np.flatnonzero(recorded - before > 0).tolist())
  assert twice == after_checkpoint
  assert (overall <= 2).all()
  assert s["batches_reread"] == s["data_list"]["batches_reread"] == len(after_checkpoint)
  # Within one checkpoint interval (40 worker steps) of batches.
  assert len(after_checkpoint) <= 40
  assert s["global_step"] == s["target_global_step"]
  # The straggler position went on from the checkpoint's: each worker's steps of the rerun
  # follow those the checkpoint had counted.
  steps_before = _position(model_dir, s["start_global_step"], "straggler_position/steps")
  steps_after = _position(model_dir, s["global_step"], "straggler_position/steps")
  assert (steps_before > 0).all() and steps_before.sum() == before.sum()
  np.testing.assert_array_equal(steps_after - steps_before,
                                [w["steps"] for w in s["per_worker"]])
  clock_before = _position(model_dir, s["start_global_step"], "straggler_position/elapsed_ns")
  clock_after = _position(model_dir, s["global_step"], "straggler_position/elapsed_ns")
  assert (clock_after > clock_before).all() and (clock_before > 0).all()


def _run_steps(ops, profile, n):
  """Delays (seconds) of `n` steps run here under `profile`, with GBA>StepBegin/End."""
  delays = []
  for _ in range(n):
    start = ops.gba_step_begin()
    delays.append(float(ops.gba_step_end(start, profile=profile, seed=7).numpy()))
  return np.array(delays)


def test_straggler_sequence_continues_from_the_position_set():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_gba.distribute import stragglers  # pylint: disable=g-import-not-at-top
  ops = stragglers._ops()  # pylint: disable=protected-access
  # A 10 ms compute floor: a step at factor 1 is delayed at most 10 ms, at factor 3 at least 20.
  profile = stragglers.parse("compute:10+transient:0.5:3")
  # The position is process-wide: put it back afterwards for the tests that run after this one.
  before = ops.gba_worker_step_stats().numpy()
  try:
    _check_positions(ops, profile, stragglers)
  finally:
    ops.gba_set_step_position(tf.constant(int(before[4]), tf.int64),
                              tf.constant(int(before[5]), tf.int64))


def _check_positions(ops, profile, stragglers):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  ops.gba_set_step_position(tf.constant(1000, tf.int64), tf.constant(0, tf.int64))
  delays = _run_steps(ops, profile, 24)
  factors, floor = stragglers.slowdown_factors([0] * 24, list(range(1000, 1024)), [0.0] * 24,
                                               profile, 7)
  assert floor == pytest.approx(0.010)
  assert set(np.unique(factors)) == {1.0, 3.0}  # both kinds among the draws
  np.testing.assert_array_equal(delays >= 0.015, factors == 3.0)
  assert int(ops.gba_worker_step_stats().numpy()[4]) == 1024  # the next step's position
  # The trace clock: 50 s in, a 10 s window is the sixth, whose factor is 4.
  trace = "compute;10+trace;10.0;0=1:1:1:1:1:4"
  ops.gba_set_step_position(tf.constant(0, tf.int64), tf.constant(50 * 10**9, tf.int64))
  assert (_run_steps(ops, trace, 3) >= 0.025).all()
  assert int(ops.gba_worker_step_stats().numpy()[5]) >= 50 * 10**9
  ops.gba_set_step_position(tf.constant(0, tf.int64), tf.constant(0, tf.int64))
  assert (_run_steps(ops, trace, 3) <= 0.0105).all()
  with pytest.raises(tf.errors.InvalidArgumentError, match=">= 0"):
    ops.gba_set_step_position(tf.constant(-1, tf.int64), tf.constant(0, tf.int64))
