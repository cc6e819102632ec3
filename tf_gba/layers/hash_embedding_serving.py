"""HashEmbedding in a SavedModel: its table's rows as stock TensorFlow state (SPEC section 6).

A server (TF Serving, `tf.saved_model.load` without tf_gba) has none of tf_gba's ops, so the table
resource cannot go into a SavedModel. While a SavedModel is written (`export_for_serving`,
`model.save`, `tf.saved_model.save`), every HashEmbedding instead holds `ServingRows`: the table's
rows at that moment, as two variables (its keys sorted, and their rows), looked up with
`tf.searchsorted`; a key not among them gets its initial row, computed with stock uint64 ops
(`tf_gba.ops.hash_initial_rows`), exactly the table's own. Find only, as evaluation: nothing is
inserted, the served rows never change. Checkpoints keep the table itself, with every row field.
"""

import copy
from typing import Optional

import numpy as np
import tensorflow as tf
# TF internal (no public equivalent): whether a SavedModel is being written, and its options.
from tensorflow.python.saved_model import save_context  # pylint: disable=g-direct-tensorflow-import

from tf_gba.ops import hash_initial_rows

# The trackable name of the rows in a SavedModel, beside the layer's weights.
CHILD = "serving_rows"


class ServingRows(tf.Module):
  """A hash table's rows at one moment, found with stock ops only.

  `sorted_keys` is [n + 1] int64, the keys in increasing order and then the largest int64 (so
  every search lands on an entry); `values` is [n + 1, dim], the keys' rows and a zero row.
  """

  def __init__(self, keys, values, dim: int, seed: int, initializer: str, init_a: float,
               init_b: float, name: Optional[str] = None, admission: bool = False):
    super().__init__(name=name)
    # With admission (min_frequency > 1) a key without a row reads the zero row, as in training
    # and evaluation (SPEC 6); else its initial row.
    self._admission = bool(admission)
    keys, values = np.asarray(keys, np.int64), np.asarray(values, np.float32).reshape(-1, dim)
    order = np.argsort(keys, kind="stable")
    self.sorted_keys = tf.Variable(np.append(keys[order], np.iinfo(np.int64).max),
                                   trainable=False, name="sorted_keys")
    self.values = tf.Variable(np.concatenate([values[order], np.zeros([1, dim], np.float32)]),
                              trainable=False, name="values")
    self._init = dict(dim=int(dim), seed=int(seed), initializer=initializer,
                      init_a=float(init_a), init_b=float(init_b))

  @property
  def size(self) -> int:
    """Rows held (eager)."""
    return int(self.sorted_keys.shape[0]) - 1

  def find(self, keys: tf.Tensor) -> tf.Tensor:
    """[n, dim] rows of the int64 vector `keys`; a key without a row gets its initial row (the
    zero row with admission)."""
    keys = tf.convert_to_tensor(keys, tf.int64)
    sorted_keys = self.sorted_keys.read_value()
    position = tf.searchsorted(sorted_keys, keys, side="left")  # in [0, n]: the last is int64 max
    found = (tf.gather(sorted_keys, position) == keys) & (
        position < tf.size(sorted_keys, out_type=position.dtype) - 1)
    rows = tf.gather(self.values.read_value(), position)
    if self._admission:
      return tf.where(found[:, None], rows, tf.zeros_like(rows))
    return tf.where(found[:, None], rows, hash_initial_rows.initial_rows(keys, **self._init))


class _ThisSave(tf.saved_model.SaveOptions):
  """The options of the save being written, copied, as the mark of that one save."""
  __slots__ = ()


def _this_save() -> _ThisSave:
  """An object that is the same all through the save being written and new for every save.

  The save's options, copied and put in their place for the rest of the save (TF clears them
  when it ends): a caller may pass one SaveOptions object to many saves, and each must take the
  table's rows anew.
  """
  options = save_context.get_save_options()
  if not isinstance(options, _ThisSave):
    options = copy.copy(options)
    options.__class__ = _ThisSave
    save_context._save_context._options = options  # pylint: disable=protected-access
  return options


def serving_rows(layer) -> Optional[ServingRows]:
  """The rows `layer` serves in the SavedModel being written; None outside a save.

  Taken from the layer's table on the save's first request (eagerly, even while a function is
  traced), then reused until the save ends: every function of the save finds the same rows.
  """
  if not save_context.in_save_context():
    return None
  this_save = _this_save()
  taken = getattr(layer, "_tf_gba_serving", None)
  if taken is None or taken[0] is not this_save:
    with tf.init_scope():
      rows = layer.table.export()
      normal = layer.embeddings_initializer == "normal"
      taken = (this_save, ServingRows(
          rows["keys"].numpy(), rows["values"].numpy(), layer.output_dim, layer.seed,
          layer.embeddings_initializer, layer.mean if normal else layer.minval,
          layer.stddev if normal else layer.maxval, name=f"{layer.name}_serving_rows",
          admission=layer.min_frequency > 1))
    # A plain tuple through object.__setattr__: Keras does not track it, so checkpoints stay
    # as they were (the table, not a copy of its rows).
    object.__setattr__(layer, "_tf_gba_serving", taken)
  return taken[1]


def savedmodel_children(layer, children: dict) -> dict:
  """The layer's SavedModel children: the table (tf_gba's resource) replaced by its rows."""
  children = {k: v for k, v in children.items() if v is not layer.table}
  rows = serving_rows(layer) if layer.table is not None else None
  if rows is not None:
    children[CHILD] = rows
  return children
