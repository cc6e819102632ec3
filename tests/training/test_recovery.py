"""recovery: which failures restart a job, and what the resumed run records about them."""

import os

import numpy as np
import pytest
import tensorflow as tf

from tf_gba.training import recovery

_PARSE = ("Graph execution error:\n2 root error(s) found.\n  (0) INTERNAL:  Unable to parse request\n"
          "Additional GRPC error information from remote target /job:worker/replica:0/task:1/"
          "device:CPU:0 while calling /tensorflow.eager.EagerService/RunComponentFunction")


def _error(cls, text):
  return cls(None, None, text)


def test_an_unreadable_request_restarts_the_job_as_a_runtime_fault():
  with pytest.raises(recovery.RuntimeFault, match="inside TensorFlow's runtime .*Unable to parse"):
    recovery.raise_if_lost(_error(tf.errors.InternalError, _PARSE), None, jobs=("ps", "worker"))
  # It is a JobLost: the binary restarts the job from its last checkpoint.
  assert issubclass(recovery.RuntimeFault, recovery.JobLost)


def test_other_internal_errors_are_not_restarted():
  # A bug of the job's own (or a bad input) must fail the run, not loop through restarts.
  recovery.raise_if_lost(_error(tf.errors.InternalError, "something else on /job:worker"), None,
                         jobs=("ps", "worker"))
  recovery.raise_if_lost(_error(tf.errors.InvalidArgumentError, "Unable to parse request"),
                         None, jobs=("ps", "worker"))


def test_an_unreachable_server_is_named_by_its_job():
  with pytest.raises(recovery.WorkerLost, match="a worker died or became unreachable"):
    recovery.raise_if_lost(_error(tf.errors.UnavailableError, "Socket closed /job:worker/task:0"),
                           None, jobs=("ps", "worker"))
  # A job outside `jobs` (a parameter-server mode restarts its workers in place) is no loss of
  # it: the job restarts from its last checkpoint as a RuntimeFault.
  with pytest.raises(recovery.RuntimeFault):
    recovery.raise_if_lost(_error(tf.errors.UnavailableError, "Socket closed /job:worker/task:0"),
                           None, jobs=("ps",))


_CONTEXT_LOST = (
    "Failed copying input tensor from /job:chief/replica:0/task:0/device:CPU:0 to "
    "/job:worker/replica:0/task:0/device:CPU:0 in order to run __inference_steps_3489: Unable to "
    "find a context_id matching the specified one (4005490120968849994). Perhaps the worker was "
    "restarted, or the context was GC'd?")


def test_a_call_that_reached_a_restarted_worker_restarts_the_job_as_a_runtime_fault():
  """A parameter-server mode restarts its workers in place and the coordinator runs their
  functions again; a call that reached the restarted worker anyway fails the run, and the job
  resumes from its last checkpoint."""
  with pytest.raises(recovery.RuntimeFault, match="a worker restarted while a call to it"):
    recovery.raise_if_lost(_error(tf.errors.AbortedError, _CONTEXT_LOST), None, jobs=("ps",))
  # Any other worker failure that reaches the job (TF's coordinator did not recover it in place)
  # restarts it too: the chaos drill's killed worker, raised from `coordinator.schedule`.
  reset = ("recvmsg:Connection reset by peer\nAdditional GRPC error information from remote "
           "target /job:worker/replica:0/task:0 while calling /tensorflow.eager.EagerService/"
           "Enqueue")
  for cls in (tf.errors.AbortedError, tf.errors.UnavailableError):
    with pytest.raises(recovery.RuntimeFault, match="recovered in place"):
      recovery.raise_if_lost(_error(cls, reset), None, jobs=("ps",))
  # Errors of the job's own naming a worker are not restarted.
  recovery.raise_if_lost(_error(tf.errors.InvalidArgumentError, "bad shape on /job:worker/task:0"),
                         None, jobs=("ps",))


def test_a_cancelled_worker_step_restarts_a_parameter_server_job():
  # The error the chaos drill met (benchmarks/chaos.py): a worker killed while its step was being
  # enqueued; ClusterCoordinator cancelled every scheduled step and fit raised. Restarted from the
  # last checkpoint (exit 75) instead of ending the command with exit 1.
  cancelled = _error(tf.errors.CancelledError,
                     "RemoteExecuteNode::RunAsync /job:worker/replica:0/task:0 CANCELLED")
  with pytest.raises(recovery.RuntimeFault, match="CancelledError"):
    recovery.raise_if_lost(cancelled, None, jobs=("ps",))
  # The replicated modes name the worker (its replica is lost), as before.
  with pytest.raises(recovery.WorkerLost):
    recovery.raise_if_lost(cancelled, None, jobs=("ps", "worker"))


