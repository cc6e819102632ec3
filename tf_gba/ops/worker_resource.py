"""The scaffolding of a resource that coordinates a job's workers (Hop-BS's worker clock, Hop-BW's
version barrier): one per job, created eagerly on one device (parameter server 0) under a
shared_name of its own, destroyed with DestroyResourceOp, and never checkpointed (its state
describes the running job's workers, not the model)."""

import itertools

import tensorflow as tf

from tf_gba.ops import loader

_uid = itertools.count()


def ops():
  return loader.load_op_library("gba")


class WorkerResource(tf.saved_model.experimental.TrackableResource):
  """Base class: a subclass names its create op in `_CREATE_OP` and calls its ops with `_run`."""

  _CREATE_OP = ""

  def __init__(self, num_workers: int, device: str, name: str, **create_attrs):
    if int(num_workers) < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}.")
    super().__init__(device=device)
    self._num_workers = int(num_workers)
    self._create_attrs = create_attrs
    # Found by shared_name in the PS's resource manager: each resource needs a name of its own.
    self._shared_name = f"tf_gba/{name}/{next(_uid)}_{id(object())}"
    with tf.init_scope():
      _ = self.resource_handle  # create now, eagerly, on `device`

  @property
  def num_workers(self) -> int:
    return self._num_workers

  def _create_resource(self):
    return getattr(ops(), self._CREATE_OP)(num_workers=self._num_workers,
                                           shared_name=self._shared_name, **self._create_attrs)

  def _destroy_resource(self):
    # Fails any wait still blocked on this resource with CancelledError.
    tf.raw_ops.DestroyResourceOp(resource=self.resource_handle, ignore_lookup_error=True)

  def _run(self, op: str, *args):
    """Runs op `op` (its Python name) on the resource's device, the handle first."""
    with tf.device(self._resource_device):
      return getattr(ops(), op)(self.resource_handle, *args)
