"""Preemption drill: SIGTERM (a preemptible cluster's stop) at a random progress line, then a rerun.

The binary runs as a user runs it (real server processes on 127.0.0.1), without periodic
checkpoints: what the rerun resumes from is the checkpoint the signal wrote. The signal must stop
the run within the steps in flight, with exit 143 and one line on stderr naming that checkpoint;
the rerun of the same command resumes from it, trains nothing twice, ends at the global step of
an undisturbed run, with an AUC within noise of it (test_fault_drills._check_auc). On a
parameter-server mode (gba: the job runs under the binary's supervisor, which forwards the signal),
on sync (the workers, in sessions of their own, stop together at a progress line) and on DTS (the
workers stop together at a step the launcher names).
"""

import os
import random
import re
import signal
import sys
import time

import pytest

from tests.e2e.test_fault_drills import _Run
from tests.e2e.test_fault_drills import _check_auc
from tests.e2e.test_fault_drills import _command as _drill_command
from tests.e2e.test_fault_drills import _summary
from tests.e2e.test_fault_drills import _undisturbed

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_STEPS = 400  # worker steps
_LOG_EVERY = 20
_TIME_LIMIT_S = 420  # each run's
# The line the binary prints for a run stopped by SIGTERM (tf_gba.common.interrupt.message).
_STOPPED = re.compile(r"train\.py: stopped by SIGTERM at global step (\d+): checkpoint (\S+) "
                      r"written; rerun the same command to resume from it\.")


def _command(mode, model_dir):
  cluster = (["--num_workers=2"] if mode == "dts" else  # DTS: no PS, no stragglers
             ["--num_ps=1", "--num_workers=2", "--stragglers=none"])
  return [sys.executable, os.path.join(_ROOT, "examples", "train.py"), f"--mode={mode}",
          *cluster, f"--steps={_STEPS}", f"--log_every={_LOG_EVERY}", "--local_batch_size=64",
          "--eval_examples=4096", "--data_options=num_examples=20000", "--export_dir=",
          f"--model_dir={model_dir}"]


def _run(mode, model_dir):
  return _Run(mode, model_dir, command=_command(mode, model_dir))


def _reference(mode, tmp_path, tmp_path_factory):
  """The summary of an undisturbed run of `mode`. GBA's is the fault drills' own (the same
  command, and periodic checkpoints, which change nothing trained): one run for both modules."""
  if mode == "gba":
    ours = [a for a in _command(mode, "") if not a.startswith("--model_dir=")]
    drills = [a for a in _drill_command(mode, "")
              if not a.startswith(("--model_dir=", "--checkpoint_every_steps="))]
    assert sorted(ours) == sorted(drills), (ours, drills)
    return _undisturbed(mode, tmp_path_factory)
  reference_dir = str(tmp_path / "undisturbed")
  reference_run = _run(mode, reference_dir)
  assert reference_run.finish(time.time() + _TIME_LIMIT_S) == 0, (
      "".join(reference_run.err)[-3000:])
  return _summary(reference_dir)


