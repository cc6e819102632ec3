"""The contract every tf_gba optimizer keeps, one parametrized test per clause.

A new optimizer is one more `Case` in CASES: how to make it (under its strategy's scope), the
strategy it runs under, and the strategy its misuse message names. Each case:
  * constructs under its strategy's scope;
  * round-trips through get_config/from_config and tf_keras.optimizers.serialize/deserialize,
    inner optimizer included;
  * trains a Keras model with `compile` + `fit` under its strategy (GBA and AdaptiveRevision on a
    real LocalCluster of TF server processes on 127.0.0.1, DTS under a MirroredStrategy);
  * saves with tf.train.Checkpoint and restores into a new model and optimizer, every optimizer
    variable (slots, iterations) equal afterwards;
  * refuses, with a RuntimeError that names the strategy it needs, to be made under another one.
"""

import contextlib
import dataclasses
from typing import Callable, List

import tf_gba  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads Keras)
import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute import GBAStrategy
from tf_gba.distribute import LocalCluster
from tf_gba.distribute import make_local_mirrored_strategy
from tf_gba.optimizers import DTS
from tf_gba.optimizers import GBA
from tf_gba.optimizers import AdaptiveRevision

import logical_cpus

STEPS = 4


logical_cpus.configure(4)


def _ps_strategy(mode: str):
  def make(stack: contextlib.ExitStack):
    cluster = stack.enter_context(LocalCluster(num_ps=1, num_workers=2))
    return GBAStrategy(cluster.resolver(), mode=mode)
  return make


def _mirrored(stack: contextlib.ExitStack):
  del stack
  devices = [d.name for d in tf.config.list_logical_devices("CPU")]
  if len(devices) < 3:
    pytest.skip("needs >= 3 logical CPU devices; TensorFlow was initialised with fewer")
  # The process's one strategy over these devices (the DTS tests use it too).
  return make_local_mirrored_strategy(3)


@dataclasses.dataclass
class Case:
  name: str
  make: Callable[[], keras.optimizers.Optimizer]           # called under the strategy's scope
  strategy: Callable[[contextlib.ExitStack], tf.distribute.Strategy]
  needs: str                                               # named by the misuse error
  parameter_server: bool = True                            # fit takes a DatasetCreator
  callbacks: Callable[[keras.optimizers.Optimizer], List] = lambda opt: []


# In-process strategies first: a parameter-server case connects this process to its cluster for
# good (TensorFlow cannot disconnect), and MirroredStrategy's collectives then hang. For the same
# reason every test module runs in a process of its own (tests/module_process.py).
CASES = [
    Case("DTS", lambda: DTS(keras.optimizers.SGD(0.1, momentum=0.9), delay=2, period=2),
         _mirrored, needs="MirroredStrategy", parameter_server=False,
         callbacks=lambda opt: [opt.exchange_callback()]),
    Case("GBA", lambda: GBA(keras.optimizers.Adam(0.01), num_aggregate=2, staleness_threshold=2),
         _ps_strategy("gba"), needs="GBAStrategy"),
    Case("AdaptiveRevision", lambda: AdaptiveRevision(alpha=0.05, g0=0.5),
         _ps_strategy("async"), needs="GBAStrategy"),
]


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 4)).astype(np.float32)
  y = (x @ np.array([1.0, -2.0, 0.5, 0.0], np.float32))[:, None]
  return x, y


def _model():
  return keras.Sequential([keras.Input(shape=(4,)), keras.layers.Dense(1)])


def _fit(case: Case, model, optimizer):
  x, y = _data()
  make = lambda ctx=None: tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)
  # Each parameter-server worker builds its own pipeline.
  dataset = keras.utils.experimental.DatasetCreator(make) if case.parameter_server else make()
  return model.fit(dataset, epochs=1, steps_per_epoch=STEPS, verbose=0,
                   callbacks=case.callbacks(optimizer))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_contract(case: Case, tmp_path):
  with contextlib.ExitStack() as stack:
    strategy = case.strategy(stack)

    # get_config / from_config, and Keras serialization (which finds the registered class).
    with strategy.scope():
      probe = case.make()
      config = probe.get_config()
      clone = type(probe).from_config(config)
      serialized = keras.optimizers.serialize(probe)
      restored = keras.optimizers.deserialize(serialized)
    assert clone.get_config() == config
    assert type(restored) is type(probe) and restored.get_config() == config
    if "inner" in config:   # the wrapped optimizer goes through tf_keras' own serialization
      assert type(keras.optimizers.deserialize(config["inner"])) is type(
          keras.optimizers.deserialize(serialized["config"]["inner"]))

    # One fit under its strategy.
    with strategy.scope():
      model = _model()
      optimizer = case.make()
      model.compile(optimizer=optimizer, loss="mse")
      optimizer.build(model.trainable_variables)
    history = _fit(case, model, optimizer)
    assert np.isfinite(history.history["loss"][-1])
    assert int(optimizer.iterations.numpy()) > 0

    # Checkpoint round trip: every optimizer variable equal after the restore.
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).write(str(tmp_path / "ckpt"))
    with strategy.scope():
      model2 = _model()
      optimizer2 = case.make()
      model2.compile(optimizer=optimizer2, loss="mse")
    status = tf.train.Checkpoint(model=model2, optimizer=optimizer2).read(path)
    with strategy.scope():
      optimizer2.build(model2.trainable_variables)
    status.assert_existing_objects_matched()
    saved = [v.numpy() for v in optimizer.variables]
    loaded = [v.numpy() for v in optimizer2.variables]
    assert len(saved) == len(loaded) > 1
    for a, b in zip(saved, loaded):
      np.testing.assert_array_equal(a, b)
    for a, b in zip(model.weights, model2.weights):
      np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_misuse_under_another_strategy_raises(case: Case):
  with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
    with pytest.raises(RuntimeError, match=case.needs) as raised:
      case.make()
  message = str(raised.value)
  assert "\n" not in message and "scope" in message   # one line that says what to do