_READ_CANCELLED = ("Graph execution error:\n\n2 root error(s) found.\n  (0) CANCELLED:  Function "
                   "was cancelled before it was started\n  (1) CANCELLED:  "
                   "EagerClusterFunctionLibraryRuntime::Run\n0 successful operations.")


def test_a_cancelled_coordinator_read_restarts_the_job_and_is_read_again_first():
  # The CI run of the killed-worker drill: the progress line's read of the optimizer's counters,
  # cancelled while the restarted worker was rejoined; it names no server and none died.
  cancelled = _error(tf.errors.CancelledError, _READ_CANCELLED)
  with pytest.raises(recovery.RuntimeFault, match="cancelled inside TensorFlow's runtime"):
    recovery.raise_if_lost(cancelled, None, jobs=("ps",))
  calls = []

  def read():
    calls.append(1)
    if len(calls) < 3:
      raise cancelled
    return 7

  assert recovery.retry_cancelled(read, attempts=3, wait_s=0.0) == 7 and len(calls) == 3
  calls.clear()
  with pytest.raises(tf.errors.CancelledError):
    recovery.retry_cancelled(read, attempts=2, wait_s=0.0)
  assert len(calls) == 2

  def broken():
    raise tf.errors.InvalidArgumentError(None, None, "bad")

  with pytest.raises(tf.errors.InvalidArgumentError):  # only cancellations are read again
    recovery.retry_cancelled(broken, attempts=3, wait_s=0.0)


def test_the_root_error_is_the_first_that_was_not_a_cancellation():
  cancelled = _error(tf.errors.CancelledError, "RecvFromRemoteAsync is cancelled /job:worker")
  parse = _error(tf.errors.InternalError, _PARSE)
  assert recovery.root_error([cancelled, parse]) is parse
  assert recovery.root_error([cancelled]) is cancelled
  # Classified from the cancellation alone, the fault would read as a lost worker.
  with pytest.raises(recovery.RuntimeFault):
    recovery.raise_if_lost(recovery.root_error([cancelled, parse]), None, jobs=("ps", "worker"))


def test_the_causes_of_restarts_reach_the_resumed_run(tmp_path):
  d = str(tmp_path)
  first = recovery.begin(d, "gba", 400, 0, target_if_new=100)
  assert not first.resumed and first.restart_causes == []
  recovery.record_failure(d, recovery.WorkerLost("w"))
  second = recovery.begin(d, "gba", 400, 20, target_if_new=120)
  assert second.resumed and second.restarts == 1 and second.restart_causes == ["WorkerLost"]
  recovery.record_failure(d, recovery.RuntimeFault("r"))
  recovery.record_failure(d, "SIGABRT")  # the supervisor's record of a job killed by a signal
  # A killed coordinator records nothing: its restart is counted without a cause.
  third = recovery.begin(d, "gba", 400, 40, target_if_new=140)
  fourth = recovery.begin(d, "gba", 400, 40, target_if_new=140)
  assert third.restart_causes == fourth.restart_causes == ["WorkerLost", "RuntimeFault",
                                                           "SIGABRT"]
  assert (third.restarts, fourth.restarts) == (2, 3)
  # A finished run: the next one is new, with no causes, and records none after the end.
  recovery.report(d, 100, finished=True)
  recovery.record_failure(d, recovery.JobLost("late"))
  new = recovery.begin(d, "gba", 400, 100, target_if_new=200)
  assert not new.resumed and new.restart_causes == [] and new.restarts == 0


