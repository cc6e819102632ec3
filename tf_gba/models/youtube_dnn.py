"""A small YouTube-DNN-style ranker (Covington et al., 2016): embeddings -> ReLU tower -> logit.

Single-valued categorical fields each contribute their embedding (one shared table, see
`embedding.py`), concatenated; the paper's averaging applies to multi-valued fields, which the
data sources here do not have. As in the paper, each numeric value `x` (already `log(1 + count)`,
so >= 0) is fed as `x`, `x**2` and `sqrt(x)`, so the tower gets super- and sub-linear versions
of it for free.
"""

from typing import Mapping, Optional, Sequence

import tensorflow as tf
import tf_keras as keras

from tf_gba.data.info import DataInfo
from tf_gba.models import embedding
from tf_gba.models import inputs as inputs_lib
from tf_gba.models import tower


@keras.utils.register_keras_serializable(package="tf_gba")
class PowerFeatures(keras.layers.Layer):
  """[batch, n] -> [batch, 3n]: x, x^2 and sqrt(max(x, 0))."""

  def call(self, x):
    return tf.concat([x, tf.square(x), tf.sqrt(tf.maximum(x, 0.0))], axis=1)


def youtube_dnn(info: DataInfo, embedding_dim: int = 8, hidden_units: Sequence[int] = (64, 32),
                seed: int = 0, embedding_kind: str = embedding.VOCAB,
                hash_options: Optional[Mapping[str, int]] = None) -> keras.Model:
  """Builds the YouTube-DNN-style model for `info`'s features; returns probabilities [batch, 1].

  Example:

    model = youtube_dnn(tf_gba.data.data_info("movielens100k:/data/ml-100k"))
  """
  features = inputs_lib.feature_inputs(info)
  emb = embedding.categorical_rows(features, info.categorical, embedding_dim, seed,
                                   kind=embedding_kind, hash_options=hash_options)
  x = keras.layers.Flatten(name="flat_embeddings")(emb)
  if info.numeric:
    values = inputs_lib.StackFeatures(info.numeric, name="numeric_values")(features)
    x = keras.layers.Concatenate(name="tower_input")([x, PowerFeatures(name="powers")(values)])
  x = tower.relu_tower(x, hidden_units, seed=seed + 1, name="tower")
  logit = tower.logit_layer(seed=seed + 1 + len(hidden_units))(x)
  prob = keras.layers.Activation("sigmoid", name="probability")(logit)
  return keras.Model(features, prob, name="youtube_dnn")
