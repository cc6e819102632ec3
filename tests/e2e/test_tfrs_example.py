"""examples/tfrs_ranking.py, TFRS's basic-ranking tutorial model trained with GBA on a LocalCluster.

Run briefly as a user runs it: it must beat the mean predictor on the test ratings and keep the
terminal quiet (no gRPC or TensorFlow runtime lines). And the tutorial's default loss reduction,
which Keras refuses under a strategy, is reported in one line that says what to pass.
"""

import os
import re
import subprocess
import sys

import tf_gba  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads Keras)
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_recommenders as tfrs

import shared_data

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def _env():
  env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # as in a user's shell (the tests' conftest sets it)
  return env


@pytest.mark.parametrize("optimizer,global_steps", [("gba", 80), ("adaptive_revision", 160)])
def test_example_beats_the_mean_predictor_quietly(optimizer, global_steps):
  data = shared_data.require("movielens_100k")
  run = subprocess.run(
      [sys.executable, os.path.join(_ROOT, "examples", "tfrs_ranking.py"), f"--data={data}",
       "--epochs=1", "--steps_per_epoch=160", f"--optimizer={optimizer}"],
      capture_output=True, text=True, timeout=500, env=_env(), cwd=_ROOT, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  match = re.search(r"test RMSE ([\d.]+) vs ([\d.]+) for the mean predictor \((\d+) global",
                    run.stdout)
  assert match, run.stdout
  rmse, mean_rmse, steps = float(match.group(1)), float(match.group(2)), int(match.group(3))
  print(run.stdout)
  assert steps == global_steps            # 160 local batches: M = 2 for GBA, 1 asynchronously
  assert 1.0 < mean_rmse < 1.3            # the mean predictor on MovieLens-100K's stars
  assert rmse < mean_rmse
  assert run.stderr.strip() == "", run.stderr[-3000:]


class _Tutorial(tfrs.models.Model):
  """The tutorial's model with its default task loss (MeanSquaredError(), reduction AUTO)."""

  def __init__(self):
    super().__init__()
    self.embedding = tf.keras.layers.Embedding(10, 4)
    self.dense = tf.keras.layers.Dense(1)
    self.task = tfrs.tasks.Ranking(loss=tf.keras.losses.MeanSquaredError())

  def call(self, features):
    return self.dense(self.embedding(features["user_id"]))

  def compute_loss(self, features, training=False):
    labels = features.pop("user_rating")
    return self.task(labels=labels, predictions=self(features))


def test_default_loss_reduction_is_reported_in_one_line():
  from tf_gba.distribute.strategy import LOSS_REDUCTION_HINT  # pylint: disable=g-import-not-at-top
  data = {"user_id": np.arange(8) % 10, "user_rating": np.ones(8, np.float32)}
  with tf_gba.distribute.LocalCluster(num_ps=1, num_workers=1) as cluster:
    strategy = tf_gba.distribute.GBAStrategy(cluster.resolver())
    with strategy.scope():
      model = _Tutorial()
      model.compile(optimizer=tf_gba.optimizers.GBA(tf.keras.optimizers.Adagrad(0.1)))
    creator = tf.keras.utils.experimental.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices(data).repeat().batch(4))
    with pytest.raises(ValueError) as raised:
      model.fit(creator, epochs=1, steps_per_epoch=1, verbose=0)
  message = str(raised.value)
  assert LOSS_REDUCTION_HINT in message and "reduction=tf.keras.losses.Reduction.SUM" in message
  assert "\n" not in LOSS_REDUCTION_HINT
