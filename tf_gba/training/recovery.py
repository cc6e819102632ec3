"""Resuming a run after a process died: where the run is going, and what the failures cost.

`model_dir/tf_gba_progress.json` records the run's target (the global step it ends at), the last
global step it reported and, once it ends, that it finished. A run that finds an unfinished
record of the same command (the same --steps and --mode) resumes toward that target from the last
checkpoint, instead of training --steps more; a finished record starts a new run, as before.

Why a file next to the checkpoints: a killed coordinator (or a killed parameter server, which
takes the job's state with it) leaves only model_dir behind, and a rerun of the same command, by a
user, a supervisor loop (examples/train.py) or a cluster's restart policy, must know how far the
run meant to go and how far it had got.
"""

import dataclasses
import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, TypeVar

import numpy as np

from tf_gba.common import exiting

T = TypeVar("T")

# Exit code of a run that lost a parameter server: the job can go on from its last checkpoint
# (EX_TEMPFAIL: try again).
EXIT_RESTART = 75
PROGRESS_FILE = "tf_gba_progress.json"
# Per-batch trainings of the shared data list at the last progress line, and the global step
# there (see `record_seen`).
SEEN_FILE = "tf_gba_progress_seen.npz"


class JobLost(RuntimeError):
  """A process of the job died with state no other process holds: the job starts again and
  resumes from the last checkpoint (the binary exits with EXIT_RESTART)."""


class AfterTrainingError(RuntimeError):
  """Something after the run's last checkpoint failed (the final evaluation, its snapshot): the
  trained model is safe; the binary prints the message in one line and exits 1."""


class ParameterServerLost(JobLost):
  """A parameter server died: its variables are gone; the run resumes from the last checkpoint."""


class DataListLost(JobLost):
  """The shared data list's tf.data dispatcher died: the list's position in the day is lost with
  it (its tf.data workers wait for a dispatcher without end); the run resumes from the last
  checkpoint, whose data position says what had trained."""


class WorkerLost(JobLost):
  """A worker holding state of its own (a dense replica) died; the run resumes from the last
  checkpoint."""


class Stalled(JobLost):
  """No worker finished a step for --stall_timeout_s: a call that never returns holds the job,
  which resumes from the last checkpoint."""


class RuntimeFault(JobLost):
  """A call between the job's processes failed inside TensorFlow's runtime, no process lost: the
  job's state may be partly updated by the failed call, so it resumes from the last checkpoint."""


# Failures of TF's runtime itself, seen intermittently while several threads of one coordinator
# call remote functions (the replicated modes' driver and synchroniser threads, the
# ClusterCoordinator's workers): the server received the request unreadable. Nothing of the
# job's code or input is in the traceback, and the same run started again trains on.
_RUNTIME_FAULTS = ("Unable to parse request",)
# A call that reached a worker restarted since the coordinator last joined it.
_WORKER_CONTEXT_LOST = "Unable to find a context_id matching the specified one"


# What each job's loss takes with it, for the message.
_LOST = {"ps": (ParameterServerLost, "a parameter server", "its variables are lost"),
         "worker": (WorkerLost, "a worker", "its dense replica is lost")}


