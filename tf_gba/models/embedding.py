"""Embedding tables shared by all fields, to keep the number of variables small.

On parameter servers every trainable variable costs one gradient push per step, so the models keep
all categorical fields in ONE table: field `f` owns rows `[offset_f, offset_f + vocab_f)` and its
ids are shifted by `offset_f` before the lookup. The table is an ordinary layer weight, so a
`ParameterServerStrategy` `variable_partitioner` shards it across parameter servers, and its
gradient is an `IndexedSlices` (a gather, never a one-hot matmul).

With `kind="hash"` (`categorical_rows`) the shared table is a `tf_gba.layers.HashEmbedding`
instead: no vocabulary, each field's raw ids keyed apart by `FieldKeys`.
"""

from typing import Mapping, Optional

import numpy as np
import tensorflow as tf
import tf_keras as keras

from tf_gba.layers.hash_embedding import HashEmbedding


@keras.utils.register_keras_serializable(package="tf_gba")
class FieldEmbedding(keras.layers.Layer):
  """Looks up every categorical field of a feature dict in one shared table.

  Args:
    vocab_sizes: feature name -> vocabulary size, in field order.
    output_dim: width of each row.
    embeddings_initializer: initializer of the table.

  Call with the feature dict (int64 ids [batch] per name); returns [batch, fields, output_dim].

  Example:

    layer = FieldEmbedding({"user": 10, "item": 20}, output_dim=4)
    layer({"user": tf.constant([1, 2]), "item": tf.constant([0, 19])}).shape  # [2, 2, 4]
  """

  def __init__(self, vocab_sizes: Mapping[str, int], output_dim: int,
               embeddings_initializer="uniform", **kwargs):
    super().__init__(**kwargs)
    self.vocab_sizes = dict(vocab_sizes)
    self.output_dim = output_dim
    self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
    sizes = np.array(list(self.vocab_sizes.values()), np.int64)
    self._offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    self.total_rows = int(sizes.sum())

  def build(self, input_shape):
    self.embeddings = self.add_weight(
        name="embeddings", shape=(self.total_rows, self.output_dim),
        initializer=self.embeddings_initializer, trainable=True)
    super().build(input_shape)

  def call(self, features):
    ids = tf.stack([tf.cast(features[name], tf.int64) for name in self.vocab_sizes], axis=1)
    return tf.nn.embedding_lookup(self.embeddings, ids + self._offsets)

  def get_config(self):
    return {**super().get_config(), "vocab_sizes": self.vocab_sizes,
            "output_dim": self.output_dim,
            "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer)}


@keras.utils.register_keras_serializable(package="tf_gba")
class NumericEmbedding(keras.layers.Layer):
  """Gives each numeric field a vector scaled by its value: [batch, n] -> [batch, n, output_dim].

  This lets numeric fields take part in field interactions (FM) like categorical ones, with one
  small dense variable for all of them.
  """

  def __init__(self, output_dim: int, embeddings_initializer="uniform", **kwargs):
    super().__init__(**kwargs)
    self.output_dim = output_dim
    self.embeddings_initializer = keras.initializers.get(embeddings_initializer)

  def build(self, input_shape):
    self.embeddings = self.add_weight(
        name="embeddings", shape=(int(input_shape[-1]), self.output_dim),
        initializer=self.embeddings_initializer, trainable=True)
    super().build(input_shape)

  def call(self, values):
    return values[:, :, None] * self.embeddings

  def get_config(self):
    return {**super().get_config(), "output_dim": self.output_dim,
            "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer)}


# Kinds of categorical embedding a model can be built with (the binary's --embedding).
VOCAB = "vocab"
HASH = "hash"
KINDS = (VOCAB, HASH)
# A field's index goes into the top byte of its keys (see FieldKeys).
_FIELD_SHIFT = 56


@keras.utils.register_keras_serializable(package="tf_gba")
class FieldKeys(keras.layers.Layer):
  """The categorical fields of a feature dict as hash-table keys: [batch] each -> [batch, fields].

  All fields share one HashEmbedding (one table: one keyed buffer per parameter server per step,
  as the vocabulary path keeps one shared variable). Field f's id x becomes the key
  `x XOR (f << 56)`, so equal raw ids of two fields (MovieLens' user 5 and item 5, a missing
  value's id 0) get rows of their own. Within a field the map is a bijection: no two ids share a
  row. Ids below 2^56 of different fields never collide; 64-bit fingerprints collide across
  fields only where they differ in exactly that top-byte pattern (probability ~2^-64 per pair).
  """

  def __init__(self, names, **kwargs):
    super().__init__(**kwargs)
    self.names = list(names)

  def call(self, features):
    ids = tf.stack([tf.cast(features[name], tf.int64) for name in self.names], axis=1)
    tags = tf.constant([f << _FIELD_SHIFT for f in range(len(self.names))], tf.int64)
    return tf.bitwise.bitwise_xor(ids, tags)

  def get_config(self):
    return {**super().get_config(), "names": self.names}


def field_keys(names, ids: np.ndarray) -> np.ndarray:
  """NumPy twin of FieldKeys: int64 ids [batch, len(names)] -> their keys (tests, tools)."""
  tags = np.array([f << _FIELD_SHIFT for f in range(len(names))], np.int64)
  return np.bitwise_xor(np.asarray(ids, np.int64), tags)


def categorical_rows(features, vocab_sizes: Mapping[str, int], output_dim: int, seed: int,
                     kind: str = VOCAB, stddev: float = 0.01,
                     hash_options: Optional[Mapping[str, int]] = None):
  """[batch, fields, output_dim] rows of every categorical field, in one table named
  `categorical_embedding`: a FieldEmbedding over the vocabularies (`kind="vocab"`), or a
  HashEmbedding over the raw ids (`kind="hash"`), both initialised N(0, stddev).

  `hash_options`: the HashEmbedding's admission and eviction arguments (min_frequency,
  ttl_steps, max_rows, eviction_interval); only with `kind="hash"`."""
  if kind == VOCAB:
    if hash_options and any(hash_options.values()):
      raise ValueError("hash_options (admission, eviction) apply to kind='hash' only.")
    return FieldEmbedding(vocab_sizes, output_dim,
                          keras.initializers.RandomNormal(stddev=stddev, seed=seed),
                          name="categorical_embedding")(features)
  if kind == HASH:
    keys = FieldKeys(list(vocab_sizes), name="categorical_keys")(features)
    return HashEmbedding(output_dim, seed=seed, embeddings_initializer="normal", stddev=stddev,
                         name="categorical_embedding", **(hash_options or {}))(keys)
  raise ValueError(f"embedding must be one of {KINDS}, got {kind!r}.")
