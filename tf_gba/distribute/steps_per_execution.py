"""Keras' steps-per-execution counter under GBAStrategy: on the coordinator, 20 steps by default.

`model.fit` under a parameter-server strategy schedules one function per `steps_per_execution`
worker steps, and the coordinator pays a fixed cost for each function it schedules (about 4.5 ms
of CPU: the closure, the remote call, its result), so one step per function held one coordinator
to about 200 worker steps a second. `compile` creates the counter with 1 when it is not given, and
creates it under the strategy's scope, which put it on a parameter server: `fit` then read it from
there once per function (a round trip the server had to serve).

`GBAStrategy` creates that one variable itself, through `counter_creator`: on the coordinator
(Keras keeps it in no checkpoint and passes its value along with each function it schedules), and
with the strategy's `steps_per_execution` (DEFAULT unless given) where `compile` was not given
one. Every step of a function still reads its own batch, takes its own token and pushes its own
gradient; Keras runs the last function of an epoch with only the steps left, so `steps_per_epoch`
counts exactly.

The counter is recognised by where it is created (Keras' `_configure_steps_per_execution`, with
`compile`'s own argument), which tests/distribute/test_steps_per_execution.py checks against the
pinned tf_keras.
"""

import sys
from typing import Callable, Optional

import tensorflow as tf

# Worker steps per scheduled function where compile() sets none (GBAStrategy(steps_per_execution)),
# outside the barrier modes. A user's `model.fit` of DeepFM on 4 workers (benchmarks.step_cost
# --modes=user_fit) cost the coordinator 2.17 ms of CPU per worker step with 1 and 0.24 with 20.
# The price: a worker that fails re-runs its whole function on another worker, so up to 20 steps
# are trained again, past the run's target step (compile(steps_per_execution=1) keeps it to one);
# and a worker takes 20 steps at a time, so an epoch of fewer than 20 steps per worker runs on
# fewer workers.
DEFAULT = 20
_KERAS_CREATOR = "_configure_steps_per_execution"
_FRAMES_SEARCHED = 25


def _keras_request() -> Optional[tuple]:
  """Where a variable is being created for Keras' steps-per-execution counter: (True, the value
  compile() was given, None if none); else None."""
  frame = sys._getframe(2)  # pylint: disable=protected-access
  found = False
  for _ in range(_FRAMES_SEARCHED):
    if frame is None:
      return None
    code = frame.f_code
    if "tf_keras" in code.co_filename:
      if code.co_name == _KERAS_CREATOR:
        found = True
      elif found and code.co_name == "compile":
        return True, frame.f_locals.get("steps_per_execution")
    frame = frame.f_back
  return (True, 0) if found else None  # set outside compile (Keras' property): as asked


def counter_creator(create: Callable, default: int,
                    check: Callable[[int], None] = lambda value: None) -> Callable:
  """Wraps a strategy's variable creation (`extended._create_variable`): Keras' counter is made
  on this process with `default` where compile() set none (`check` raises for a value the
  strategy cannot run); every other variable as before."""

  def create_variable(next_creator, **kwargs):
    request = _keras_request()
    if request is None:
      return create(next_creator, **kwargs)
    if request[1] is None:
      kwargs["initial_value"] = default
    elif request[1]:
      check(int(request[1]))
    with tf.init_scope(), tf.device(None):
      return next_creator(**kwargs)

  return create_variable