def raise_if_lost(error: Exception, cluster, jobs: Sequence[str] = ("ps",)) -> None:
  """Raises the JobLost of the job among `jobs` ("ps", "worker") that `error` comes from: a
  server of the local `cluster` (None on a real cluster) that exited, or else an
  unreachable-server error naming that job; else a RuntimeFault for one of TF's own transient
  failures."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  text = str(error)
  unreachable = isinstance(error, (tf.errors.UnavailableError, tf.errors.AbortedError,
                                   tf.errors.CancelledError, tf.errors.NotFoundError))
  named = [job for job in jobs if unreachable and f"/job:{job}" in text]
  if cluster is not None:
    # A process that exited is what died, whichever servers the error names: a call that spans
    # a worker and a parameter server names both when the worker dies. A killed process closes
    # its sockets before its exit status can be read: give it a moment, so that the message can
    # name the server.
    deadline = time.time() + (3.0 if named else 0.0)
    while True:
      for job in jobs:
        dead = cluster.dead(job)
        if dead:
          raise _lost(job, ", ".join(dead), error) from error
      if time.time() >= deadline:
        break
      time.sleep(0.1)
  if named:
    raise _lost(named[0], _LOST[named[0]][1], error) from error
  if unreachable and "/job:worker" in text and _WORKER_CONTEXT_LOST in text:
    # ClusterCoordinator runs again the functions of a worker that restarts, but under load a
    # function sent while the restarted worker was being rejoined reached this far (2 of 5
    # killed-worker drills on a machine at load 12, none of 3 at load 6). A function may have
    # been partly run: resume from the last checkpoint.
    raise RuntimeFault("a worker restarted while a call to it was in flight, and TensorFlow's "
                       f"runtime did not run it again ({type(error).__name__}: "
                       f"{_WORKER_CONTEXT_LOST}). Rerun the same command to resume from the "
                       "last checkpoint in model_dir.") from error
  if (isinstance(error, (tf.errors.UnavailableError, tf.errors.AbortedError))
      and "/job:worker" in text):
    # A worker's failure that ClusterCoordinator did not recover in place: it re-raises one that
    # comes while its closures are being cancelled (measured: the chaos drill's killed worker,
    # "recvmsg:Connection reset by peer" raised from `coordinator.schedule`). Resume from the
    # last checkpoint rather than end the command.
    raise RuntimeFault(f"a worker's failure ({type(error).__name__}) reached the coordinator "
                       "instead of being recovered in place by TensorFlow's runtime. Rerun the "
                       "same command to resume from the last checkpoint in model_dir.") from error
  if isinstance(error, tf.errors.CancelledError) and "/job:worker" in text:
    # A worker killed while its step was being enqueued: TF's ClusterCoordinator reports the
    # step CANCELLED, not a worker failure it retries, and cancels every scheduled step
    # (measured under the chaos drill on a loaded machine, benchmarks/chaos.py). The job's
    # state past its last checkpoint is unknown then: it resumes from there.
    raise RuntimeFault("a worker's step was cancelled inside TensorFlow's runtime (CancelledError; "
                       "a worker killed while its step was being sent). Rerun the same command "
                       "to resume from the last checkpoint in model_dir.") from error
  if isinstance(error, tf.errors.CancelledError):
    # No call of the job's is cancelled by the job itself: TF's runtime cancels a coordinator's
    # call when it rebuilds its cluster context after a worker failure (measured: the progress
    # line's read of the optimizer's counters, "Function was cancelled before it was started",
    # after a killed worker rejoined; no process named, none dead). Resume from the last
    # checkpoint rather than end the command.
    raise RuntimeFault("a call of the coordinator's was cancelled inside TensorFlow's runtime "
                       "(CancelledError, while a restarted server was rejoined). Rerun the same "
                       "command to resume from the last checkpoint in model_dir.") from error
  fault = next((f for f in _RUNTIME_FAULTS if f in text), None)
  if isinstance(error, tf.errors.InternalError) and fault:
    raise RuntimeFault(f"a call between the job's processes failed inside TensorFlow's runtime "
                       f"(InternalError: {fault}; no process died). Rerun the same command to "
                       "resume from the last checkpoint in model_dir.") from error


def _lost(job: str, what: str, error: Exception) -> JobLost:
  cls, _, lost = _LOST[job]
  return cls(f"{what} died or became unreachable ({type(error).__name__}); {lost}. Rerun the "
             "same command (once every server is back) to resume from the last checkpoint in "
             "model_dir.")


def quiet_executors_of_a_lost_server() -> None:
  """Drops one message on stderr: when a server dies, the eager executors of the threads that
  called it (the replicated modes' drivers, ClusterCoordinator's worker threads) are deleted and
  raise, unheard, that the socket closed (a traceback after "Exception ignored in"), around the
  time the main thread learns of the loss. The loss itself is reported once, by a JobLost.
  Installed once per process (a job may run again in it)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  default = sys.unraisablehook
  if getattr(default, "tf_gba_quiet_executors", False):
    return

  def hook(unraisable):
    if (isinstance(unraisable.exc_value, (tf.errors.UnavailableError, tf.errors.CancelledError))
        and "Executor.__del__" in repr(unraisable.object)):
      return
    default(unraisable)

  hook.tf_gba_quiet_executors = True
  sys.unraisablehook = hook


