"""A step's metric updates sent to the parameter server with its gradients.

Under a parameter-server strategy a Keras metric's variables live on a parameter server, and each
`assign_add` of a step's update sends its value there on its own: Keras' loss tracker (a `Mean`:
its total and its count) is two transfers per step, each an RPC the server serves. Within
`adds_ride(metrics)` the adds of every metric whose update only adds to scalars on a parameter
server (Keras' `Reduce` metrics: `Sum`, `Mean`, the loss tracker) are computed on the worker as
Keras computes them, and sent as one rider of the step (`step_context.ride`): in the gradients'
transfer where the optimizer packs them (GBA), else as one transfer of their own.
"""

import contextlib
from typing import Iterable, List

import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute import step_context

# The variables of a Keras `Reduce` metric (tf_keras 2.21: `Sum` has `total`, `Mean` also `count`),
# whose update only adds to them; a subclass with an update of its own updates as it does.
_ADDED = ("total", "count")
_REDUCE_UPDATE = keras.metrics.Sum.update_state


class _Adds:
  """Stands for a metric's variable during an update: records what it adds, changes nothing."""

  def __init__(self, variable, added: List):
    self._variable = variable
    self._added = added

  def assign_add(self, value, use_locking=None, name=None, read_value=True):
    del use_locking, name, read_value
    value = tf.cast(tf.reshape(value, []), self._variable.dtype)
    self._added.append((self._variable, value))
    return tf.identity(value)

  def __getattr__(self, name):
    return getattr(self._variable, name)


def _rides(metric) -> bool:
  if getattr(type(metric), "update_state", None) is not _REDUCE_UPDATE:
    return False
  variables = [getattr(metric, a) for a in _ADDED if hasattr(metric, a)]
  devices = {v.device for v in variables}
  return (len(devices) == 1 and "/job:ps" in next(iter(devices))
          and all(v.dtype == tf.float32 and v.shape.rank == 0 for v in variables))


@contextlib.contextmanager
def adds_ride(metrics: Iterable):
  """Within: the updates of `metrics` on a parameter server ride with the step (one rider each
  device). Others update as they do."""
  added: List = []
  swapped = []
  for metric in metrics:
    if _rides(metric):
      for a in _ADDED:
        if hasattr(metric, a):
          variable = getattr(metric, a)
          # Past Keras' attribute tracking: the metric keeps its variables as they were.
          object.__setattr__(metric, a, _Adds(variable, added))
          swapped.append((metric, a, variable))
  try:
    yield
  finally:
    for metric, a, variable in swapped:
      object.__setattr__(metric, a, variable)
  by_device = {}
  for variable, value in added:
    by_device.setdefault(variable.device, []).append((variable, value))
  for device, adds in by_device.items():
    targets = [v for v, _ in adds]

    def deliver(values, targets=targets):
      return tf.group([v.assign_add(values[k]) for k, v in enumerate(targets)])

    step_context.ride(device, tf.stack([value for _, value in adds]), deliver)
