"""The baselines' barriers and step sizes on real TF servers (LocalCluster on 127.0.0.1).

The model is one weight vector w with loss 0.5 * |w|^2, so a gradient is the value of w it was
computed on. With SGD at learning rate 0.5, a step whose gradients were all computed on the
current version halves w: after K steps w = w0 * 2^-K exactly (powers of two are exact in float32).
One gradient from an older version (2^j times larger) in any step would break that.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute import GBAStrategy
from tf_gba.distribute import LocalCluster
from tf_gba.optimizers import GBA

W0 = np.array([1.0, -4.0], np.float32)


class Quadratic(keras.Model):
  def __init__(self):
    super().__init__()
    self.w = self.add_weight(name="w", shape=(2,), dtype=tf.float32,
                             initializer=keras.initializers.Constant(W0))

  def call(self, x):
    return x

  def train_step(self, data):
    del data
    with tf.GradientTape() as tape:
      loss = 0.5 * tf.reduce_sum(self.w * self.w)
    self.optimizer.apply_gradients([(tape.gradient(loss, self.w), self.w)])
    return {"loss": loss}


def _fit(strategy, steps, epochs=1):
  with strategy.scope():
    model = Quadratic()
    optimizer = GBA(keras.optimizers.SGD(0.5))
    model.compile(optimizer)
    optimizer.build(model.trainable_variables)
  dataset_fn = lambda _: tf.data.Dataset.from_tensors(0.0).repeat()
  model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
            steps_per_epoch=steps, verbose=0)
  return model, optimizer


def test_hop_bw_aggregates_only_current_version_one_gradient_per_worker_and_version():
  steps, epochs = 40, 2
  with LocalCluster(num_ps=1, num_workers=4) as cluster:
    # Worker 0 is 4x slower, on a 50 ms compute floor so that the profile, not the load of the
    # machine, sets the pace. Default b3 = max(1, round(4 / 5)) = 1: 3 gradients per step.
    strategy = GBAStrategy(cluster.resolver(), mode="hop_bw",
                           stragglers="compute:50+persistent:4@0")
    assert strategy.num_aggregate == 3
    model, optimizer = _fit(strategy, steps, epochs)
    k = int(optimizer.iterations.numpy())
    w = model.w.numpy()
    barrier = strategy.hop_bw_stats()
    dense = optimizer.stats()["dense"]
  assert k >= 10
  # Every aggregated gradient of every step was computed on that step's version.
  np.testing.assert_array_equal(w, W0 * np.float32(2.0) ** -k)
  # At most one gradient per worker and version: versions 0..k were open to them.
  gradients = np.array(barrier["gradients"])
  assert np.all(gradients <= k + 1), (gradients, k)
  assert barrier["duplicates"] == [0, 0, 0, 0]
  assert barrier["version"] == k
  # Every step ran (none were lost to a hang); those released at the end pushed nothing.
  assert gradients.sum() + sum(barrier["released"]) == steps * epochs
  assert dense["pushes"] == gradients.sum()
  # Late gradients (computed on a version already aggregated) are dropped and counted; the
  # rest fill the k steps, and fewer than 3 wait for step k.
  pending = dense["pushes"] - dense["dropped"] - 3 * k
  assert 0 <= pending < 3 and dense["pending"] == pending
  assert dense["dropped"] >= 1
  # The straggler's gradients are the late ones: it runs far fewer steps than the others.
  assert gradients[0] < min(gradients[1:])


def test_bsp_with_b2_below_n_applies_after_exactly_b2_gradients():
  steps = 30
  with LocalCluster(num_ps=1, num_workers=4) as cluster:
    strategy = GBAStrategy(cluster.resolver(), mode="bsp", bsp_aggregate=2)
    assert strategy.num_aggregate == 2
    _, optimizer = _fit(strategy, steps)
    stats = optimizer.stats()
  assert stats["dense"]["pushes"] == steps and stats["dense"]["dropped"] == 0
  assert stats["global_step"] == steps // 2 and stats["dense"]["pending"] == 0


@pytest.mark.parametrize("num_workers,b2,b3", [(1, 1, 0), (4, 1, 1), (8, 2, 2), (100, 20, 20)])
def test_default_b2_and_b3_are_a_fifth_of_the_workers(num_workers, b2, b3):
  from tf_gba.distribute import modes  # pylint: disable=g-import-not-at-top
  assert modes.num_aggregate_for("bsp", num_workers) == b2
  assert modes.num_aggregate_for("hop_bw", num_workers) == num_workers - b3
