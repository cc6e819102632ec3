"""The package's top level: Keras 2 set up, subpackages reachable from `import tf_gba`."""

import os

import pytest

import tf_gba


def test_subpackages_are_reachable_from_the_top_level():
  from tf_gba.optimizers.gba import GBA  # pylint: disable=g-import-not-at-top
  assert tf_gba.optimizers.GBA is GBA
  assert callable(tf_gba.distribute.LocalCluster)
  with pytest.raises(AttributeError, match="no attribute 'nothing'"):
    tf_gba.nothing  # pylint: disable=pointless-statement


def test_keras_2_is_selected():
  assert os.environ["TF_USE_LEGACY_KERAS"] == "1"
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  assert tf.keras.__name__.startswith("tf_keras")  # tf.keras resolves to Keras 2, not Keras 3
