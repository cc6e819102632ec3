"""DCN-v2 (Wang et al., 2021), stacked: cross layers, then a ReLU tower, over field embeddings.

The input `x0` concatenates every categorical field's embedding (one shared table, see
`embedding.py`) with the numeric values; `tensorflow_recommenders.layers.dcn.Cross` computes
`x_{l+1} = x0 * (W x_l + b) + x_l`, full rank unless `projection_dim` is given.
"""

from typing import Mapping, Optional, Sequence

import tensorflow_recommenders as tfrs
import tf_keras as keras

from tf_gba.data.info import DataInfo
from tf_gba.models import embedding
from tf_gba.models import inputs as inputs_lib
from tf_gba.models import tower


def dcn(info: DataInfo, embedding_dim: int = 8, hidden_units: Sequence[int] = (64, 32),
        seed: int = 0, num_cross_layers: int = 2, projection_dim: Optional[int] = None,
        embedding_kind: str = embedding.VOCAB,
        hash_options: Optional[Mapping[str, int]] = None) -> keras.Model:
  """Builds DCN-v2 for `info`'s features; returns click probabilities [batch, 1].

  Example:

    model = dcn(tf_gba.data.data_info("synthetic"), num_cross_layers=3, projection_dim=16)
  """
  features = inputs_lib.feature_inputs(info)
  emb = embedding.categorical_rows(features, info.categorical, embedding_dim, seed,
                                   kind=embedding_kind, hash_options=hash_options)
  x0 = keras.layers.Flatten(name="flat_embeddings")(emb)
  if info.numeric:
    values = inputs_lib.StackFeatures(info.numeric, name="numeric_values")(features)
    x0 = keras.layers.Concatenate(name="x0")([x0, values])

  x = x0
  for i in range(num_cross_layers):
    x = tfrs.layers.dcn.Cross(
        projection_dim=projection_dim,
        kernel_initializer=keras.initializers.TruncatedNormal(stddev=0.05, seed=seed + 1 + i),
        name=f"cross_{i}")(x0, x)
  x = tower.relu_tower(x, hidden_units, seed=seed + 1 + num_cross_layers, name="deep")
  logit = tower.logit_layer(seed=seed + 1 + num_cross_layers + len(hidden_units))(x)
  prob = keras.layers.Activation("sigmoid", name="probability")(logit)
  return keras.Model(features, prob, name="dcn")
