"""A periodic checkpoint save held past its limit ends the job for a restart (save_watch)."""

import json
import os
import re
import signal
import threading
import time

import pytest
import tensorflow as tf

from benchmarks import process_tree
from tests import script_process
from tf_gba.training import recovery
from tf_gba.training import save_watch
from tf_gba.training.shared_input import DEFAULT_STALL_TIMEOUT_S

_HELD_SAVE_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "held_save_job.py")


def _run(tmp_path):
  d = str(tmp_path)
  recovery.begin(d, "gba", 400, 0, target_if_new=100)
  return d


@pytest.mark.parametrize("stall, longest", [(20.0, None), (300.0, None), (20.0, 1.0),
                                            (20.0, 9.0), (2.0, 0.25)])
def test_the_limit_is_the_stall_limit_or_a_multiple_of_the_longest_save(stall, longest):
  # Independent reference: the first save may take the default limit (it traces its function);
  # later ones the stall limit, or 4 times the longest save where that is more.
  expected = max(stall, 120.0) if longest is None else max(stall, 4 * longest)
  assert save_watch.save_limit(stall, longest) == pytest.approx(expected)
  assert DEFAULT_STALL_TIMEOUT_S == 120.0


def test_a_save_held_past_the_limit_ends_the_job_in_one_line_for_a_restart(tmp_path, capsys):
  d = _run(tmp_path)
  recovery.record_save_seconds(d, 0.05)  # a save before: limit max(0.3, 4 x 0.05) = 0.3 s
  exited = threading.Event()
  codes = []

  def exit_now(code):
    codes.append(code)
    exited.set()

  began = time.time()
  with save_watch.watched(d, 0.3, exit_now=exit_now):
    assert exited.wait(10.0), "a held save was not ended"
  held = time.time() - began
  assert codes == [recovery.EXIT_RESTART]
  assert 0.3 <= held < 5.0
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("tf_gba: a checkpoint save has waited 0 s"), err
  assert "--stall_timeout_s" in err[0]
  assert recovery.read(d)["restart_causes"] == ["Stalled"]


def test_a_save_in_time_records_its_duration_and_exits_nothing(tmp_path, capsys):
  d = _run(tmp_path)
  codes = []
  with save_watch.watched(d, 0.5, exit_now=codes.append):
    time.sleep(0.2)
  time.sleep(0.6)  # past the limit: the watch of a save that ended does nothing
  assert codes == [] and capsys.readouterr().err == ""
  first = recovery.longest_save_seconds(d)
  assert 0.2 <= first < 0.5
  with save_watch.watched(d, 0.5, exit_now=codes.append):
    pass
  assert recovery.longest_save_seconds(d) == first  # the longest is kept
  # A slower save than 4x the longest but within --stall_timeout_s is no stall.
  with save_watch.watched(d, 5.0, exit_now=codes.append):
    time.sleep(4 * first + 0.2)
  assert codes == []


def test_the_longest_save_is_kept_over_resumptions_and_not_into_a_new_run(tmp_path):
  d = _run(tmp_path)
  assert recovery.longest_save_seconds(d) is None
  recovery.record_save_seconds(d, 3.0)
  recovery.report(d, 40)
  recovery.begin(d, "gba", 400, 20, target_if_new=120)  # resumed after a failure
  assert recovery.longest_save_seconds(d) == 3.0
  recovery.report(d, 100, finished=True)
  recovery.begin(d, "gba", 400, 100, target_if_new=200)  # a new run of the same command
  assert recovery.longest_save_seconds(d) is None


def test_the_chaos_drill_reads_the_line_as_the_restart_s_cause():
  from benchmarks import chaos  # pylint: disable=g-import-not-at-top
  prefix = chaos._SAVE_HELD  # pylint: disable=protected-access
  assert ("tf_gba: " + save_watch.stalled_message(20.0)).startswith(prefix)


def _pids(path: str):
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [int(p) for p in f.read().split()]


def _gone(pid: int, within_s: float) -> bool:
  deadline = time.time() + within_s
  while time.time() < deadline:
    if not process_tree.alive(pid):
      return True
    time.sleep(0.2)
  return False


def test_a_save_held_by_a_stopped_parameter_server_ends_the_job_and_the_rerun_resumes(tmp_path):
  """Real servers: the binary's second periodic save finds its parameter server stopped
  (SIGSTOP: alive, not answering, as behind a stalled link). The job ends past the save's limit
  in one line, exit 75, with the restart's cause recorded; the unfinished checkpoint is not
  listed, and the same command resumes from the first and ends at its target. --input=sharded:
  the step watchdog of the shared list (the same --stall_timeout_s) has no part in it."""
  model_dir, pids_file = str(tmp_path / "m"), str(tmp_path / "stopped")
  # 120 worker steps, a checkpoint every 40.
  flags = ["--mode=gba", "--num_workers=2", "--input=sharded", "--steps=120", "--log_every=20",
           "--checkpoint_every_steps=40", "--stragglers=none", "--local_batch_size=64",
           "--eval_examples=512", "--data_options=num_examples=20000", "--export_dir=",
           f"--model_dir={model_dir}"]
  try:
    # The held save's limit: 3 s, or 4x the first save where that is more.
    held = script_process.run(["2", pids_file, "--max_restarts=0", "--stall_timeout_s=3"] + flags,
                              script=_HELD_SAVE_JOB, timeout=120)
    assert held.returncode == recovery.EXIT_RESTART, held.stderr[-3000:]
    lines = [l for l in held.stderr.splitlines() if l.strip()]
    said = [l for l in lines if l.startswith("tf_gba: a checkpoint save has waited")]
    assert len(said) == 1 and "--stall_timeout_s" in said[0], lines
    assert "Traceback" not in held.stderr, held.stderr[-3000:]
    assert recovery.read(model_dir)["restart_causes"] == ["Stalled"]
    m = int(re.search(r" M=(\d+) ", held.stdout).group(1))
    # The first periodic checkpoint is the newest listed; the held one was never listed.
    state = tf.train.get_checkpoint_state(model_dir)
    assert state.model_checkpoint_path.endswith(f"ckpt-{40 // m}"), state
  finally:
    # Let the stopped servers go on (also when the job hung): they see their job gone and end.
    stopped = _pids(pids_file)
    for pid in stopped:
      try:
        os.kill(pid, signal.SIGCONT)
      except ProcessLookupError:
        pass
  assert stopped and all(_gone(pid, 30) for pid in stopped), stopped

  # (At the default limit: a loaded machine's saves are not taken for stalls.)
  rerun = script_process.run(flags, timeout=300)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert "resuming an interrupted run (restart 1)" in rerun.stdout, rerun.stdout[-3000:]
  with open(os.path.join(model_dir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["global_step"] == summary["target_global_step"] == 120 // m
  assert summary["restart_causes"] == ["Stalled"] and summary["restarts"] == 1
  # From the checkpoint at worker step 40, held at 80: one interval trained again.
  assert summary["start_global_step"] == 40 // m
  assert summary["steps_redone"] <= 40 // m