def test_servers_restarted_in_place_before_a_restart_of_the_job_reach_the_resumed_run(tmp_path):
  d = str(tmp_path)
  recovery.begin(d, "gba", 400, 0, target_if_new=100)
  # A worker restarted in place, then the job restarted (TF's runtime re-raised its failure).
  recovery.record_server_restarts(d, {"ps": 0, "worker": 1, "tfdata_worker": 0})
  second = recovery.begin(d, "gba", 400, 20, target_if_new=120)
  assert second.server_restarts == {"ps": 0, "worker": 1, "tfdata_worker": 0}
  # Nothing restarted in that run: the count stays; two more in the next run are added.
  recovery.record_server_restarts(d, {"ps": 0, "worker": 0, "tfdata_worker": 0})
  recovery.record_server_restarts(d, {"ps": 0, "worker": 1, "tfdata_worker": 1})
  third = recovery.begin(d, "gba", 400, 40, target_if_new=140)
  assert third.server_restarts == {"ps": 0, "worker": 2, "tfdata_worker": 1}
  # A finished run's counts are not the next run's.
  recovery.report(d, 100, finished=True)
  recovery.record_server_restarts(d, {"worker": 5})
  assert recovery.begin(d, "gba", 400, 100, target_if_new=200).server_restarts == {}


def test_a_run_killed_between_its_list_counts_and_its_report_redoes_the_counted_steps(tmp_path):
  # The killed coordinator's job goes on for up to a second: it may die after writing a
  # progress line's list counts and before the line's report. The resumed run counts the steps
  # redone from the counts' global step, so that they match the batches re-read.
  d = str(tmp_path)
  recovery.begin(d, "gba", 400, 0, target_if_new=200)
  recovery.record_seen(d, np.array([1, 1, 0, 0]), global_step=10)
  recovery.report(d, 10)
  recovery.record_seen(d, np.array([1, 1, 1, 1]), global_step=20)  # killed before its report
  resumed = recovery.begin(d, "gba", 400, 10, target_if_new=210)
  assert resumed.steps_redone == 10
  np.testing.assert_array_equal(recovery.read_seen(d), [1, 1, 1, 1])
  # Without list counts (static shards) the report alone says it.
  e = str(tmp_path / "sharded")
  os.makedirs(e)
  recovery.begin(e, "gba", 400, 0, target_if_new=200)
  recovery.report(e, 30)
  assert recovery.begin(e, "gba", 400, 20, target_if_new=220).steps_redone == 10
  assert recovery.read_seen(e) is None


class _Cluster:
  """The local cluster as raise_if_lost reads it: which servers of a job have exited."""

  def __init__(self, **dead):
    self._dead = dead

  def dead(self, job):
    return self._dead.get(job, [])


def test_the_server_that_exited_is_the_one_lost_whichever_jobs_the_error_names():
  # A step of worker 0 reads the embeddings on the parameter server: when the worker dies, the
  # failed call names both jobs.
  both = _error(tf.errors.UnavailableError,
                "Socket closed /job:ps/replica:0/task:0 ... /job:worker/replica:0/task:0")
  with pytest.raises(recovery.WorkerLost, match="worker:0 died"):
    recovery.raise_if_lost(both, _Cluster(worker=["worker:0"]), jobs=("ps", "worker"))
  with pytest.raises(recovery.ParameterServerLost, match="ps:0 died"):
    recovery.raise_if_lost(both, _Cluster(ps=["ps:0"]), jobs=("ps", "worker"))
  # An exited server is a loss even where the error names no job (a cancelled call).
  with pytest.raises(recovery.WorkerLost, match="worker:1 died"):
    recovery.raise_if_lost(_error(tf.errors.CancelledError, "cancelled"),
                           _Cluster(worker=["worker:1"]), jobs=("ps", "worker"))


def test_a_parameter_server_lost_while_the_job_builds_restarts_it():
  # The chaos drill's kill during recovery: a parameter server killed while a restarted job
  # created its variables raised UnavailableError outside fit, and the command ended with exit 1.
  from tf_gba.training import runner  # pylint: disable=g-import-not-at-top
  with pytest.raises(recovery.ParameterServerLost):
    with runner._restart_if_lost(None, "/nonexistent"):  # pylint: disable=protected-access
      raise _error(tf.errors.UnavailableError, "Connection refused /job:ps/replica:0/task:0")
  with pytest.raises(ValueError):  # anything else is the job's own error, as before
    with runner._restart_if_lost(None, "/nonexistent"):  # pylint: disable=protected-access
      raise ValueError("a bug")


