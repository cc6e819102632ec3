"""Preemption drill: SIGTERM (a preemptible cluster's stop) at a random progress line, then a rerun.

The binary runs as a user runs it (real server processes on 127.0.0.1), without periodic
checkpoints: what the rerun resumes from is the checkpoint the signal wrote. The signal must stop
the run within the steps in flight, with exit 143 and one line on stderr naming that checkpoint;
the rerun of the same command resumes from it, trains nothing twice, ends at the global step of
an undisturbed run, with an AUC within noise of it (test_fault_drills._check_auc). On a
parameter-server mode (gba: the job runs under the binary's supervisor, which forwards the signal)
and on sync (the workers, in sessions of their own, stop together at a progress line).
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
from tests.e2e.test_fault_drills import _summary

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_STEPS = 400  # worker steps
_LOG_EVERY = 20
_TIME_LIMIT_S = 420  # each run's
# The line the binary prints for a run stopped by SIGTERM (tf_gba.common.interrupt.message).
_STOPPED = re.compile(r"train\.py: stopped by SIGTERM at global step (\d+): checkpoint (\S+) "
                      r"written; rerun the same command to resume from it\.")


def _command(mode, model_dir):
  return [sys.executable, os.path.join(_ROOT, "examples", "train.py"), f"--mode={mode}",
          "--num_ps=1", "--num_workers=2", f"--steps={_STEPS}", f"--log_every={_LOG_EVERY}",
          "--local_batch_size=64", "--eval_examples=4096", "--stragglers=none",
          "--data_options=num_examples=20000", f"--model_dir={model_dir}"]


def _run(mode, model_dir):
  return _Run(mode, model_dir, command=_command(mode, model_dir))


@pytest.mark.parametrize("mode", ["gba", "sync"])
def test_sigterm_checkpoints_and_the_rerun_resumes_from_it(tmp_path, mode):
  reference_dir = str(tmp_path / "undisturbed")
  reference_run = _run(mode, reference_dir)
  assert reference_run.finish(time.time() + _TIME_LIMIT_S) == 0, (
      "".join(reference_run.err)[-3000:])
  reference = _summary(reference_dir)

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
  # Within the interval in flight: at most one progress interval (and its settle) after the line.
  m = reference["num_aggregate"]
  assert global_step * m <= at + 2 * per_line + m, (global_step, at)
  assert stop_seconds < 60, stop_seconds
  assert not os.path.exists(os.path.join(model_dir, "summary.json"))

  rerun = _run(mode, model_dir)
  assert rerun.finish(time.time() + _TIME_LIMIT_S) == 0, "".join(rerun.err)[-3000:]
  summary = _summary(model_dir)
  assert summary["start_global_step"] == global_step
  assert summary["target_global_step"] == reference["global_step"] == _STEPS // m
  assert summary["global_step"] == reference["global_step"]
  assert summary["restarts"] == 1 and summary["restart_causes"] == []
  # Resumed from the signal's checkpoint, recorded as the run's progress: nothing redone.
  assert summary["steps_redone"] == 0
  assert summary["batches_reread"] == 0
  data_list = summary.get("data_list")
  if data_list:
    assert data_list["restored_batches"] + data_list["batches"] == _STEPS
    assert data_list["duplicates"] == 0
  _check_auc(summary, reference)