def retry_cancelled(read: Callable[[], T], attempts: int = 3, wait_s: float = 1.0) -> T:
  """`read()`, called again (up to `attempts` times in all, `wait_s` apart) while it raises
  CancelledError: for the coordinator's idempotent reads of the servers' state, which TF's runtime
  cancels while it rejoins a restarted worker (see raise_if_lost); a read that still fails raises."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  for _ in range(attempts - 1):
    try:
      return read()
    except tf.errors.CancelledError:
      time.sleep(wait_s)
  return read()


def root_error(errors: Sequence[BaseException]) -> BaseException:
  """Of the errors several threads met in one failure, the one that caused it: a failed
  multi-device call cancels its other parts, and a thread waiting on one of them meets only a
  CancelledError (naming the server it waited on, which did not die)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return next((e for e in errors if not isinstance(e, tf.errors.CancelledError)), errors[0])


class CheckpointSchedule:
  """When a periodic checkpoint is due: `every_steps` worker steps or `every_secs` seconds after
  the last one (0 turns either off). Shared by every training loop that writes them."""

  def __init__(self, every_steps: int, every_secs: float):
    self.every_steps, self.every_secs = every_steps, every_secs
    self._last_steps, self._last_time = 0, time.time()

  def due_by_steps(self, steps: int) -> bool:
    return bool(self.every_steps) and steps - self._last_steps >= self.every_steps

  def due(self, steps: int) -> bool:
    return self.due_by_steps(steps) or (
        bool(self.every_secs) and time.time() - self._last_time >= self.every_secs)

  def written(self, steps: int) -> None:
    """A checkpoint holding `steps` worker steps was written: the intervals start again."""
    self._last_steps, self._last_time = steps, time.time()


@dataclasses.dataclass
class Progress:
  target_global_step: int
  start_global_step: int
  restarts: int = 0          # resumptions of this run after a failure
  steps_redone: int = 0      # global steps trained again after the resumptions (at least)
  resumed: bool = False
  # Why the failed runs ended (`record_failure`): a JobLost's class name, or the signal a job
  # died of. A coordinator killed with its command records nothing.
  restart_causes: List[str] = dataclasses.field(default_factory=list)
  # Servers the failed runs' local clusters started again in place ("worker", "tfdata_worker"):
  # a worker killed and restarted before the job itself restarted is still one the run survived.
  server_restarts: Dict[str, int] = dataclasses.field(default_factory=dict)


def _path(model_dir: str) -> str:
  return os.path.join(model_dir, PROGRESS_FILE)


