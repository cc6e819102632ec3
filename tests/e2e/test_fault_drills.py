"""Fault drills: kill -9 of a worker, a parameter server or the coordinator in the middle of a run.

Each drill runs the training binary as a user does (a subprocess, forked as
tests/script_process.py starts it; real server processes on 127.0.0.1), waits until training is
under way, kills one process with SIGKILL and checks that the run (or, for the coordinator, the
rerun of the same command) ends at the requested global step, with at most one checkpoint
interval of steps trained again, and an AUC no more than 0.03 below the one of an undisturbed
run. Every drill runs under a time limit: a hang fails it.
"""

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest

from benchmarks import process_tree
from tests import script_process

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_STEPS = 400          # worker steps
_CHECKPOINT_EVERY = 40  # worker steps
_TIME_LIMIT_S = 420


def _command(mode, model_dir):
  # No serving export: what a drill checks is the training state a resumption restores (the
  # export of a run is tests/training/test_serving_export.py's).
  return [sys.executable, os.path.join(_ROOT, "examples", "train.py"), f"--mode={mode}",
          "--num_ps=1", "--num_workers=2", f"--steps={_STEPS}", "--log_every=20",
          f"--checkpoint_every_steps={_CHECKPOINT_EVERY}", "--local_batch_size=64",
          "--eval_examples=4096", "--stragglers=none", "--data_options=num_examples=20000",
          "--export_dir=", f"--model_dir={model_dir}"]


