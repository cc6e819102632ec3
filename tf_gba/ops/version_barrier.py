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

import itertools
from typing import Dict, Tuple

import numpy as np
import tensorflow as tf

from tf_gba.ops import loader

_uid = itertools.count()

# A barrier hands out versions and counts; nothing it outputs is differentiated.
loader.no_gradient("GBA>VersionBarrierCreate", "GBA>VersionBarrierWait",
                   "GBA>VersionBarrierReport", "GBA>VersionBarrierRelease",
                   "GBA>VersionBarrierStats")


def _ops():
  return loader.load_op_library("gba")


class VersionBarrier(tf.saved_model.experimental.TrackableResource):
  """The model version and, per worker, the version it last pushed for. One per job, on PS 0."""

  def __init__(self, num_workers: int, device: str = "", initial_version: int = 0,
               name: str = "version_barrier"):
    if int(num_workers) < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}.")
    if int(initial_version) < 0:
      raise ValueError(f"initial_version must be >= 0, got {initial_version}.")
    super().__init__(device=device)
    self._num_workers = int(num_workers)
    self._initial_version = int(initial_version)
    # Found by shared_name in the PS's resource manager: each barrier needs a name of its own.
    self._shared_name = f"tf_gba/{name}/{next(_uid)}_{id(object())}"
    with tf.init_scope():
      _ = self.resource_handle  # create now, eagerly, on `device`

  @property
  def num_workers(self) -> int:
    return self._num_workers

  def _create_resource(self):
    return _ops().gba_version_barrier_create(num_workers=self._num_workers,
                                             initial_version=self._initial_version,
                                             shared_name=self._shared_name)

  def _destroy_resource(self):
    # Fails any wait still blocked on this barrier with CancelledError.
    tf.raw_ops.DestroyResourceOp(resource=self.resource_handle, ignore_lookup_error=True)

  def wait(self, worker) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Blocks until the version exceeds the last one `worker` pushed for.

    Returns:
      (version, skip, waited_ns): the version to compute on (int64), whether the wait was
      released by `release()` (bool: push nothing then) and the time blocked (int64 ns).
    """
    with tf.device(self._resource_device):
      return _ops().gba_version_barrier_wait(self.resource_handle, tf.cast(worker, tf.int64))

  def report(self, worker, version, pushed, completed, num_buffers) -> tf.Tensor:
    """Records a step's push; returns the version after it (int64)."""
    with tf.device(self._resource_device):
      return _ops().gba_version_barrier_report(
          self.resource_handle, tf.cast(worker, tf.int64), tf.cast(version, tf.int64),
          tf.cast(pushed, tf.bool), tf.cast(completed, tf.int64),
          tf.cast(num_buffers, tf.int64))

  def release(self) -> tf.Operation:
    """Lets every wait blocked right now return with skip=True."""
    with tf.device(self._resource_device):
      return _ops().gba_version_barrier_release(self.resource_handle)

  def stats(self) -> Dict[str, object]:
    """Eagerly: version (int) and per-worker int64 arrays gradients, duplicates, released,
    blocked_ns and waiting (see the op `GBA>VersionBarrierStats`)."""
    with tf.device(self._resource_device):
      out = _ops().gba_version_barrier_stats(self.resource_handle)
    names = ("gradients", "duplicates", "released", "blocked_ns", "waiting")
    result = {"version": int(out[0].numpy())}
    for name, t in zip(names, out[1:]):
      result[name] = np.asarray(t.numpy(), np.int64)
    return result
