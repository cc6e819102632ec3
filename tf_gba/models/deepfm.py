"""DeepFM (Guo et al., 2017): a factorization machine and a DNN over the same field embeddings.

    p = sigmoid(first_order + fm_second_order + dnn)

Every field (categorical or numeric) has an embedding of width `embedding_dim + 1`: column 0 is
its first-order weight, columns 1.. its FM vector. Categorical fields share one table (see
`embedding.py`); a numeric field's row is scaled by its value.
"""

from typing import Mapping, Optional, Sequence

import tensorflow as tf
import tf_keras as keras

from tf_gba.data.info import DataInfo
from tf_gba.models import embedding
from tf_gba.models import inputs as inputs_lib
from tf_gba.models import tower


@keras.utils.register_keras_serializable(package="tf_gba")
class FactorizationMachine(keras.layers.Layer):
  """[batch, fields, 1 + k] field rows -> [batch, 1] first-order plus pairwise FM terms.

  The pairwise term uses the O(fields * k) identity
  sum_{i<j} <v_i, v_j> = 0.5 * sum_k ((sum_i v_ik)^2 - sum_i v_ik^2).
  """

  def call(self, rows):
    first = tf.reduce_sum(rows[:, :, 0], axis=1, keepdims=True)
    v = rows[:, :, 1:]
    square_of_sum = tf.square(tf.reduce_sum(v, axis=1))
    sum_of_squares = tf.reduce_sum(tf.square(v), axis=1)
    second = 0.5 * tf.reduce_sum(square_of_sum - sum_of_squares, axis=1, keepdims=True)
    return first + second


def deepfm(info: DataInfo, embedding_dim: int = 8, hidden_units: Sequence[int] = (64, 32),
           seed: int = 0, embedding_kind: str = embedding.VOCAB,
           hash_options: Optional[Mapping[str, int]] = None) -> keras.Model:
  """Builds DeepFM for `info`'s features; returns click probabilities [batch, 1].

  Example:

    model = deepfm(tf_gba.data.data_info("synthetic"))
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=[keras.metrics.AUC()])
  """
  features = inputs_lib.feature_inputs(info)
  rows = embedding.categorical_rows(features, info.categorical, embedding_dim + 1, seed,
                                    kind=embedding_kind, hash_options=hash_options)
  if info.numeric:
    values = inputs_lib.StackFeatures(info.numeric, name="numeric_values")(features)
    numeric_rows = embedding.NumericEmbedding(
        embedding_dim + 1, keras.initializers.RandomNormal(stddev=0.01, seed=seed + 1),
        name="numeric_embedding")(values)
    rows = keras.layers.Concatenate(axis=1, name="field_rows")([rows, numeric_rows])

  fm = FactorizationMachine(name="fm")(rows)
  vectors = keras.layers.Flatten(name="dnn_input")(rows[:, :, 1:])
  deep = tower.relu_tower(vectors, hidden_units, seed=seed + 2, name="dnn")
  deep = tower.logit_layer(seed=seed + 2 + len(hidden_units), name="dnn_logit")(deep)
  logit = keras.layers.Add(name="logit")([fm, deep])
  prob = keras.layers.Activation("sigmoid", name="probability")(logit)
  return keras.Model(features, prob, name="deepfm")