def _env(model_dir):
  """The binary's environment. TMPDIR beside `model_dir`, in pytest's temporary directory, for
  every process of the job: a process a drill kills cannot remove what it wrote there
  (AutoGraph's generated sources), and pytest removes it with its old runs."""
  tmp = os.path.join(os.path.dirname(os.path.abspath(model_dir)), "tmp")
  os.makedirs(tmp, exist_ok=True)
  return dict(os.environ, TMPDIR=tmp,
              PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


class _Run:
  """The binary as a subprocess, its output collected as it comes."""

  def __init__(self, mode, model_dir, command=None):
    command = command or _command(mode, model_dir)
    assert command[:2] == [sys.executable, os.path.join(_ROOT, "examples", "train.py")], command
    self.proc = script_process.start(command[2:], env=_env(model_dir), cwd=_ROOT)
    self.out, self.err = [], []
    self._threads = [threading.Thread(target=self._pump, args=(s, b), daemon=True)
                     for s, b in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
    for t in self._threads:
      t.start()

  @staticmethod
  def _pump(stream, lines):
    for line in stream:
      lines.append(line)

  def wait_for(self, text, deadline):
    """Until a stdout line contains `text`, or, for "step N/", a progress line of step >= N
    (the replicated modes print the step count a line finds, not a multiple of --log_every)."""
    step = re.fullmatch(r"step (\d+)/", text)
    while time.time() < deadline:
      if any(text in line for line in self.out):
        return
      if step and any(int(m.group(1)) >= int(step.group(1)) for m in
                      (re.match(r"step (\d+)/", line) for line in self.out) if m):
        return
      if self.proc.poll() is not None:
        break
      time.sleep(0.2)
    pytest.fail(f"{text!r} not seen; stdout:\n{''.join(self.out)[-3000:]}\nstderr:\n"
                f"{''.join(self.err)[-3000:]}")

  def finish(self, deadline):
    try:
      rc = self.proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
      _kill_tree(self.proc.pid)
      pytest.fail(f"no end before the time limit (a hang); stdout:\n{''.join(self.out)[-3000:]}")
    for t in self._threads:
      t.join(10)
    return rc


_children = process_tree.children
_descendants = process_tree.descendants
_cmdline = process_tree.cmdline
_comm = process_tree.comm
_task = process_tree.task


def _server(root_pid, job, index):
  for pid in _descendants(root_pid):
    if _task(pid) == f"{job}:{index}":
      return pid
  pytest.fail(f"no {job}:{index} server under process {root_pid}")


def _kill_tree(pid):
  for p in [pid] + _descendants(pid):
    try:
      os.kill(p, signal.SIGKILL)
    except ProcessLookupError:
      pass


_alive = process_tree.alive


def _latest_checkpoint_step(model_dir):
  """The step of model_dir's newest checkpoint (0: none yet), from the state file that
  tf.train.CheckpointManager rewrites after each save."""
  try:
    with open(os.path.join(model_dir, "checkpoint")) as f:
      found = re.search(r'^model_checkpoint_path: "ckpt-(\d+)"', f.read(), re.M)
  except OSError:
    return 0
  return int(found.group(1)) if found else 0


def _summary(model_dir):
  with open(os.path.join(model_dir, "summary.json")) as f:
    return json.load(f)


def _undisturbed(mode, tmp_path_factory):
  """The summary of the same run with no fault: once per mode and test run. The drills run in
  processes of their own (tests/module_process.py), so the run is kept in the run's temporary
  directory; the first drill of a mode makes it while the others wait on its lock."""
  shared = os.environ.get("TF_GBA_TEST_RUN_TMPDIR") or str(tmp_path_factory.getbasetemp())
  model_dir = os.path.join(shared, f"fault_drills_undisturbed_{mode}")
  os.makedirs(model_dir, exist_ok=True)
  with open(os.path.join(shared, f"fault_drills_undisturbed_{mode}.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not os.path.exists(os.path.join(model_dir, "summary.json")):
      shutil.rmtree(model_dir)  # a run that failed part way: again from the start
      deadline = time.time() + _TIME_LIMIT_S
      run = _Run(mode, model_dir)
      assert run.finish(deadline) == 0, "".join(run.err)[-3000:]
    return _summary(model_dir)


def _check_auc(summary, reference):
  """A resume that lost or mixed up state (a replica or embedding not restored, slots of another
  variable) ends below the undisturbed run of the same seed. One-sided: a resumed run has trained
  the redone steps on top (counted and bounded by the callers), and the workers' timing orders
  the pushes differently in every run. Measured on shadow_ma (--num_workers=2, 400 steps):
  undisturbed 0.683-0.707 over 12 runs, resumed after a lost worker or server 0.701-0.714 over
  11."""
  assert summary["eval_auc"] > reference["eval_auc"] - 0.03, (summary["eval_auc"],
                                                              reference["eval_auc"])


def _check_finished(summary, mode, reference, rerun_steps=0):
  """`rerun_steps`: worker steps that may have run twice (see the killed-worker drill)."""
  m = summary["num_aggregate"]
  assert summary["target_global_step"] == _STEPS // m
  assert 0 <= summary["global_step"] - summary["target_global_step"] <= rerun_steps // m, (
      summary["global_step"], summary["target_global_step"])
  # At most one checkpoint interval (in global steps) trained again, per restart.
  assert summary["steps_redone"] <= _CHECKPOINT_EVERY // m * max(1, summary["restarts"])
  if summary.get("data_list"):
    # Counted from the batch ids at the last progress line, which the workers do not stop for
    # (tf_gba.training.pipelining): the counts and the global step read there agree within the
    # steps that finish between the two reads (a worker runs the steps of its function one after
    # another, with no round trip to the coordinator between them: up to a function's k steps,
    # one running and one queued function per worker) and a partial global step.
    workers, k = summary["num_workers"], summary.get("steps_per_execution", 1)
    assert abs(summary["batches_reread"] - summary["steps_redone"] * m) <= 2 * workers * k + m - 1, (
        summary["batches_reread"], summary["steps_redone"], m, k)
  else:
    assert summary["batches_reread"] == summary["steps_redone"] * m
  _check_auc(summary, reference)
  assert summary["mode"] == mode
  data_list = summary.get("data_list")
  if data_list and summary["restarts"]:
    # The resumed list went on from the checkpoint's data position: the batches trained before
    # it and after it make up the requested steps, none trained more often than listed. A
    # checkpoint written while a restarted worker could not be read keeps the position saved
    # before it, behind the model (runner._Job.save_checkpoint): the batches between are listed
    # and trained again, and reported as `uncounted_batches` (the global steps restored x M less
    # the position's count). Measured: a worker killed at global step 50 whose failure TF's runtime
    # raised as a RuntimeFault: ckpt-120 with the position of 120 batches, 120 reported (and
    # ckpt-100 with 120, 80 reported).
    assert data_list["restored_batches"] > 0
    uncounted = data_list.get("uncounted_batches", 0)
    assert data_list["restored_batches"] + uncounted + data_list["batches"] == _STEPS, data_list
    assert data_list["duplicates"] == 0


@pytest.mark.parametrize("mode", ["gba", "async"])
def test_killed_worker_is_restarted_and_the_run_goes_on(tmp_path, tmp_path_factory, mode):
  reference = _undisturbed(mode, tmp_path_factory)
  model_dir = str(tmp_path / "m")
  deadline = time.time() + _TIME_LIMIT_S
  run = _Run(mode, model_dir)
  run.wait_for("step 100/", deadline)
  os.kill(_server(run.proc.pid, "worker", 0), signal.SIGKILL)
  assert run.finish(deadline) == 0, "".join(run.err)[-3000:]
  summary = _summary(model_dir)
  # A worker is started again in place: the job goes on without a restart of its own (other
  # than for a fault of TF's runtime, see _resumed_run: TF's coordinator re-raised the worker's
  # failure, and the job resumed from its last checkpoint; the worker's restart still counts).
  assert summary["worker_restarts"] >= 1, "".join(run.err)[-3000:]
  assert set(summary["restart_causes"]) <= set(_RUNTIME_CAUSES)
  assert summary["restarts"] == _runtime_faults(summary, run), "".join(run.err)[-3000:]
  # The restarted worker's rate over the run is unknown (its new process counted from zero);
  # the others' are measured. After a restart of the job its new cluster's workers all count
  # from its start.
  rates = [w["qps"] for w in summary["per_worker"]]
  assert all(q > 0 for q in rates[1:]), rates
  assert (rates[0] is None) == (summary["restarts"] == 0), (rates, summary["restarts"])
  data_list = summary.get("data_list")
  if data_list and summary["restarts"] == 0:
    # The restarted worker keeps the batches its first process trained (read at the progress
    # lines before the kill); only those after the last read are uncounted: at most a progress
    # interval (20) and a function. Credited with its new process's alone, it lost about 50.
    k = summary.get("steps_per_execution", 1)
    assert data_list["workers_restarted_in_run"] == 1, data_list
    assert 0 <= data_list["uncounted_by_restarted_workers"] <= 20 + k, data_list
  # ParameterServerStrategy runs the step a killed worker was running again on its restarted
  # process: when the worker died after that step's push reached the parameter server, the
  # push happens again, with the next batch of the list. So one worker step per restart may run
  # twice (in async mode, where M = 1, that is one more global step).
  _check_finished(summary, mode, reference, rerun_steps=summary["worker_restarts"])


# Restarts no kill of a drill causes: a request a server received unreadable, or a call that never
# returned (the stall watchdog), both seen intermittently inside TF's runtime under load.
_RUNTIME_CAUSES = ("RuntimeFault", "Stalled")


def _runtime_faults(summary, run):
  """The restarts the job took for a fault of TF's runtime (_RUNTIME_CAUSES): each is reported
  as a warning, so that a run that needed one shows in the suite's summary."""
  faults = sum(summary["restart_causes"].count(c) for c in _RUNTIME_CAUSES)
  if faults:
    warnings.warn(f"{faults} restart(s) after a fault inside TensorFlow's runtime: "
                  + " | ".join(l.strip() for l in run.err if "restart" not in l and l.strip()))
  return faults


def _resumed_run(mode, model_dir, deadline, kill, cause):
  """Runs the binary to worker step 140, calls `kill(run)`, and returns the finished (or rerun)
  job's summary after checking that the kill made it resume once from a periodic checkpoint.
  `cause`: the class of the loss the job records for the kill (None: the coordinator itself was
  killed, and records nothing)."""
  run = _Run(mode, model_dir)
  run.wait_for("step 140/", deadline)
  run = kill(run) or run
  assert run.finish(deadline) == 0, "".join(run.err)[-3000:]
  assert "resuming an interrupted run (restart 1)" in "".join(run.out)
  summary = _summary(model_dir)
  # One restart for the kill, recorded as that loss. Any other must be a recorded fault of TF's
  # runtime; with what the run printed, a restart of any other cause (a second loss) says what it
  # was.
  context = ("".join(run.out)[-3000:], "".join(run.err)[-3000:])
  assert [c for c in summary["restart_causes"] if c not in _RUNTIME_CAUSES] == (
      [cause] if cause else []), (summary["restart_causes"], context)
  assert summary["restarts"] == 1 + _runtime_faults(summary, run), context
  assert summary["start_global_step"] > 0  # from a periodic checkpoint, not from scratch
  return run, summary


# The parameter server and coordinator drills run GBA only: every parameter-server mode resumes
# through the same code (scaled by its M), and async's own case (M = 1, where a worker step run
# twice is a global step) is the killed worker's drill.
@pytest.mark.parametrize("mode", ["gba"])
def test_killed_parameter_server_resumes_from_the_last_checkpoint(tmp_path, tmp_path_factory,
                                                                  mode):
  reference = _undisturbed(mode, tmp_path_factory)
  deadline = time.time() + _TIME_LIMIT_S

  def kill_ps(run):
    os.kill(_server(run.proc.pid, "ps", 0), signal.SIGKILL)

  run, summary = _resumed_run(mode, str(tmp_path / "m"), deadline, kill_ps, "ParameterServerLost")
  err = "".join(run.err)
  assert "ps:0 died or became unreachable" in err and "restarting the job" in err
  # The supervisor restarts the job itself: the loss's line does not tell the user to rerun.
  assert "Rerun the same command" not in err, err[-3000:]
  _check_finished(summary, mode, reference)


def test_killed_parameter_server_resumes_from_full_and_hash_table_deltas(tmp_path):
  """--embedding=hash with --full_checkpoint_every=3: periodic checkpoints at worker steps 40
  (full), 80 and 120 (deltas of the table), 160 (full). A parameter server killed at step 140
  takes its table shard with it; the job resumes from the full checkpoint and both deltas, at
  the last delta's global step: nothing is lost beyond it. (That the table restored equals, row
  by row, what the delta held is tests/training/test_hash_delta_checkpoints.py's check.)"""
  model_dir = str(tmp_path / "m")
  deadline = time.time() + _TIME_LIMIT_S
  # One step per function: the kill must fall between the checkpoints of steps 120 and 160, and
  # with functions of 10 steps the first progress line past 140 can come after the second.
  command = _command("gba", model_dir) + ["--embedding=hash", "--full_checkpoint_every=3",
                                          "--steps_per_execution=1"]
  run = _Run("gba", model_dir, command=command)
  run.wait_for("step 140/", deadline)
  os.kill(_server(run.proc.pid, "ps", 0), signal.SIGKILL)
  assert run.finish(deadline) == 0, "".join(run.err)[-3000:]
  out, err = "".join(run.out), "".join(run.err)
  assert "ps:0 died or became unreachable" in err and "restarting the job" in err
  summary = _summary(model_dir)
  assert [c for c in summary["restart_causes"] if c not in _RUNTIME_CAUSES] == [
      "ParameterServerLost"], (summary["restart_causes"], out[-3000:], err[-3000:])
  restored = re.findall(r" restored from (\S+) \(global step (\d+)\)", out)
  assert restored, out[-3000:]
  path, step = restored[-1][0], int(restored[-1][1])
  m = summary["num_aggregate"]
  # The chain's last delta: worker step 120's, numbered by its global step.
  assert re.search(rf"/deltas/ckpt-{40 // m}/delta-{step}$", path), (path, step)
  assert step == 120 // m == summary["start_global_step"]
  assert summary["target_global_step"] == summary["global_step"] == _STEPS // m
  # The run's last checkpoint is full, and no delta of an older full one is left.
  assert os.path.basename(summary["checkpoint"]) == f"ckpt-{_STEPS // m}"
  assert os.listdir(os.path.join(model_dir, "deltas")) == []


@pytest.mark.parametrize("mode", ["gba"])
def test_killed_coordinator_resumes_when_the_command_is_rerun(tmp_path, tmp_path_factory, mode):
  reference = _undisturbed(mode, tmp_path_factory)
  model_dir = str(tmp_path / "m")
  deadline = time.time() + _TIME_LIMIT_S

  def kill_coordinator(run):
    tree = [run.proc.pid] + _descendants(run.proc.pid)
    os.kill(run.proc.pid, signal.SIGKILL)  # the command the user started
    run.finish(deadline)
    # The job under it and every server go by themselves.
    while time.time() < deadline and any(_alive(p) for p in tree):
      time.sleep(0.5)
    assert not any(_alive(p) for p in tree)
    return _Run(mode, model_dir)  # the same command again

  _, summary = _resumed_run(mode, model_dir, deadline, kill_coordinator, None)
  _check_finished(summary, mode, reference)


def _job_process(root_pid):
  """The job the binary's supervisor runs: the train.py process whose parent is one too."""
  pid = process_tree.job_process(root_pid)
  if pid is None:
    pytest.fail(f"no job process under the supervisor {root_pid}")
  return pid


def test_a_job_killed_under_its_supervisor_restarts_with_the_signal_recorded(tmp_path,
                                                                              tmp_path_factory):
  """The job's process itself dies of a signal (the OOM killer's SIGKILL, an abort inside
  TensorFlow): the job can say nothing, so the supervisor says it, records the signal as the
  restart's cause, and starts the job again from its last checkpoint."""
  reference = _undisturbed("gba", tmp_path_factory)
  deadline = time.time() + _TIME_LIMIT_S

  def kill_job(run):
    os.kill(_job_process(run.proc.pid), signal.SIGKILL)

  run, summary = _resumed_run("gba", str(tmp_path / "m"), deadline, kill_job, "SIGKILL")
  assert "train.py: the job's process died of SIGKILL." in "".join(run.err)
  _check_finished(summary, "gba", reference)


# One replicated mode for both (one undisturbed reference run): the loss is handled by the job
# they share (tf_gba/training/shadow_job.py); asgd_nodelay's own stall is in test_shadow_cluster.
@pytest.mark.parametrize("mode,job", [("shadow_ma", "worker"), ("shadow_ma", "ps")])
def test_replicated_modes_resume_from_the_last_checkpoint_after_a_lost_server(
    tmp_path, tmp_path_factory, mode, job):
  """ShadowSync and ASGD without gradient delay: a worker holds a dense replica no other process
  has, a parameter server the embeddings and the synchronisers' model. Either death restarts
  the job, which resumes from the last periodic checkpoint (the replicas' average) toward the
  same target. The checkpoint is written while the workers train, so how many steps are redone
  is a matter of timing: the test checks that none older than the last checkpoint is."""
  reference = _undisturbed(mode, tmp_path_factory)
  deadline = time.time() + _TIME_LIMIT_S
  model_dir = str(tmp_path / "m")
  before_kill = []

  def kill(run):
    server = _server(run.proc.pid, job, 0)
    before_kill.append(_latest_checkpoint_step(model_dir))
    os.kill(server, signal.SIGKILL)

  cause = {"worker": "WorkerLost", "ps": "ParameterServerLost"}[job]
  run, summary = _resumed_run(mode, model_dir, deadline, kill, cause)
  err = "".join(run.err)
  assert f"{job}:0 died or became unreachable" in err and "restarting the job" in err
  # Nothing else on stderr: each loss is said once (and the restart that follows it).
  assert len([l for l in run.err if l.strip()]) == 2 * summary["restarts"], err
  assert summary["target_global_step"] == summary["global_step"] == _STEPS
  # Resumed from the newest checkpoint written before the kill (or one the save under way then
  # completed), never an older one. How many steps that redoes has no fixed bound: the workers
  # do not stop for a checkpoint, so the steps they take while one is written come on top of the
  # interval: 113 were redone once on a loaded machine (interval 40, about 25 steps a second).
  assert before_kill[0] > 0, "the kill came before the first periodic checkpoint"
  assert summary["start_global_step"] >= before_kill[0], (summary["start_global_step"],
                                                          before_kill)
  if summary["restarts"] == 1:
    # Redone: the global step of the last progress line before the resumption (each line is
    # reported as it is printed) minus the step resumed from. It may be 0: the kill lands when
    # this test has read "step 140/" and found the server, and the surviving worker can reach the
    # next line and checkpoint (at the same step) before the replica is gone.
    out = "".join(run.out)
    resumed = re.search(r"resuming an interrupted run \(restart 1\): global step (\d+) ", out)
    lines = re.findall(r"^step \d+/\d+  global step (\d+) ", out[:resumed.start()], re.M)
    assert summary["steps_redone"] == max(0, int(lines[-1]) - int(resumed.group(1))), out[-3000:]
  assert summary["periodic_checkpoints"] >= 1
  # Each worker's input went on after the batches the checkpoint counted in its shard: counted
  # before the checkpoint read the model, so every one of them is among its global steps.
  restored = summary["restored_shard_batches"]
  assert 0 < sum(restored) <= summary["start_global_step"], (restored, summary)
  _check_auc(summary, reference)


def _tfdata_worker(root_pid):
  for pid in _descendants(root_pid):
    if (_task(pid) or "").startswith("tfdata_worker:"):
      return pid
  pytest.fail(f"no tf.data worker under process {root_pid}")


def test_killed_tfdata_worker_ends_the_day_without_hanging(tmp_path):
  """One of the two tf.data workers killed mid-day (no --steps: one pass over the day). The local
  cluster starts it again at its address, the day goes on to its end, and the summary counts what
  was not trained (the batches the dead tf.data worker had taken from the list and not yet
  delivered): the batches trained plus those missed make the day, none trained twice."""
  model_dir = str(tmp_path / "m")
  deadline = time.time() + _TIME_LIMIT_S
  command = [a for a in _command("gba", model_dir)
             if not a.startswith(("--steps=", "--checkpoint_every_steps="))]
  command += ["--tfdata_workers=2", "--stall_timeout_s=60"]
  run = _Run("gba", model_dir, command=command)
  run.wait_for("step 40/", deadline)
  os.kill(_tfdata_worker(run.proc.pid), signal.SIGKILL)
  assert run.finish(deadline) == 0, "".join(run.err)[-3000:]
  summary = _summary(model_dir)
  data_list = summary["data_list"]
  print("killed tf.data worker:", {k: data_list[k] for k in (
      "batches", "missed", "duplicates", "num_batches", "stalled")}, "restarts",
        summary["tfdata_worker_restarts"])
  assert summary["tfdata_worker_restarts"] == 1
  assert data_list["stalled"] is None  # ended by the end of the list, not by the watchdog
  assert data_list["duplicates"] == 0
  assert data_list["batches"] + data_list["missed"] == data_list["num_batches"], data_list
  assert data_list["examples"] + data_list["missed_examples"] == data_list["rows"]
  assert f"missed {data_list['missed']}" in "".join(run.out)
