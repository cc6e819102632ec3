"""What a training step knows about itself: the token fetched when it started, and pre-step reads.

`GBAStrategy.run` fetches a token (and runs any registered pre-step readers, e.g. AdaptiveRevision's
gradient-sum snapshot) *before* the step function builds its forward pass, and publishes them here
for the duration of the trace. Optimizers read them in `apply_gradients`. Outside a GBAStrategy step
`current()` is None and optimizers fall back to their own local behaviour.
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


_local = threading.local()


def current() -> Optional[StepInfo]:
  stack = getattr(_local, "stack", None)
  return stack[-1] if stack else None


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
