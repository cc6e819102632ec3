"""The ReLU tower (multi-layer perceptron) the models share."""

from typing import Sequence

import tf_keras as keras


def relu_tower(x, hidden_units: Sequence[int], seed: int, name: str):
  """Applies `Dense(units, relu)` for each entry of `hidden_units` to the Keras tensor `x`."""
  for i, units in enumerate(hidden_units):
    x = keras.layers.Dense(units, activation="relu",
                           kernel_initializer=keras.initializers.GlorotUniform(seed=seed + i),
                           name=f"{name}_{i}")(x)
  return x


def logit_layer(seed: int, name: str = "logit") -> keras.layers.Dense:
  return keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
                            name=name)
