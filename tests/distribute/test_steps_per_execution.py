"""Keras' steps-per-execution counter under GBAStrategy, on real TF servers (1 PS, 1 worker).

`compile` without `steps_per_execution` gets the strategy's (k worker steps per function the
coordinator schedules); a value given to `compile` is kept; either way the counter lives on the
coordinator, not on a parameter server. `fit` then trains exactly `epochs x steps_per_epoch`
steps, also where an epoch is not a multiple of k, and each step still applies its own gradient
(async: one application per step), checked against a NumPy run of the same steps.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute import GBAStrategy
from tf_gba.distribute import LocalCluster
from tf_gba.distribute import steps_per_execution

ROWS = 64


@pytest.fixture(scope="module")
def cluster():
  # One worker: its steps run one after another, so the weights are those of sequential SGD.
  with LocalCluster(num_ps=1, num_workers=1) as c:
    yield c


def _dataset_fn(_):
  # Every batch is the same 8 rows: a NumPy replay of as many plain SGD steps gives the weights.
  x = np.ones([8, 1], np.float32)
  y = np.full([8, 1], 2.0, np.float32)
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()


def _model(strategy, **compile_args):
  with strategy.scope():
    model = keras.Sequential([keras.layers.Dense(1, use_bias=False,
                                                 kernel_initializer="zeros")])
    model.build([None, 1])
    model.compile(keras.optimizers.SGD(0.01), loss="mse", **compile_args)
  return model


def _on_the_coordinator(variable) -> bool:
  return "/job:ps/" not in variable.device


def test_compile_without_it_gets_the_strategys_default_on_the_coordinator(cluster):
  strategy = GBAStrategy(cluster.resolver(), mode="async")
  model = _model(strategy)
  counter = model._steps_per_execution  # pylint: disable=protected-access
  assert int(counter.numpy()) == steps_per_execution.DEFAULT
  assert _on_the_coordinator(counter), counter.device
  # Other variables created in the scope still go to the parameter server.
  assert "/job:ps/" in model.trainable_variables[0].device


def test_a_value_given_to_compile_or_the_strategy_is_kept(cluster):
  strategy = GBAStrategy(cluster.resolver(), mode="async", steps_per_execution=7)
  assert int(_model(strategy)._steps_per_execution.numpy()) == 7  # pylint: disable=protected-access
  given = _model(strategy, steps_per_execution=3)._steps_per_execution  # pylint: disable=protected-access
  assert int(given.numpy()) == 3 and _on_the_coordinator(given)
  with pytest.raises(ValueError, match="steps_per_execution"):
    GBAStrategy(cluster.resolver(), mode="async", steps_per_execution=0)


def test_fit_trains_exactly_the_steps_asked_one_gradient_each(cluster):
  strategy = GBAStrategy(cluster.resolver(), mode="async", steps_per_execution=4)
  model = _model(strategy)
  # 2 epochs of 10 steps: functions of 4, 4 and 2 steps each epoch.
  model.fit(keras.utils.experimental.DatasetCreator(_dataset_fn), epochs=2, steps_per_epoch=10,
            verbose=0)
  assert int(model.optimizer.iterations.numpy()) == 20
  assert int(model._steps_per_execution.numpy()) == 4  # pylint: disable=protected-access
  # NumPy: 20 plain SGD steps of mse on w * 1 against 2 (gradient 2 (w - 2) per step).
  w = 0.0
  for _ in range(20):
    w -= 0.01 * 2.0 * (w - 2.0)
  np.testing.assert_allclose(model.trainable_variables[0].numpy().ravel(), [w], rtol=1e-5)


def test_the_barrier_modes_default_to_one_step_and_refuse_more(cluster):
  # Their barriers wait on other workers' steps, which a function of several would hold back.
  assert steps_per_execution.DEFAULT > 1
  strategy = GBAStrategy(cluster.resolver(), mode="hop_bs")
  assert int(_model(strategy)._steps_per_execution.numpy()) == 1  # pylint: disable=protected-access
  with pytest.raises(ValueError, match=r"GBAStrategy\(steps_per_execution\)=20 runs several"):
    GBAStrategy(cluster.resolver(), mode="hop_bs", steps_per_execution=20)
  with pytest.raises(ValueError, match=r"compile\(steps_per_execution\)=2 runs several"):
    _model(strategy, steps_per_execution=2)
