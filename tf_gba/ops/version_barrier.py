"""Version barrier: the per-step barrier of the backup-workers baseline (Hop-BW).

Hop-BW(b3) aggregates, for each model version k, the first N - b3 gradients computed on version k,
and each worker computes at most one gradient per version: after pushing for version k it waits
for version k + 1. The barrier lives on parameter server 0 and holds the version every variable
has reached; a worker calls `wait(worker)` before a step (it returns the version to compute on)
and `report(...)` after its pushes:

  barrier = VersionBarrier(num_workers, device="/job:ps/replica:0/task:0/device:CPU:0")
  version, skip, _ = barrier.wait(me)      # blocks while me already pushed for this version
  ... the step, pushing (version, gradient) to every buffer unless skip ...
  barrier.report(me, version, pushed=not skip, completed=<buffers this push completed>,
                 num_buffers=<buffers per step>)

The version moves from k to k + 1 once all `num_buffers` buffers have completed global step k
(reported by the workers whose pushes completed them, after their updates), so parameters read
after the wait are all of the new version. The wait is an asynchronous kernel: a blocked wait
holds no thread of the parameter server. `release()` lets every blocked wait return with
skip=True, for the end of training, when the workers that would move the version on have no
steps left; such a step pushes nothing.

The barrier is not checkpointed: it starts at `initial_version` (the global step of a restored
model) with no worker having pushed.
"""

from typing import Dict, Tuple

import numpy as np
import tensorflow as tf

from tf_gba.ops import loader
from tf_gba.ops.worker_resource import WorkerResource

# A barrier hands out versions and counts; nothing it outputs is differentiated.
loader.no_gradient("GBA>VersionBarrierCreate", "GBA>VersionBarrierWait",
                   "GBA>VersionBarrierReport", "GBA>VersionBarrierRelease",
                   "GBA>VersionBarrierStats")


class VersionBarrier(WorkerResource):
  """The model version and, per worker, the version it last pushed for. One per job, on PS 0."""

  _CREATE_OP = "gba_version_barrier_create"

  def __init__(self, num_workers: int, device: str = "", initial_version: int = 0,
               name: str = "version_barrier"):
    if int(initial_version) < 0:
      raise ValueError(f"initial_version must be >= 0, got {initial_version}.")
    super().__init__(num_workers, device, name, initial_version=int(initial_version))

  def wait(self, worker) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Blocks until the version exceeds the last one `worker` pushed for.

    Returns:
      (version, skip, waited_ns): the version to compute on (int64), whether the wait was
      released by `release()` (bool: push nothing then) and the time blocked (int64 ns).
    """
    return self._run("gba_version_barrier_wait", tf.cast(worker, tf.int64))

  def report(self, worker, version, pushed, completed, num_buffers) -> tf.Tensor:
    """Records a step's push; returns the version after it (int64)."""
    return self._run("gba_version_barrier_report", tf.cast(worker, tf.int64),
                     tf.cast(version, tf.int64), tf.cast(pushed, tf.bool),
                     tf.cast(completed, tf.int64), tf.cast(num_buffers, tf.int64))

  def release(self) -> tf.Operation:
    """Lets every wait blocked right now return with skip=True."""
    return self._run("gba_version_barrier_release")

  def stats(self) -> Dict[str, object]:
    """Eagerly: version (int) and per-worker int64 arrays gradients, duplicates, released,
    blocked_ns and waiting (see the op `GBA>VersionBarrierStats`)."""
    out = self._run("gba_version_barrier_stats")
    names = ("gradients", "duplicates", "released", "blocked_ns", "waiting")
    result = {"version": int(out[0].numpy())}
    for name, t in zip(names, out[1:]):
      result[name] = np.asarray(t.numpy(), np.int64)
    return result
