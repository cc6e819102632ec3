"""Epoch ends that let the workers run on (`tf_gba.training.pipelining`), on real TF servers.

Two GBA workers on 127.0.0.1, worker 0 8x slower (a 100 ms compute floor, then x8): at an epoch's
end its step is usually still running. With Keras's own join every epoch end would wait for it;
here the callbacks run while it does, the fast worker keeps taking steps, and a checkpoint-style
`settle()` and the end of `fit` still see every scheduled step finished. A step's error still
ends `fit` with that error.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute import LocalCluster
from tf_gba.optimizers import GBA
from tf_gba.training import pipelining
from tf_gba.training import runner
from tf_gba.training.config import TrainConfig

WORKERS, STEPS_PER_EPOCH, EPOCHS = 2, 10, 4


class _Model(keras.Model):
  """Logistic regression; its train step fails once the PS counter of steps reaches `fail_at`."""

  def __init__(self, fail_at=0):
    super().__init__()
    self.dense = keras.layers.Dense(1)
    self.fail_at = fail_at
    self.trained = tf.Variable(0, dtype=tf.int64, trainable=False)

  def call(self, x):
    return tf.sigmoid(self.dense(x))

  def train_step(self, data):
    x, y = data
    with tf.GradientTape() as tape:
      loss = self.compiled_loss(y, self(x, training=True))
    self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables),
                                       self.trainable_variables))
    n = self.trained.assign_add(1)
    if self.fail_at:
      tf.debugging.assert_less(n, tf.constant(self.fail_at, tf.int64), message="planted failure")
    return {"loss": loss}


def _dataset_fn(ctx):
  del ctx
  x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices((x, (x[:, 0] > 0).astype(np.float32))).repeat().batch(8)


def _setup(cluster, tmp_path, fail_at=0):
  cfg = TrainConfig(mode="gba", num_workers=WORKERS, input="sharded", model_dir=str(tmp_path),
                    stragglers="compute:100+persistent:8@0")
  strategy = runner.make_strategy(cfg, cluster.resolver())
  with strategy.scope():
    model = _Model(fail_at)
    optimizer = GBA(keras.optimizers.SGD(0.1), num_aggregate=WORKERS)
    # One step per scheduled function: the bounds below count steps at the epochs' ends.
    model.compile(optimizer, loss=keras.losses.BinaryCrossentropy(), steps_per_execution=1)
    model(tf.zeros([1, 4]))
    optimizer.build(model.trainable_variables)
  return strategy, model


class _AtEpochEnd(keras.callbacks.Callback):
  """Per epoch end: steps scheduled, steps finished (the workers' own counters), and the same
  after `settle()` where asked."""

  def __init__(self, strategy, settle_at=()):
    super().__init__()
    self.strategy, self.settle_at = strategy, settle_at
    self.pipeline = None
    self.seen = []

  def _finished(self):
    return sum(w["steps"] for w in self.strategy.worker_step_stats())

  def on_epoch_end(self, epoch, logs=None):
    if epoch == 0:
      self.strategy.function_seconds()  # from here on: the first functions' set-up is left out
    scheduled = (epoch + 1) * STEPS_PER_EPOCH
    row = {"scheduled": scheduled, "finished": self._finished(), "loss": logs["loss"]}
    if epoch in self.settle_at:
      self.pipeline.settle()
      row["settled"] = self._finished()
    self.seen.append(row)


def _fit(pipeline, model, callbacks=()):
  with pipeline:
    model.fit(keras.utils.experimental.DatasetCreator(_dataset_fn), epochs=EPOCHS,
              steps_per_epoch=STEPS_PER_EPOCH, verbose=0, callbacks=list(callbacks))
    pipeline.settle()


def test_epoch_ends_leave_the_slow_step_running_and_settle_waits_for_it(tmp_path):
  with LocalCluster(num_ps=1, num_workers=WORKERS) as cluster:
    strategy, model = _setup(cluster, tmp_path)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    original_join = coordinator.join
    recorder = _AtEpochEnd(strategy, settle_at=(1,))
    recorder.pipeline = pipelining.Pipeline(model, coordinator, spare=WORKERS)
    _fit(recorder.pipeline, model, [recorder])
    per_worker = [w["steps"] for w in strategy.worker_step_stats()]
    functions = strategy.function_seconds()
    trained = int(model.trained.numpy())
    restored_join = coordinator.join
  print(recorder.seen, per_worker, functions)
  # The coordinator timed each worker's functions: the slow worker's one-step functions take
  # at least its 800 ms step (100 ms compute floor x 8), longer than any of the fast worker's.
  assert len(functions) == WORKERS and functions[0] >= 0.8 > functions[1] > 0, functions
  # The coordinator's own join is back after fit.
  assert restored_join == original_join
  # At epoch ends without a settle the slow worker's step was still running at least once, and
  # never more than one step per worker plus the spare ones (one per worker) were unfinished.
  unsettled = [r for i, r in enumerate(recorder.seen) if i != 1]
  assert any(r["finished"] < r["scheduled"] for r in unsettled), recorder.seen
  assert all(r["scheduled"] - r["finished"] <= 2 * WORKERS for r in recorder.seen), recorder.seen
  # settle() (what a checkpoint calls) waits for every step scheduled so far.
  assert recorder.seen[1]["settled"] == 2 * STEPS_PER_EPOCH
  # fit returns with every step finished and trained once.
  assert sum(per_worker) == trained == EPOCHS * STEPS_PER_EPOCH
  # The fast worker took the steps the slow one could not.
  assert per_worker[1] > 2 * per_worker[0], per_worker
  assert all(np.isfinite(r["loss"]) for r in recorder.seen)


def test_a_steps_error_ends_fit_with_that_error(tmp_path):
  with LocalCluster(num_ps=1, num_workers=WORKERS) as cluster:
    strategy, model = _setup(cluster, tmp_path, fail_at=15)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with pytest.raises(tf.errors.InvalidArgumentError, match="planted failure"):
      _fit(pipelining.Pipeline(model, coordinator, spare=WORKERS), model)


class _Value(pipelining.RemoteValue):
  """A stand-in for a scheduled step's result: `_status` as the coordinator's RemoteValueImpl."""

  def __init__(self, name, ready):  # pylint: disable=super-init-not-called
    self.name = name
    self._status = type("Status", (), {"name": "READY" if ready else "NOT_READY"})()

  def fetch(self):
    return self.name

  def get(self):
    return self.name


def test_the_result_fetched_at_an_epoch_end_is_the_newest_finished_step():
  pipeline = pipelining.Pipeline(model=None, coordinator=None, spare=2)
  values = [_Value("a", True), _Value("b", True), _Value("c", False), _Value("d", False)]
  proxies = [pipeline.track(v) for v in values]
  # Whichever step Keras kept (the last one scheduled, still running), it fetches "b".
  assert proxies[-1].fetch() == "b" and proxies[0].fetch() == "b"
  values[3]._status.name = "READY"  # pylint: disable=protected-access
  assert proxies[-1].fetch() == "d"
  # Nothing finished yet: the step itself (a wait for it).
  empty = pipelining.Pipeline(model=None, coordinator=None, spare=2)
  assert empty.track(_Value("x", False)).fetch() == "x"
