"""The shared data list on real TF servers: exactly once per day, a slow worker takes fewer batches.

A day of distinct example ids is trained in GBA mode by 3 workers on 127.0.0.1, worker 0 4x slower
(a 200 ms compute floor, then x4: well above the ~50 ms a step spends in dispatch on a
loaded machine, so the 4x shows in the batch counts). What reached the train step is recorded by the model itself (a
parameter-server counter of the ids of each batch it trained on), independently of the data
list's own counters, and compared with the day's ids in NumPy.
"""

import math
import types

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba.data import data_list as data_list_lib
from tf_gba.data import pipeline
from tf_gba.distribute import LocalCluster
from tf_gba.ops import worker_clock
from tf_gba.optimizers import GBA
from tf_gba.training import runner
from tf_gba.training import shared_input
from tf_gba.training.config import TrainConfig

WORKERS, BATCH, ROWS = 3, 16, 16 * 100 + 5   # 101 batches, the last one partial
LOG_EVERY = 100
STRAGGLERS = "compute:200+persistent:4@0"


class _IdModel(keras.Model):
  """Logistic regression on an id embedding; counts, on the PS, every id it trains on."""

  def __init__(self, num_ids):
    super().__init__()
    self.embed = keras.layers.Embedding(num_ids, 1)
    self.hits = tf.Variable(tf.zeros([num_ids], tf.int32), trainable=False)

  def call(self, features):
    return tf.sigmoid(tf.squeeze(self.embed(features["id"]), -1))

  def train_step(self, data):
    features, labels = data
    ids = features["id"]
    with tf.GradientTape() as tape:
      loss = self.compiled_loss(labels, self(features, training=True))
    self.optimizer.apply_gradients(
        zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
    with tf.control_dependencies([loss]):
      self.hits.scatter_add(tf.IndexedSlices(tf.ones_like(ids, tf.int32), ids))
    return {"loss": loss}


def _rows(rows=ROWS):
  ids = np.arange(rows, dtype=np.int64)
  return {"id": ids}, (ids % 2).astype(np.float32)


def _setup(tmp_path, cluster, input_mode, rows=ROWS, steps_per_execution=1, **config):
  """GBA on the id model, `steps_per_execution` worker steps per scheduled function; `config`
  overrides TrainConfig fields (default steps: one pass of the shared list, two passes of the
  static shards). `mode="async"`: a plain Adam."""
  fields = dict(mode="gba", num_workers=WORKERS, local_batch_size=BATCH, log_every=LOG_EVERY,
                stragglers=STRAGGLERS, input=input_mode, model_dir=str(tmp_path),
                steps=None if input_mode == "shared" else 2 * math.ceil(rows / BATCH))
  fields.update(config)
  cfg = TrainConfig(**fields)
  strategy = runner.make_strategy(cfg, cluster.resolver())
  with strategy.scope():
    model = _IdModel(rows)
    optimizer = keras.optimizers.Adam(0.01)
    if cfg.mode == "gba":
      optimizer = GBA(optimizer, num_aggregate=WORKERS)
    model.compile(optimizer, loss=keras.losses.BinaryCrossentropy(),
                  steps_per_execution=steps_per_execution)
    model(_rows(rows)[0])  # builds the variables (what fit would do lazily)
    optimizer.build(model.trainable_variables)
  return cfg, strategy, model, optimizer


def test_each_batch_of_the_day_is_trained_once_and_the_slow_worker_takes_fewer(tmp_path):
  """Four steps per scheduled function: at the end of the day a function's later reads find the
  list empty after its first ones trained, and each is counted as what it was."""
  with LocalCluster(num_ps=1, num_workers=WORKERS, num_tfdata_workers=2) as cluster:
    cfg, strategy, model, optimizer = _setup(tmp_path, cluster, "shared", steps_per_execution=4)
    shared = shared_input.SharedInput(cfg, strategy, cluster.tfdata_dispatcher, {},
                                      rows=_rows())
    shared.install_train_function(model)
    runner.fit_shared(model, optimizer, shared, math.ceil(shared.max_steps / cfg.log_every))
    hits = model.hits.numpy()
    report = shared.report()
    global_step = int(optimizer.iterations.numpy())
    tokens = int(optimizer._token_source().count().numpy())  # pylint: disable=protected-access

  # The multiset of ids that reached the train step is the day's ids, each once.
  np.testing.assert_array_equal(hits, np.ones(ROWS, np.int32))
  # The list's own counts (batch ids carried with the batches) agree.
  nb = math.ceil(ROWS / BATCH)
  assert report["duplicates"] == 0 and report["missed"] == 0, report
  assert report["batches"] == nb and report["examples"] == ROWS, report
  assert report["exhausted"] == [1] * WORKERS
  # Worker 0, 4x slower, took at most 0.4x the batches of the median other worker.
  batches = report["per_worker_batches"]
  print(f"shared list: per-worker batches {batches}")
  assert batches[0] <= 0.4 * np.median(batches[1:]), batches
  # The last partial global step was completed: nb pushes + zeros fill whole steps of M.
  assert report["flushed_zero_gradients"] == (-nb) % WORKERS
  assert global_step == math.ceil(nb / WORKERS)
  assert tokens == global_step * WORKERS


def test_a_fixed_step_count_trains_a_batch_in_every_step(tmp_path):
  """As many steps as the day has batches: each step trains one, none finds the list empty.

  While a worker is held up (a 100 ms compute floor, a transient 4x delay after the push), its
  service client fetches the next batch; were the list only as long as the steps, the last steps
  would read it empty while batches taken ahead went untrained (and a GBA global step would be
  left partial: 46 and 47 of 48 batches trained, measured). Five steps per scheduled function in
  intervals of 12: each interval's last function runs the 2 steps left, so the count is exact.
  """
  rows = 16 * 48
  steps = rows // BATCH                      # 48 batches, 16 global steps of M = 3
  with LocalCluster(num_ps=1, num_workers=WORKERS, num_tfdata_workers=2) as cluster:
    cfg, strategy, model, optimizer = _setup(
        tmp_path, cluster, "shared", rows=rows, steps=steps, log_every=12,
        stragglers="compute:100+transient:0.2:4", steps_per_execution=5)
    shared = shared_input.SharedInput(cfg, strategy, cluster.tfdata_dispatcher, {},
                                      rows=_rows(rows))
    shared.install_train_function(model)
    runner.fit_shared(model, optimizer, shared, steps // cfg.log_every)
    hits = model.hits.numpy()
    report = shared.report()
    global_step = int(optimizer.iterations.numpy())
    # Keras' steps-per-execution counter, read for each function scheduled, lives in this
    # process (GBAStrategy creates it here: no round trip to a parameter server), and has its
    # value back after each interval's shorter last function.
    spe = model._steps_per_execution  # pylint: disable=protected-access
    assert "/job:ps/" not in spe.device and int(spe.numpy()) == 5, spe.device

  # What the model itself counted: `steps` whole batches of rows.
  assert hits.sum() == steps * BATCH, (hits.sum(), report)
  assert report["batches"] == steps and report["examples"] == steps * BATCH, report
  assert global_step == steps // WORKERS


def test_static_shards_over_represent_the_fast_workers_rows(tmp_path):
  """The contrast: the same day and stragglers with each worker repeating its own shard.

  In as many steps as the day has batches, worker 0's shard is read in part while the fast
  workers go round theirs again: rows are missed and others trained twice.
  """
  nb = math.ceil(ROWS / BATCH)
  with LocalCluster(num_ps=1, num_workers=WORKERS) as cluster:
    cfg, strategy, model, _ = _setup(tmp_path, cluster, "sharded")
    features, labels = _rows()
    info = type("Info", (), {"categorical": ("id",), "numeric": ()})()

    def dataset_fn(ctx):
      del ctx
      return pipeline.from_arrays(info, features, labels, batch_size=BATCH,
                                  num_shards=WORKERS, shard_index=worker_clock.worker_index(),
                                  repeat=True, shuffle_seed=0)

    model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
              steps_per_epoch=nb, verbose=0)
    hits = model.hits.numpy()
  print(f"static shards: {(hits == 0).sum()} of {ROWS} rows missed, {(hits > 1).sum()} trained "
        "more than once")
  assert (hits == 0).sum() > 0, "some rows of the slow worker's shard never trained"
  assert (hits > 1).sum() > 0, "some rows of the fast workers' shards trained twice"


def test_data_list_batches_partition_the_rows_in_a_seeded_order():
  features, labels = _rows()
  dl = data_list_lib.DataList(features, labels, BATCH, seed=3, passes=2)
  nb = math.ceil(ROWS / BATCH)
  assert dl.num_batches == nb
  rows = np.concatenate([dl.rows_of(b) for b in range(nb)])
  np.testing.assert_array_equal(np.sort(rows), np.arange(ROWS))
  assert dl.batch_sizes().sum() == ROWS and dl.batch_sizes()[-1] == ROWS - BATCH * (nb - 1)
  # Each pass lists every batch once, in its own order.
  order = dl.batch_order.reshape(2, nb)
  for p in range(2):
    np.testing.assert_array_equal(np.sort(order[p]), np.arange(nb))
  assert not np.array_equal(order[0], order[1])
  # Same seed, same list.
  again = data_list_lib.DataList(features, labels, BATCH, seed=3, passes=2)
  np.testing.assert_array_equal(again.batch_order, dl.batch_order)
  np.testing.assert_array_equal(again.row_order, dl.row_order)


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_size=0), "batch_size"), (dict(passes=0), "passes")])
def test_data_list_rejects_bad_arguments(kwargs, message):
  features, labels = _rows()
  args = dict(batch_size=BATCH, seed=0, passes=1)
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    data_list_lib.DataList(features, labels, **args)