@pytest.mark.parametrize("mode", ["gba", "sync"])
def test_sigterm_checkpoints_and_the_rerun_resumes_from_it(tmp_path, tmp_path_factory, mode):
  reference = _reference(mode, tmp_path, tmp_path_factory)

  model_dir = str(tmp_path / "m")
  # Worker steps of the progress line after which the signal comes (sync's lines are every
  # --log_every global steps of 2 worker steps each).
  per_line = _LOG_EVERY * (2 if mode == "sync" else 1)
  at = random.Random(os.getpid()).choice(range(per_line, _STEPS // 2 + 1, per_line))
  deadline = time.time() + _TIME_LIMIT_S
  run = _run(mode, model_dir)
  run.wait_for(f"step {at}/", deadline)
  sent = time.time()
  run.proc.send_signal(signal.SIGTERM)
  assert run.finish(deadline) == 143, (at, "".join(run.err)[-3000:])
  stop_seconds = time.time() - sent
  err = [l for l in "".join(run.err).splitlines() if l.strip()]
  assert len(err) == 1, (at, err)
  match = _STOPPED.fullmatch(err[0])
  assert match, err
  global_step, checkpoint = int(match.group(1)), match.group(2)
  assert os.path.exists(checkpoint + ".index")
  assert os.path.dirname(checkpoint) == model_dir
  assert checkpoint.endswith(f"ckpt-{global_step}")
  # Within the interval in flight: at most one progress interval (and its settle) after the line,
  # and the functions the workers were running (k worker steps each). On a parameter-server mode
  # a line reports the steps finished while one more function per worker stays queued behind
  # the running ones (tf_gba.training.pipelining: `spare`), so as many again may follow.
  m = reference["num_aggregate"]
  running = reference["num_workers"] * reference.get("steps_per_execution", 1)
  queued = running if mode != "sync" else 0
  assert global_step * m <= at + 2 * per_line + running + queued + m, (
      global_step, at, running, queued)
  assert stop_seconds < 60, stop_seconds
  assert not os.path.exists(os.path.join(model_dir, "summary.json"))

  rerun = _run(mode, model_dir)
  assert rerun.finish(time.time() + _TIME_LIMIT_S) == 0, "".join(rerun.err)[-3000:]
  summary = _summary(model_dir)
  assert summary["start_global_step"] == global_step
  assert summary["target_global_step"] == reference["global_step"] == _STEPS // m
  assert summary["global_step"] == reference["global_step"]
  assert summary["restarts"] == 1 and summary["restart_causes"] == [], (
      summary["restarts"], summary["restart_causes"], "".join(rerun.err)[-3000:])
  # Resumed from the signal's checkpoint, recorded as the run's progress: nothing redone.
  assert summary["steps_redone"] == 0
  assert summary["batches_reread"] == 0
  data_list = summary.get("data_list")
  if data_list:
    assert data_list["restored_batches"] + data_list["batches"] == _STEPS
    assert data_list["duplicates"] == 0
  _check_auc(summary, reference)


def test_sigterm_stops_dts_workers_together_and_the_rerun_resumes(tmp_path):
  """DTS's workers cannot vote on stopping (their exchanges own the collectives): at SIGTERM the
  launcher names a step a few past every worker's report (tf_gba.training.dts_job.StopAgreement),
  where all of them synchronize and write their checkpoints; the rerun resumes there."""
  reference = _reference("dts", tmp_path, None)
  per_worker = _STEPS // 2

  model_dir = str(tmp_path / "m")
  at = random.Random(os.getpid()).choice(range(5, per_worker // 2))
  deadline = time.time() + _TIME_LIMIT_S
  run = _run("dts", model_dir)
  report = os.path.join(model_dir, "tf_gba_stop_request.worker_0")  # worker 0's step
  while True:
    assert time.time() < deadline and run.proc.poll() is None, "".join(run.err)[-3000:]
    try:
      with open(report) as f:
        if int(f.read() or 0) >= at:
          break
    except (FileNotFoundError, ValueError):
      pass
    time.sleep(0.05)
  run.proc.send_signal(signal.SIGTERM)
  assert run.finish(deadline) == 143, (at, "".join(run.err)[-3000:])
  err = [l for l in "".join(run.err).splitlines() if l.strip()]
  assert len(err) == 1, (at, err)
  match = _STOPPED.fullmatch(err[0])
  assert match, err
  global_step, checkpoint = int(match.group(1)), match.group(2)
  assert checkpoint == os.path.join(model_dir, "dts", "worker_0", f"ckpt-{global_step}")
  assert all(os.path.exists(os.path.join(model_dir, "dts", f"worker_{i}",
                                         f"ckpt-{global_step}.index")) for i in range(2))
  # The step named: past `at`, by at most the margin (delay 4 + period 4, defaults) and the steps
  # a worker took between its report and the request.
  assert at < global_step <= at + 2 + 2 * (4 + 4) + 10, (at, global_step)
  assert not os.path.exists(os.path.join(model_dir, "summary.json"))

  rerun = _run("dts", model_dir)
  assert rerun.finish(time.time() + _TIME_LIMIT_S) == 0, "".join(rerun.err)[-3000:]
  summary = _summary(model_dir)
  assert summary["start_global_step"] == global_step
  assert summary["global_step"] == reference["global_step"] == per_worker
  assert summary["steps"] == (per_worker - global_step) * 2  # nothing trained twice
  _check_auc(summary, reference)
