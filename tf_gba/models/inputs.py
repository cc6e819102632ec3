"""Keras inputs for the features a `DataInfo` describes."""

from typing import Dict, Sequence

import tensorflow as tf
import tf_keras as keras

from tf_gba.data.info import DataInfo


def feature_inputs(info: DataInfo) -> Dict[str, keras.Input]:
  """One scalar-per-example `keras.Input` per feature, named as the dataset's feature dict keys."""
  inputs = {name: keras.Input(shape=(), dtype=tf.int64, name=name) for name in info.categorical}
  inputs.update({name: keras.Input(shape=(), dtype=tf.float32, name=name)
                 for name in info.numeric})
  return inputs


@keras.utils.register_keras_serializable(package="tf_gba")
class StackFeatures(keras.layers.Layer):
  """Stacks the named [batch] features of a feature dict into one [batch, len(names)] tensor."""

  def __init__(self, names: Sequence[str], **kwargs):
    super().__init__(**kwargs)
    self.names = list(names)

  def call(self, features):
    return tf.stack([features[name] for name in self.names], axis=1)

  def get_config(self):
    return {**super().get_config(), "names": self.names}
