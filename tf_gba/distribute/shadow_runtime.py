"""Runtime for modes whose dense parameters are replicated per worker and trained locally.

Used by ShadowSync (S-EASGD, S-MA, S-BMUF) and ASGD without gradient delay: embeddings live on
the parameter servers and are updated asynchronously by every step (as in async mode); every
worker owns a replica of the dense parameters; something else (a background synchroniser, a
merging master) keeps the replicas together.

How per-worker replicas are held under TF 2.21 (the choice, and why):
  ParameterServerStrategy places every variable created under its scope on the parameter servers,
  and its ClusterCoordinator sends each scheduled closure to whichever worker is free, so a
  closure cannot address "this worker's replica" (per-worker resources exist only for datasets
  and iterators). The runtime therefore connects to the same cluster the way the strategy does
  (`tf.config.experimental_connect_to_cluster`, this process as the chief), places variables
  explicitly (`/job:ps/task:k` for embeddings and the parameter-server copies,
  `/job:worker/task:i` for worker i's replica, created outside any strategy scope), and runs
  one driver thread per worker in the coordinator, each calling that worker's own step function
  under `tf.device(<worker i>)` (what ClusterCoordinator's own worker threads do, minus the
  queue). The synchroniser is a separate set of coordinator threads calling functions placed on
  the parameter servers and workers: a training step never waits for it (the step function
  contains no synchronisation op and takes no lock the synchroniser holds), which is the
  property ShadowSync needs. What this gives up: ClusterCoordinator's re-scheduling of a
  closure after a worker failure (a worker's replica dies with it; the job restarts from its
  last checkpoint instead, tf_gba/training/shadow_job.py).

This module knows nothing of the update rules (tf_gba.optimizers) or of the model
(tf_gba.training): it provides placement, the step budget, the driver and background threads,
and the records of syncs (per worker, in that worker's training steps) and of step staleness.
"""

import os
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf
# Per-thread executors: what ClusterCoordinator's worker threads use (no public API scopes one to
# a thread; tf.config.experimental.set_synchronous_execution is process-wide).
from tensorflow.python.eager import context as eager_context  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.eager import executor as eager_executor  # pylint: disable=g-direct-tensorflow-import

WORKER_DEVICE = "/job:worker/replica:0/task:{}/device:CPU:0"
PS_DEVICE = "/job:ps/replica:0/task:{}/device:CPU:0"


def worker_device(i: int) -> str:
  return WORKER_DEVICE.format(i)


def ps_device(k: int) -> str:
  return PS_DEVICE.format(k)


def connect(resolver) -> None:
  """Makes the cluster's devices reachable from this process (the chief), eagerly.

  With the two runtime settings ParameterServerStrategy makes when it connects (TF's
  parameter_server_strategy_v2.py), for the same reasons: one outstanding request per remote
  server rather than a stream (several threads here call functions on the same servers), and
  `async_wait()` (a checkpoint write calls it) does not send a sync request to every remote
  executor, since no executor of this process is asynchronous. Without them this process's
  threads met, intermittently under load, requests the servers could not parse ("InternalError:
  Unable to parse request"), an abort inside TF's runtime ("Mutex corrupt") and a checkpoint
  write that never returned (waiting in `sync_executors`).
  """
  os.environ["TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE"] = "False"
  os.environ["TF_PS_DISABLE_ASYNC_EXECUTOR_GLOBALLY"] = "True"
  tf.config.experimental_connect_to_cluster(resolver.cluster_spec(), job_name="chief",
                                            task_index=0, protocol="grpc")


class StepBudget:
  """A shared count of worker steps: each driver claims one before running a step.

  Fast workers take more of the budget than slow ones, as with a shared data list.
  """

  def __init__(self, total: int):
    if total < 0:
      raise ValueError(f"the step budget must be >= 0, got {total}.")
    self.total = int(total)
    self._taken = 0
    self._lock = threading.Lock()

  def claim(self) -> bool:
    with self._lock:
      if self._taken >= self.total:
        return False
      self._taken += 1
      return True

  @property
  def taken(self) -> int:
    return self._taken

  def stop(self) -> None:
    """No step is claimed any more: the steps claimed finish, and the drivers end."""
    with self._lock:
      self.total = self._taken


class SyncLog:
  """Every sync of every worker, as that worker's completed training steps at the time.

  A sync's gap is the number of the worker's training steps since its previous sync (the first
  sync counts from step 0): ShadowSync's sync frequency is not a parameter, it is this.
  """

  def __init__(self, num_workers: int):
    self._lock = threading.Lock()
    self.at_step: List[List[int]] = [[] for _ in range(num_workers)]
    self.during: List[List[int]] = [[] for _ in range(num_workers)]
    self.seconds: List[float] = []

  def record(self, worker: int, step_at_start: int, step_at_end: int) -> None:
    """One sync of `worker` that began at its step_at_start and ended at step_at_end."""
    with self._lock:
      self.at_step[worker].append(int(step_at_end))
      self.during[worker].append(int(step_at_end) - int(step_at_start))

  def record_seconds(self, seconds: float) -> None:
    with self._lock:
      self.seconds.append(float(seconds))

  def gaps(self, worker: int) -> List[int]:
    steps = self.at_step[worker]
    return [b - a for a, b in zip([0] + steps[:-1], steps)]

  def summary(self) -> Dict:
    gaps = [g for w in range(len(self.at_step)) for g in self.gaps(w)]
    during = [d for ds in self.during for d in ds]
    out = {
        "syncs_per_worker": [len(s) for s in self.at_step],
        "mean_sync_gap": float(np.mean(gaps)) if gaps else None,
        "mean_sync_gap_per_worker": [float(np.mean(self.gaps(w))) if self.at_step[w] else None
                                     for w in range(len(self.at_step))],
        # Steps a worker trained while one of its syncs was in flight (0: the sync stopped it).
        "mean_steps_during_sync": float(np.mean(during)) if during else None,
        "mean_sync_seconds": float(np.mean(self.seconds)) if self.seconds else None,
        # The median too: the end of training cuts the injected delay of the syncs in flight.
        "median_sync_seconds": float(np.median(self.seconds)) if self.seconds else None,
    }
    if gaps:
      q = np.percentile(gaps, [0, 10, 50, 90, 100])
      out["sync_gap_percentiles"] = {k: float(v) for k, v in zip(
          ("min", "p10", "p50", "p90", "max"), q)}
      counts = np.bincount(np.asarray(gaps, np.int64))
      out["sync_gap_histogram"] = {int(g): int(c) for g, c in enumerate(counts) if c}
    return out