def test_a_dead_server_the_job_waits_on_ends_it_for_a_restart(tmp_path, capsys):
  # The chaos drill's kill during recovery: a parameter server killed while a restarted job was
  # connecting to its cluster left the job waiting with no end and no message. A dead tf.data
  # dispatcher is noticed by no call at all.
  import threading  # pylint: disable=g-import-not-at-top
  from tf_gba.training import runner  # pylint: disable=g-import-not-at-top

  class Cluster:
    def __init__(self, dead):
      self._dead = dead

    def dead(self, job):
      assert job in ("ps", "tfdata_dispatcher")
      return [name for name in self._dead if name.startswith(job + ":")]

  exits = []
  recovery.begin(str(tmp_path), "gba", 400, 0, target_if_new=100)
  runner.watch_servers(Cluster(["ps:0"]), threading.Event(), str(tmp_path), grace_s=0.2,
                       exit_now=exits.append)
  assert exits == [recovery.EXIT_RESTART]
  assert "ps:0 died and the job has waited" in capsys.readouterr().err
  runner.watch_servers(Cluster(["tfdata_dispatcher:0"]), threading.Event(), str(tmp_path),
                       grace_s=0.2, exit_now=exits.append)
  assert exits == [recovery.EXIT_RESTART] * 2
  assert "tfdata_dispatcher:0 (the shared data list's tf.data dispatcher) died" in (
      capsys.readouterr().err)
  assert recovery.begin(str(tmp_path), "gba", 400, 0, target_if_new=100).restart_causes == [
      "ParameterServerLost", "DataListLost"]
  # None dead, or stopped (the job's own teardown): nothing happens.
  stop = threading.Event()
  threading.Timer(0.5, stop.set).start()
  runner.watch_servers(Cluster([]), stop, str(tmp_path), grace_s=0.2, exit_now=exits.append)
  assert exits == [recovery.EXIT_RESTART] * 2


def test_batches_a_checkpoints_data_position_missed_are_reported():
  from tf_gba.training import runner  # pylint: disable=g-import-not-at-top
  from tf_gba.training.config import TrainConfig  # pylint: disable=g-import-not-at-top
  report = {"per_worker_batches": [100, 120], "per_worker_examples": [6400, 7680],
            "batches": 220, "examples": 14080, "duplicates": 0, "missed": None,
            "restored_batches": 973}
  summary = {"per_worker": [{"worker": 0}, {"worker": 1}], "start_global_step": 490,
             "global_step": 600, "num_aggregate": 2}
  runner._add_data_list(summary, dict(report), TrainConfig(mode="gba"), 0)  # pylint: disable=protected-access
  # The checkpoint at global step 490 followed 980 trained batches; its position counted 973.
  assert summary["data_list"]["uncounted_batches"] == 7
  # This run: 110 global steps of M = 2 are 220 pushes, and the counts hold 220 batches.
  assert summary["data_list"]["uncounted_by_restarted_workers"] == 0
  assert summary["data_list"]["workers_restarted_in_run"] == 0
  # A worker restarted in place lost the count of the batches it trained after the last read:
  # 4 more global steps pushed than the counts hold.
  summary = dict(summary, global_step=604)
  runner._add_data_list(summary, dict(report), TrainConfig(mode="gba"), 1)  # pylint: disable=protected-access
  assert summary["data_list"]["uncounted_by_restarted_workers"] == 8
  assert summary["data_list"]["workers_restarted_in_run"] == 1


def test_an_executor_deleted_after_a_lost_server_is_not_reported_on_stderr(monkeypatch):
  """The job's stderr after a lost parameter server held, besides the loss's one line, "Exception
  ignored in: <function Executor.__del__ ...>" tracebacks (UnavailableError: Socket closed) from
  the eager executors of the threads that had called it; they are dropped, other ones are not."""
  import sys  # pylint: disable=g-import-not-at-top
  heard = []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: heard.append(type(u.exc_value).__name__))
  recovery.quiet_executors_of_a_lost_server()
  recovery.quiet_executors_of_a_lost_server()  # once per process: not wrapped twice

  class Executor:
    def __init__(self, error):
      self.error = error

    def __del__(self):
      raise self.error

  Executor(tf.errors.UnavailableError(None, None, "Socket closed /job:ps/replica:0/task:0"))
  Executor(tf.errors.CancelledError(None, None, "cancelled"))
  assert heard == []
  Executor(ValueError("a bug of the job's own"))
  assert heard == ["ValueError"]
