"""Where a tf_keras optimizer that is not tf_gba's applies gradients: the hooks tf_gba puts there.

A user's own script compiles with a plain `tf_keras.optimizers.Adam` first. Two things of
tf_gba must see what such an optimizer does with a step's gradients, and tf_keras has no hook
for either, so this module wraps two of its methods (once, on first registration):

* checks, at the entry of `apply_gradients` (tf_keras' optimizers and its legacy ones), before
  the optimizer builds or applies anything: `GBAStrategy` refuses, in its buffered modes, an
  optimizer that would apply every gradient on arrival; a HashEmbedding refuses an optimizer its
  table cannot apply.
* appliers, at `_internal_apply_gradients` (tf_keras' optimizers), where Keras has aggregated,
  clipped (`global_clipnorm` over all the step's gradients) and summed duplicate rows: a
  HashEmbedding's table takes its rows' gradient there and applies it itself; the other pairs go
  on to Keras, which then advances `iterations`.

tf_gba's own optimizers that override `apply_gradients` (GBA, DTS) never reach either.

A refusal raised while a step is traced goes through `one_line`, so that the user sees the one
line, not AutoGraph's "in user code:" rewrite of it (or, where the step is the body of a loop of
several steps per function, the loop's own error that quotes it: `raised_in_loop_staging`).

Imports nothing of tf_gba (the lowest layer).
"""

import threading
from typing import Callable, Dict, List, Optional, Tuple

# An optimizer class with this attribute set (AdaptiveRevision) is asynchronous by design: the
# buffered modes of GBAStrategy let it apply every gradient on arrival.
ASYNCHRONOUS = "_tf_gba_asynchronous"

Check = Callable[[object, list], None]
Applier = Callable[[object, list], Tuple[list, list]]

_LOCK = threading.Lock()
# The last error `one_line` marked: on any thread, since a distribution strategy traces a replica's
# step on a thread of its own (mirrored_run) while the thread that scheduled it waits.
_ONE_LINE: List[Optional[Exception]] = [None]
_CHECKS: Dict[str, Tuple[int, Check]] = {}
_APPLIERS: Dict[str, Applier] = {}
_INSTALLED = False


def one_line(error: Exception) -> Exception:
  """`error`, marked so that a `tf.function` being traced raises it as it is.

  AutoGraph would otherwise raise a copy whose message starts with "in user code:" and the
  frames of the traced functions. TF internal (no public equivalent): AutoGraph attaches no
  error metadata to an exception that has `ag_pass_through`.
  """
  error.ag_pass_through = True
  _ONE_LINE[0] = error
  return error


def raised_in_loop_staging(error: Exception) -> Optional[Exception]:
  """The `one_line` error that `error` quotes, if any; else None.

  AutoGraph stages one iteration of a loop whose variables are undefined before it (Keras'
  `for _ in tf.range(steps_per_execution)` around its train step) and turns any ValueError or
  TypeError raised there into a ValueError of its own ("'outputs' must be defined before the
  loop ... ran into a ValueError: <the error>"), whatever `ag_pass_through` says. TF internal
  behaviour (autograph/operators/control_flow.py, `_try_handling_undefineds`).
  """
  own = _ONE_LINE[0]
  if own is None or own is error or str(own) not in str(error):
    return None
  return own


def add_check(name: str, order: int, check: Check) -> None:
  """`check(optimizer, grads_and_vars)` runs at the entry of every tf_keras optimizer's
  `apply_gradients` (raise to refuse), lowest `order` first; one check per `name`."""
  with _LOCK:
    _CHECKS[name] = (order, check)
    _install()


def add_applier(name: str, applier: Applier) -> None:
  """`applier(optimizer, grads_and_vars) -> (pairs left to Keras, ops it ran)` runs where a
  tf_keras optimizer applies its (aggregated, clipped, deduplicated) pairs, before Keras applies
  the pairs left and advances `iterations`; one applier per `name`."""
  with _LOCK:
    _APPLIERS[name] = applier
    _install()


def _checked(grads_and_vars, optimizer) -> list:
  pairs = list(grads_and_vars)
  with _LOCK:
    checks = [check for _, check in sorted(_CHECKS.values(), key=lambda item: item[0])]
  for check in checks:
    check(optimizer, pairs)
  return pairs


def _install() -> None:
  global _INSTALLED
  if _INSTALLED:
    return
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # tf_keras internals (no public equivalent): the optimizers' base classes.
  from tf_keras.src.optimizers import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
  from tf_keras.src.optimizers.legacy import optimizer_v2  # pylint: disable=g-import-not-at-top

  apply_gradients = optimizer_lib.Optimizer.apply_gradients
  internal_apply = optimizer_lib.Optimizer._internal_apply_gradients  # pylint: disable=protected-access
  legacy_apply_gradients = optimizer_v2.OptimizerV2.apply_gradients

  def checked_apply_gradients(self, grads_and_vars, *args, **kwargs):
    return apply_gradients(self, _checked(grads_and_vars, self), *args, **kwargs)

  def checked_legacy_apply_gradients(self, grads_and_vars, *args, **kwargs):
    return legacy_apply_gradients(self, _checked(grads_and_vars, self), *args, **kwargs)

  def applying_internal_apply(self, grads_and_vars):
    pairs, ran = list(grads_and_vars), []
    with _LOCK:
      appliers = list(_APPLIERS.values())
    for applier in appliers:
      pairs, ops = applier(self, pairs)
      ran.extend(ops)
    if not ran:
      return internal_apply(self, pairs)
    # After the rows' updates, which read `iterations` (LazyAdam's step, the table's own step).
    with tf.control_dependencies(ran):
      return internal_apply(self, pairs)

  for method, wrapper in ((apply_gradients, checked_apply_gradients),
                          (legacy_apply_gradients, checked_legacy_apply_gradients),
                          (internal_apply, applying_internal_apply)):
    wrapper.__name__, wrapper.__doc__ = method.__name__, method.__doc__
    wrapper.__wrapped__ = method
  optimizer_lib.Optimizer.apply_gradients = checked_apply_gradients
  optimizer_lib.Optimizer._internal_apply_gradients = applying_internal_apply  # pylint: disable=protected-access
  optimizer_v2.OptimizerV2.apply_gradients = checked_legacy_apply_gradients
  _INSTALLED = True