class StepCounters:
  """Completed training steps per worker, readable by the synchroniser at any time."""

  def __init__(self, num_workers: int):
    self.steps = [0] * num_workers
    self.cond = threading.Condition()

  def done(self, worker: int) -> None:
    with self.cond:
      self.steps[worker] += 1
      self.cond.notify_all()

  def __getitem__(self, worker: int) -> int:
    return self.steps[worker]

  def wait_past(self, worker: int, step: int, stop: threading.Event) -> bool:
    """Waits until `worker` has completed more than `step` steps; False if `stop` came first."""
    with self.cond:
      while self.steps[worker] <= step:
        if stop.is_set():
          return False
        self.cond.wait(0.2)
    return True


def completed_function(fn: Callable) -> Callable:
  """`fn` as a tf.function whose call returns only once all of its effects are done.

  A remote call returning is not enough on TF 2.21: a function that assigns a worker's
  variables can return to this process before the worker has run the assignment, and a
  function called next that reads those variables from another device (the merge on the
  parameter server reading a worker's update) then sees their previous values (measured: 6-17
  of 200 such hand-offs on a local cluster). Fetching a value the function returns waits for
  the whole call, its stateful ops included (tf.function runs them all before it returns).
  Every hand-off between the coordinator's threads goes through such a function.
  """
  @tf.function
  def call(*args):
    fn(*args)
    return tf.constant(True)

  def run(*args) -> None:
    call(*args).numpy()

  return run


def run_background(loops: Sequence[Callable[[], None]], stop: threading.Event,
                   errors: List[BaseException], name: str) -> List[threading.Thread]:
  """Starts one daemon thread per loop body; each calls its body until `stop` is set.

  An exception in a body is kept in `errors` and sets `stop` (training ends with it).
  """
  threads = []
  for k, body in enumerate(loops):
    def target(body=body):
      try:
        while not stop.is_set():
          body()
      except BaseException as e:  # pylint: disable=broad-except
        errors.append(e)
        stop.set()
    t = threading.Thread(target=target, daemon=True, name=f"{name}-{k}")
    t.start()
    threads.append(t)
  return threads


def drive_workers(num_workers: int, step: Callable[[int], None], budget: StepBudget,
                  counters: StepCounters, stop: threading.Event, errors: List[BaseException],
                  before_step: Optional[Callable[[int], bool]] = None,
                  timeout_s: Optional[float] = None,
                  on_tick: Optional[Callable[[], None]] = None,
                  tick_s: float = 0.25, wake: Optional[threading.Event] = None) -> float:
  """Runs the training: one driver thread per worker until the budget is spent; returns seconds.

  `step(i)` runs one step of worker i (its own function under its own device) and returns once
  the step is done (e.g. by fetching its loss); `before_step(i)` may wait (ASGD's staleness
  bound) and returns False to stop that worker.

  Each driver thread calls under a (synchronous) executor of its own, as ClusterCoordinator's
  worker threads do. Under the process's one default executor the steps of different workers
  ran one at a time: two workers with a 100 ms compute floor took 4.2 s for 20 steps each, one
  worker's time (2,483 against async mode's 4,610 examples/s on the training binary at 2
  workers); with an executor per thread, 2.3 s (shadow_ma, 2 workers, `compute:100`: 4,284
  examples/s). Asynchronous executors, tried first, met intermittent aborts and hangs inside
  TF's runtime (see `connect`). `step` fetches its loss all the same: a step counts (budget,
  ASGD's staleness, sync gaps) once it is done.
  `on_tick()` runs in the calling thread every `tick_s` while the workers train (progress
  lines, periodic checkpoints), and at once when `wake` is set (by a step that reached such a
  point); an exception there stops the training and is raised.
  """
  def target(i):
    try:
      with eager_context.executor_scope(eager_executor.new_executor(enable_async=False)):
        while not stop.is_set():
          if before_step is not None and not before_step(i):
            return
          if not budget.claim():
            return
          step(i)
          counters.done(i)
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)
      stop.set()

  t0 = time.perf_counter()
  threads = [threading.Thread(target=target, args=(i,), daemon=True, name=f"replica-worker-{i}")
             for i in range(num_workers)]
  for t in threads:
    t.start()
  deadline = None if timeout_s is None else t0 + timeout_s
  for t in threads:
    while t.is_alive():
      left = None if deadline is None else deadline - time.perf_counter()
      if left is not None and left <= 0:
        stop.set()
        raise TimeoutError(f"training did not finish within {timeout_s} s (a worker is stuck).")
      timeout = tick_s if left is None else min(tick_s, left)
      if wake is not None:
        wake.wait(timeout)
        wake.clear()
      else:
        t.join(timeout)
      if on_tick is not None and not stop.is_set():
        try:
          on_tick()
        except BaseException:
          stop.set()
          raise
  return time.perf_counter() - t0