def test_config_input_and_steps():
  assert TrainConfig().steps is None                       # shared: one pass over the day
  assert TrainConfig(input="sharded").steps == 2000        # the original default
  assert TrainConfig(mode="sync").steps == 2000
  with pytest.raises(ValueError, match="--input"):
    TrainConfig(input="files").validate()


# A killed tf.data worker is drilled through the binary: tests/test_fault_drills.py.


@pytest.mark.parametrize("mode", ["gba", "async"])
def test_a_function_run_again_skips_the_steps_its_first_run_finished(tmp_path, mode):
  """ParameterServerStrategy runs a function again, with the same arguments, when its worker
  fails. The ledger on the parameter server says how many of the function's steps are done: set
  here as a failed run would have left it (function 0: 3 of its 4 steps trained; function 1:
  all 4), the functions scheduled train only the steps left, each reading, pushing and counting
  one batch; function 2, never run before, trains all 4. Each step's mark rides with GBA's
  gradients; with a plain optimizer (async) it is sent on its own."""
  rows = 16 * 48
  with LocalCluster(num_ps=1, num_workers=WORKERS, num_tfdata_workers=1) as cluster:
    cfg, strategy, model, optimizer = _setup(tmp_path, cluster, "shared", rows=rows, steps=24,
                                             stragglers="none", steps_per_execution=4,
                                             mode=mode)
    shared = shared_input.SharedInput(cfg, strategy, cluster.tfdata_dispatcher, {},
                                      rows=_rows(rows))
    shared.install_train_function(model)
    train = model.make_train_function()
    iterator = iter(shared.coordinator.create_per_worker_dataset(shared.dataset_fn))
    shared.ledger.mark(0, 3)
    shared.ledger.mark(1, 4)
    for _ in range(3):
      train(iterator)
    shared.coordinator.join()
    hits = model.hits.numpy()
    report = shared.report()
    tokens = (int(optimizer._token_source().count().numpy())  # pylint: disable=protected-access
              if mode == "gba" else int(optimizer.iterations.numpy()))
    done = [shared.ledger.read(n) for n in range(4)]

  trained = (4 - 3) + (4 - 4) + 4
  assert hits.sum() == trained * BATCH, hits.sum()
  assert report["batches"] == trained and report["examples"] == trained * BATCH, report
  assert report["duplicates"] == 0, report
  assert tokens == trained
  # Each function's every step is recorded as done; number 3 was never scheduled.
  assert done == [4, 4, 4, -1], done


