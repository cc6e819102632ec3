"""Worker clock: the blocking barrier of the bounded-staleness baseline (Hop-BS).

Hop-BS(b1) lets a worker start a step only while it is at most b1 steps ahead of the slowest
worker. The clock lives on parameter server 0 and counts the steps each worker has completed; a
worker calls `wait(worker, b1, timeout_ms)` before a step and `tick(worker)` after it:

  clock = WorkerClock(num_workers, device="/job:ps/replica:0/task:0/device:CPU:0")
  me = worker_index()               # on the worker's own device
  clock.wait(me, bound=b1, timeout_ms=60_000)
  ... the step ...
  clock.tick(me)

The wait is an asynchronous kernel: while blocked it holds no thread of the parameter server, so
any number of fast workers can be held back without starving the ops of the slow one. It gives up
after `timeout_ms` and lets the worker go anyway (reporting timed_out=True): a worker whose slowest
peer has run out of work must not wait forever at the end of training. `reset()` releases every
blocked wait at once.

The clock is not checkpointed: its counts describe the running job's workers (how far each is
into the current run), not the model, and a restored job starts them level again.
"""

from typing import Dict, Tuple

import numpy as np
import tensorflow as tf

from tf_gba.ops import loader
from tf_gba.ops.worker_resource import WorkerResource
from tf_gba.ops.worker_resource import ops as _ops

# The clock's ops synchronise workers and report counts: nothing to differentiate.
loader.no_gradient("GBA>WorkerClockCreate", "GBA>WorkerClockWait", "GBA>WorkerClockTick",
                   "GBA>WorkerClockStats", "GBA>WorkerClockWaiting", "GBA>WorkerClockReset",
                   "GBA>WorkerIndex")


def worker_index() -> tf.Tensor:
  """The task index of the worker this runs on (int64 scalar), 0 outside a worker.

  Read by the kernel from its device, /job:worker/replica:0/task:<i>, so it must run where the
  worker's ops run: inside `tf.device(worker_device)`, or in a function placed on the worker. In a
  single process (no cluster) it is 0.
  """
  # The CPU of whatever task the enclosing device scope names (the kernel is CPU-only).
  with tf.device("/device:CPU:0"):
    return _ops().gba_worker_index()


class WorkerClock(WorkerResource):
  """Steps completed per worker, and a wait that holds a worker back while it is too far ahead.

  One per job, created eagerly on `device` (parameter server 0), so that a `tf.function` closing
  over it runs its ops there. Transient state: nothing of it is saved in checkpoints.
  """

  _CREATE_OP = "gba_worker_clock_create"

  def __init__(self, num_workers: int, device: str = "", name: str = "worker_clock"):
    super().__init__(num_workers, device, name)

  def wait(self, worker, bound, timeout_ms=0) -> Tuple[tf.Tensor, tf.Tensor]:
    """Blocks while completed[worker] - min_j completed[j] > bound.

    Args:
      worker: the waiting worker's index, in [0, num_workers).
      bound: the largest lead allowed (b1 of Hop-BS), >= 0.
      timeout_ms: give up after this many milliseconds and proceed anyway; 0 or None waits
        without a time limit (until released by ticks or `reset()`, or the clock is destroyed).

    Returns:
      (waited_ns, timed_out): int64 and bool scalars.
    """
    timeout_ms = 0 if timeout_ms is None else timeout_ms
    return self._run("gba_worker_clock_wait", tf.cast(worker, tf.int64), tf.cast(bound, tf.int64),
                     tf.cast(timeout_ms, tf.int64))

  def tick(self, worker) -> tf.Operation:
    """Records one more completed step of `worker`, releasing the waits that may now go."""
    return self._run("gba_worker_clock_tick", tf.cast(worker, tf.int64))

  def reset(self) -> tf.Operation:
    """Zeroes every count and statistic, releasing every blocked wait (timed_out=False)."""
    return self._run("gba_worker_clock_reset")

  def stats_tensors(self):
    """(completed, blocked_ns, waits, timeouts, max_lead) as tensors."""
    return self._run("gba_worker_clock_stats")

  def stats(self) -> Dict[str, object]:
    """The clock's counters, eagerly, as NumPy values.

    completed, blocked_ns, waits, timeouts: int64 arrays of length num_workers (steps completed,
    total ns spent in waits, waits returned, waits that timed out); max_lead: int, the largest
    completed[w] - min_j completed[j] at the moment a wait of w returned without timing out.
    Waits that failed (cancelled, clock destroyed) count nowhere.
    """
    completed, blocked_ns, waits, timeouts, max_lead = self.stats_tensors()
    return {
        "completed": np.asarray(completed.numpy(), np.int64),
        "blocked_ns": np.asarray(blocked_ns.numpy(), np.int64),
        "waits": np.asarray(waits.numpy(), np.int64),
        "timeouts": np.asarray(timeouts.numpy(), np.int64),
        "max_lead": int(max_lead.numpy()),
    }

  def waiting(self) -> np.ndarray:
    """Per worker, the number of waits blocked right now (eager)."""
    return np.asarray(self._run("gba_worker_clock_waiting").numpy(), np.int64)