def read(model_dir: str) -> Optional[dict]:
  try:
    with open(_path(model_dir)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _write(model_dir: str, record: dict) -> None:
  # Written, then renamed: a process killed meanwhile leaves the previous record whole.
  tmp = _path(model_dir) + ".tmp"
  with open(tmp, "w") as f:
    json.dump(record, f, indent=2)
  os.replace(tmp, _path(model_dir))


def begin(model_dir: str, mode: str, steps: int, start_global_step: int,
          target_if_new: int) -> Progress:
  """The progress of the run starting now at `start_global_step` (restored from a checkpoint)."""
  prev = read(model_dir)
  if (prev and not prev.get("finished") and prev.get("steps") == steps and
      prev.get("mode") == mode and prev.get("target_global_step", 0) >= start_global_step):
    # The global step last reported before the failure, minus the one restored: trained again.
    # The shared list's counts are recorded just before the report; a run that died between
    # the two reached the step they were recorded at.
    reported = max(int(prev.get("global_step", start_global_step)),
                   _read_seen_file(model_dir)[1] or 0)
    redone = max(0, reported - start_global_step)
    progress = Progress(int(prev["target_global_step"]), start_global_step,
                        int(prev.get("restarts", 0)) + 1,
                        int(prev.get("steps_redone", 0)) + redone, resumed=True,
                        restart_causes=[str(c) for c in prev.get("restart_causes", [])],
                        server_restarts={str(k): int(v) for k, v in
                                         prev.get("server_restarts", {}).items()})
  else:
    progress = Progress(target_if_new, start_global_step)
    # A new run: the last run's record of trained batches is not this run's.
    try:
      os.remove(os.path.join(model_dir, SEEN_FILE))
    except OSError:
      pass
  _write(model_dir, {"mode": mode, "steps": steps, "target_global_step":
                     progress.target_global_step, "global_step": start_global_step,
                     "restarts": progress.restarts, "steps_redone": progress.steps_redone,
                     "finished": False,
                     "batches_reread": int(prev.get("batches_reread", 0))
                                       if progress.resumed else 0,
                     "restart_causes": progress.restart_causes,
                     "server_restarts": progress.server_restarts,
                     **({"longest_save_s": prev["longest_save_s"]}
                        if progress.resumed and "longest_save_s" in prev else {})})
  return progress


def record_failure(model_dir: str, cause) -> None:
  """Records why this run ends for a restart, for the resumed run's summary: a JobLost (its
  class: ParameterServerLost, WorkerLost, RuntimeFault, Stalled), or the name of the signal the
  job's process died of (the binary's supervisor records it, e.g. "SIGABRT")."""
  record = read(model_dir)
  if record is None or record.get("finished"):
    return
  name = cause if isinstance(cause, str) else type(cause).__name__
  record["restart_causes"] = list(record.get("restart_causes", [])) + [name]
  _write(model_dir, record)


def end_for_restart(model_dir: str, error: JobLost,
                    exit_now: Callable[[int], None] = exiting.exit_now) -> None:
  """Ends the job from a thread that watches it (a lost server no call reported, a save held
  past its limit): one line, the cause recorded for the resumed run's summary, and exit
  EXIT_RESTART, which the binary's supervisor restarts."""
  print(f"tf_gba: {error}", file=sys.stderr, flush=True)
  record_failure(model_dir, error)
  exit_now(EXIT_RESTART)


def record_server_restarts(model_dir: str, restarts: Dict[str, int]) -> None:
  """Adds the servers this run's local cluster started again in place (its `restarts`) to the
  run's record, as the run ends in a failure: the resumed run's summary counts them."""
  record = read(model_dir)
  if record is None or record.get("finished") or not any(restarts.values()):
    return
  total = dict(record.get("server_restarts", {}))
  for job, n in restarts.items():
    total[job] = int(total.get(job, 0)) + int(n)
  record["server_restarts"] = total
  _write(model_dir, record)


def add_batches_reread(model_dir: str, batches: int) -> int:
  """Adds a resumption's re-read batches to the run's record; returns the run's total."""
  record = read(model_dir) or {}
  record["batches_reread"] = int(record.get("batches_reread", 0)) + int(batches)
  _write(model_dir, record)
  return record["batches_reread"]


def record_save_seconds(model_dir: str, seconds: float) -> None:
  """Keeps the run's longest periodic checkpoint save, over its resumptions (`save_watch`)."""
  record = read(model_dir)
  if record is None or seconds <= float(record.get("longest_save_s", 0.0)):
    return
  record["longest_save_s"] = float(seconds)
  _write(model_dir, record)


def longest_save_seconds(model_dir: str) -> Optional[float]:
  """The run's longest periodic checkpoint save so far, or None before its first."""
  record = read(model_dir)
  return None if record is None or "longest_save_s" not in record else float(
      record["longest_save_s"])


def report(model_dir: str, global_step: int, finished: bool = False) -> None:
  """Records the global step reached (at each progress line, and at the end)."""
  record = read(model_dir)
  if record is None:
    return
  record["global_step"] = int(global_step)
  record["finished"] = bool(finished)
  _write(model_dir, record)


def record_seen(model_dir: str, seen: np.ndarray, global_step: int) -> None:
  """Records the shared list's per-batch trainings at a progress line (those of the steps
  finished by then), and the line's global step. Call just before `report` of the same line.

  Not the data position (that is in the checkpoint, consistent with the model): what a run that
  dies later had trained at least, so that its resumption counts the batches it trains again
  from their ids. Written, then renamed, like the progress record. With the global step in the
  same file, a run killed between this write and the report's (the killed coordinator's job
  goes on for up to a second) still resumes with counts and steps redone of one line.
  """
  path = os.path.join(model_dir, SEEN_FILE)
  tmp = path + ".tmp.npz"
  np.savez(tmp, seen=np.asarray(seen, np.int64), global_step=np.int64(global_step))
  os.replace(tmp, path)


def _read_seen_file(model_dir: str):
  try:
    with np.load(os.path.join(model_dir, SEEN_FILE)) as f:
      return f["seen"], int(f["global_step"])
  except (OSError, ValueError, KeyError):
    return None, None


def read_seen(model_dir: str) -> Optional[np.ndarray]:
  """The counts `record_seen` wrote last, or None."""
  return _read_seen_file(model_dir)[0]