def test_the_stall_limit_waits_for_the_first_step_at_least_the_default():
  # The first step registers functions and opens readers on every worker: a short
  # --stall_timeout_s holds only once a step has finished.
  assert shared_input.stall_limit(15.0, trained=False) == shared_input.DEFAULT_STALL_TIMEOUT_S
  assert shared_input.stall_limit(15.0, trained=True) == 15.0
  assert shared_input.stall_limit(300.0, trained=False) == 300.0


def test_a_restarted_workers_counts_carry_over_its_restart():
  """A worker killed and started again counts from zero (its per-worker variables are created
  afresh): what it had counted at the last read stays credited to it."""
  var = types.SimpleNamespace(values=[])
  # Each worker's value as read_each returns it (read from the workers in the cluster tests).
  counters = types.SimpleNamespace(read_each=lambda v: list(v.values), _last={}, _base={},
                                   _variables={})
  read = lambda: data_list_lib.DayCounters.read_counts(counters, var)  # noqa: E731
  var.values = [np.array([1, 1, 0]), np.array([0, 1, 1])]
  assert [v.tolist() for v in read()] == [[1, 1, 0], [0, 1, 1]]
  var.values = [np.array([0, 0, 1]), np.array([1, 1, 1])]  # worker 0 restarted
  assert [v.tolist() for v in read()] == [[1, 1, 1], [1, 1, 1]]
  var.values = [np.array([1, 0, 1]), np.array([1, 1, 1])]
  assert [v.tolist() for v in read()] == [[2, 1, 1], [1, 1, 1]]


def test_a_restart_is_told_by_the_variable_created_afresh_not_by_its_value_alone():
  """The short chaos drill: worker 0 killed, started again and then unreadable for 8 s (its link
  stalled); by the next read its new process had counted past the old one's, so its value did not
  go down, and the old process's 100 batches went uncounted."""

  class Remote:  # a per-worker variable's copy as the coordinator holds it
    def __init__(self):
      self.variable = object()

    def _get_values(self):
      return self.variable

  remotes = [Remote(), Remote()]
  var = types.SimpleNamespace(values=[], _per_worker_vars=types.SimpleNamespace(_values=remotes))
  counters = types.SimpleNamespace(read_each=lambda v: list(v.values), _last={}, _base={},
                                   _variables={})
  read = lambda: data_list_lib.DayCounters.read_counts(counters, var)  # noqa: E731
  var.values = [np.array([3, 2]), np.array([1, 1])]
  assert [v.tolist() for v in read()] == [[3, 2], [1, 1]]
  remotes[0].variable = object()  # worker 0 restarted: its variable created again
  var.values = [np.array([4, 5]), np.array([2, 1])]  # higher than before, all of it new
  assert [v.tolist() for v in read()] == [[7, 7], [2, 1]]
  var.values = [np.array([5, 5]), np.array([2, 2])]  # the same variable: no restart
  assert [v.tolist() for v in read()] == [[8, 7], [2, 2]]
