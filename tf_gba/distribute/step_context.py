"""What a training step knows about itself: the token fetched when it started, and pre-step reads.

`GBAStrategy.run` fetches a token (and runs any registered pre-step readers, e.g. AdaptiveRevision's
gradient-sum snapshot) *before* the step function builds its forward pass, and publishes them here
for the duration of the trace. Optimizers read them in `apply_gradients`. Outside a GBAStrategy step
`current()` is None and optimizers fall back to their own local behaviour.

A step may also send small values to a parameter server with its gradients (`ride`): each tensor a
worker sends a server is a transfer of its own, an RPC the server serves, and values that ride in
the gradients' one transfer cost none (a metric's adds, `tf_gba.training.riding_metrics`).
"""

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Dict, List, Optional

import tensorflow as tf


@dataclasses.dataclass
class StepInfo:
  token: tf.Tensor            # int64 scalar: floor(i / M) for the i-th fetch
  ticket: tf.Tensor           # int64 scalar: i itself, unique per step; pushes are deduped by it
  reads: Dict[str, Any] = dataclasses.field(default_factory=dict)
  # Hop-BW: a step released from its barrier without a new version pushes nothing (bool scalar).
  skip: Optional[tf.Tensor] = None
  # Written by the optimizer while it applies: how many of the step's `num_buffers` gradient
  # buffers its push completed (int64 scalar, after their updates). Hop-BW's barrier reads it.
  completed: Optional[tf.Tensor] = None
  num_buffers: int = 0
  # A straggler delay placed before the push (`--straggler_delay=before_push`): the optimizer
  # calls it with the step's gradients, before it pushes any, and orders every push after the
  # op it returns (the sleep). None: the strategy delays at the end of the step.
  delay_before_push: Optional[Callable[[List[Any]], tf.Tensor]] = None
  # Values for the parameter servers that travel with the step's gradients (`ride`); an optimizer
  # that sends them removes them, the rest are sent when the step's trace ends.
  riders: List["Rider"] = dataclasses.field(default_factory=list)
  # Written by the optimizer: one tensor per gradient it pushed, computed once the push is done
  # (on the variable's parameter server). A rider sent on its own waits for them (`after_pushes`).
  pushed: List[tf.Tensor] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Rider:
  """Values a step sends to a parameter server's device, and what is done with them there."""
  device: str
  values: tf.Tensor                       # 1-D float32, on the worker
  deliver: Callable[[tf.Tensor], Any]     # called under tf.device(device) with the values there
  # Delivered only after every gradient of the step has been pushed (a record that it was).
  after_pushes: bool = False


_local = threading.local()


def current() -> Optional[StepInfo]:
  stack = getattr(_local, "stack", None)
  return stack[-1] if stack else None


def ride(device: str, values: tf.Tensor, deliver: Callable[[tf.Tensor], Any],
         after_pushes: bool = False) -> None:
  """Sends `values` (1-D float32) to `device` and calls `deliver` there with them.

  In a step, with the step's gradients where its optimizer packs them for that device (GBA), else
  on their own when the step's trace ends; outside a step, at once. `deliver` may run after the
  step's other ops: use it for updates nothing in the step reads (a metric's adds). With
  `after_pushes`, not before every gradient the step pushes has been pushed: GBA takes such a
  rider only where all of them go to its device, and delivers it after the pushes there.
  """
  rider = Rider(same_device(device), values, deliver, after_pushes)
  info = current()
  if info is None:
    send(rider)
  else:
    info.riders.append(rider)


def send(rider: Rider, there: Optional[tf.Tensor] = None, after=()) -> Any:
  """Delivers `rider` on its device: with `there`, its values already sent; else one transfer,
  once `after` (tensors on any device) are computed."""
  if there is None:
    with tf.control_dependencies(after):
      values = tf.identity(rider.values)  # where the rider was made: no server waits on another
  with tf.device(rider.device):
    return rider.deliver(tf.identity(values) if there is None else there)


def same_device(device: str) -> str:
  """`device` spelled as every variable's `.device` is, so that equal devices compare equal."""
  return tf.DeviceSpec.from_string(device).to_string() if device else device


@contextlib.contextmanager
def scope(info: StepInfo):
  stack = getattr(_local, "stack", None)
  if stack is None:
    stack = _local.stack = []
  stack.append(info)
  try:
    yield info
  finally:
    stack.pop()
  # The riders no optimizer took (not after an error: the trace is abandoned then).
  left, info.riders = info.riders, []
  for rider in left:
    send(rider, after=info.pushed if rider.after_pushes else ())
