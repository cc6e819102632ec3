"""What an optimizer that wraps another one (GBA, DTS) hands to it.

The step counter, learning rate and variables are the inner optimizer's, and so are the
checkpoint children: the wrapper only adds one entry of its own (`_wrapper_state()`), so a
checkpoint written by the bare inner optimizer (synchronous training) restores into the wrapper and
back with the same hyper-parameters.
"""

from typing import Tuple


class InnerOptimizerDelegation:
  """Mixin placed before `tf_keras.optimizers.Optimizer`; the class sets `self._inner`."""

  def _wrapper_state(self) -> Tuple[str, object]:
    """(checkpoint key, trackable) of the wrapper's own state."""
    raise NotImplementedError

  @property
  def inner_optimizer(self):
    return self._inner

  @property
  def iterations(self):
    return self._inner.iterations

  @iterations.setter
  def iterations(self, variable):
    self._inner.iterations = variable

  @property
  def learning_rate(self):
    return self._inner.learning_rate

  @learning_rate.setter
  def learning_rate(self, value):
    self._inner.learning_rate = value

  @property
  def variables(self):
    return self._inner.variables

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    children = dict(self._inner._trackable_children(save_type, **kwargs))  # pylint: disable=protected-access
    # A SavedModel is what a server loads, with stock TensorFlow: the wrapper's state lives in
    # resources made and read by tf_gba's ops, which such a process does not have, and is training
    # state only (buffers, tokens). It stays in checkpoints, out of SavedModels.
    if save_type != "savedmodel":
      key, state = self._wrapper_state()
      children[key] = state
    return children
