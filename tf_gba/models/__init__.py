"""CTR models built as plain tf_keras functional models over a `tf_gba.data.DataInfo`.

Each takes the dataset's feature dict and returns click probabilities [batch, 1], trains with the
stock Keras `train_step`, and keeps all categorical fields in one embedding table named
`categorical_embedding` (one variable, shardable by a `variable_partitioner`).

Example:

  info = tf_gba.data.data_info("synthetic")
  model = tf_gba.models.build_model("deepfm", info)
  model.compile(optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.BinaryCrossentropy(), metrics=[keras.metrics.AUC()])
  model.fit(tf_gba.data.make_dataset("synthetic"), epochs=1)
"""

from typing import Mapping, Optional, Sequence

import tf_keras as keras

from tf_gba.data.info import DataInfo
from tf_gba.models.dcn import dcn
from tf_gba.models.deepfm import deepfm
from tf_gba.models.embedding import FieldEmbedding, FieldKeys, NumericEmbedding
from tf_gba.models.embedding import HASH as EMBEDDING_HASH
from tf_gba.models.embedding import KINDS as EMBEDDINGS
from tf_gba.models.embedding import VOCAB as EMBEDDING_VOCAB
from tf_gba.models.youtube_dnn import youtube_dnn

MODELS = {"deepfm": deepfm, "dcn": dcn, "youtube_dnn": youtube_dnn}


def build_model(name: str, info: DataInfo, embedding_dim: int = 8,
                hidden_units: Sequence[int] = (64, 32), seed: int = 0,
                embedding: str = EMBEDDING_VOCAB,
                hash_options: Optional[Mapping[str, int]] = None) -> keras.Model:
  """Builds the model called `name` ("deepfm", "dcn" or "youtube_dnn") for `info`'s features.

  `embedding`: "vocab", the categorical fields in one partitionable table over their
  vocabularies, or "hash", in one `tf_gba.layers.HashEmbedding` over their raw ids (no
  vocabulary, no modulo; it needs `tf_gba.optimizers.GBA`, and a parameter-server strategy or
  none). `hash_options`: its admission and eviction arguments (min_frequency, ttl_steps,
  max_rows, eviction_interval).
  """
  if name not in MODELS:
    raise ValueError(f"Unknown model {name!r}; choose one of {sorted(MODELS)}.")
  if embedding not in EMBEDDINGS:
    raise ValueError(f"embedding must be one of {EMBEDDINGS}, got {embedding!r}.")
  return MODELS[name](info, embedding_dim=embedding_dim, hidden_units=tuple(hidden_units),
                      seed=seed, embedding_kind=embedding, hash_options=hash_options)


__all__ = ["MODELS", "build_model", "dcn", "deepfm", "youtube_dnn", "FieldEmbedding",
           "FieldKeys", "NumericEmbedding", "EMBEDDINGS", "EMBEDDING_HASH", "EMBEDDING_VOCAB"]
