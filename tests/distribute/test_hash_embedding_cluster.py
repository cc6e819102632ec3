"""HashEmbedding on real TF servers (LocalCluster on 127.0.0.1): sharded over the parameter
servers, trained under GBA and async (with model.fit and with a custom loop the coordinator
schedules), checkpointed, restored into 3 parameter servers and into one process with the same
rows; a plain tf_keras optimizer trains the rows GBA trains under async, and is refused under
gba."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute import GBAStrategy
from tf_gba.distribute import LocalCluster
from tf_gba.layers import HashEmbedding
from tf_gba.ops import hash_table_ops
from tf_gba.optimizers import GBA

DIM, FIELDS, BATCH, STEPS = 4, 3, 16, 6
POOL = np.arange(40, dtype=np.int64) * 1000003 - 2**40  # 40 distinct raw ids


def build():
  ids = keras.Input(shape=(FIELDS,), dtype=tf.int64)
  emb = HashEmbedding(DIM, seed=7, name="hash")
  head = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=1))
  model = keras.Model(ids, head(keras.layers.Flatten()(emb(ids))))
  return model, emb


def dataset_fn(_=None):
  ids = tf.constant(POOL)
  rng = tf.data.Dataset.random(seed=3).batch(BATCH * FIELDS)

  def to_batch(r):
    x = tf.gather(ids, tf.reshape(r % len(POOL), [BATCH, FIELDS]))
    return x, tf.cast(tf.reshape(r[:BATCH] % 7, [BATCH, 1]), tf.float32) / 7.0

  return rng.map(to_batch).repeat()


def fit(strategy):
  with strategy.scope():
    model, emb = build()
    optimizer = GBA(keras.optimizers.Adagrad(0.1))
    model.compile(optimizer, "mse")
  model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
            steps_per_epoch=STEPS, verbose=0)
  return model, emb, optimizer


def sorted_rows(table):
  rows = table.export()
  order = np.argsort(rows["keys"].numpy())
  return {f: rows[f].numpy()[order] for f in hash_table_ops.EXPORT_FIELDS}


def assert_same_rows(a, b):
  for f in hash_table_ops.EXPORT_FIELDS:
    np.testing.assert_array_equal(a[f], b[f], err_msg=f)


def test_hash_embedding_trains_checkpoints_and_reshards(tmp_path):
  prefix = str(tmp_path / "ckpt")
  with LocalCluster(num_ps=2, num_workers=2) as cluster:
    strategy = GBAStrategy(cluster.resolver(), mode="gba")
    model, emb, optimizer = fit(strategy)
    assert emb.table.num_shards == 2
    assert [s.device for s in emb.table.shards] == [
        "/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"]
    step = int(optimizer.iterations.numpy())
    # M = 2 (one batch per worker): every second push is a global step, whichever order the
    # pushes reach the two shards' buffers in.
    assert step == STEPS // 2
    for i, shard in enumerate(emb.table.shards):  # each shard holds exactly its own keys
      keys = shard.export()["keys"].numpy()
      assert len(keys) > 0 and all(hash_table_ops.mix64(int(k)) % 2 == i for k in keys)
    saved = sorted_rows(emb.table)
    assert set(saved["keys"].tolist()) <= set(POOL.tolist())
    assert saved["slots"].shape[1] == 1 and saved["tags"].max() == step - 1
    assert saved["frequency"].sum() >= STEPS  # one count per batch holding the id
    stats = optimizer.stats()["sparse"]
    assert stats["aggregations"] == 2 * step  # both shards' buffers completed every step
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).write(prefix)

  with LocalCluster(num_ps=3, num_workers=2) as cluster:
    strategy = GBAStrategy(cluster.resolver(), mode="async")
    with strategy.scope():
      model, emb = build()
      optimizer = GBA(keras.optimizers.Adagrad(0.1))
      model.compile(optimizer, "mse")
      model(POOL[:FIELDS][None])  # built: the table exists before the restore
    tf.train.Checkpoint(model=model, optimizer=optimizer).read(path).expect_partial()
    assert emb.table.num_shards == 3
    assert_same_rows(sorted_rows(emb.table), saved)
    for i, shard in enumerate(emb.table.shards):
      keys = shard.export()["keys"].numpy()
      assert all(hash_table_ops.mix64(int(k)) % 3 == i for k in keys)
    model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
              steps_per_epoch=STEPS, verbose=0)
    after = sorted_rows(emb.table)
    assert int(optimizer.iterations.numpy()) >= step + STEPS  # async: one step per gradient
    before = dict(zip(saved["keys"].tolist(), saved["values"]))
    changed = [not np.array_equal(v, before[k])
               for k, v in zip(after["keys"].tolist(), after["values"]) if k in before]
    assert any(changed)

  model, emb = build()  # one process: one shard
  model.compile(GBA(keras.optimizers.Adagrad(0.1)), "mse")
  model(POOL[:FIELDS][None])
  tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(path).expect_partial()
  assert emb.table.num_shards == 1
  assert_same_rows(sorted_rows(emb.table), saved)


def test_a_custom_loop_scheduled_on_the_workers_trains_the_table():
  """ClusterCoordinator.schedule with strategy.run: the table's rows are found or inserted on
  their parameter servers from the workers' steps, and GBA counts a global step per M pushes."""
  with LocalCluster(num_ps=2, num_workers=2) as cluster:
    strategy = GBAStrategy(cluster.resolver(), mode="gba")
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
      model, emb = build()
      optimizer = GBA(keras.optimizers.Adagrad(0.1))
      model(POOL[:FIELDS][None])
    iterator = iter(coordinator.create_per_worker_dataset(lambda: dataset_fn()))

    step = _loop_step(strategy, model, optimizer)
    losses = [coordinator.schedule(step, args=(iterator,)) for _ in range(STEPS)]
    coordinator.join()
    assert all(np.isfinite(l.fetch()) for l in losses)
    assert int(optimizer.iterations.numpy()) == STEPS // 2  # M = 2
    rows = sorted_rows(emb.table)
    assert len(rows["keys"]) > 0 and set(rows["keys"].tolist()) <= set(POOL.tolist())
    assert rows["frequency"].sum() >= STEPS and rows["tags"].max() == STEPS // 2 - 1
    for i, shard in enumerate(emb.table.shards):
      assert all(hash_table_ops.mix64(int(k)) % 2 == i for k in shard.export()["keys"].numpy())


def _loop_step(strategy, model, optimizer):
  @tf.function
  def step(it):
    def replica_fn(batch):
      ids, labels = batch
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(ids, training=True) - labels))
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss
    return strategy.run(replica_fn, args=(next(it),))
  return step


def test_plain_optimizers_train_the_rows_gba_trains_under_async_and_are_refused_under_gba():
  """A plain tf_keras optimizer under GBAStrategy, on one worker, whose steps run one after
  another (no staleness). mode="async": a plain Adam through fit and a plain Adagrad through a
  custom loop end with the rows (values, slots, counts) and dense weights that GBA(the same
  optimizer) ends with; RMSprop is refused in one line. mode="gba" (a second strategy on the same
  servers): a plain Adam is refused in one line, in fit and in a custom loop. Every refusal comes
  while the step is traced on the coordinator: no step reaches a worker (the table stays
  empty)."""
  with LocalCluster(num_ps=2, num_workers=1) as cluster:
    strategy = GBAStrategy(cluster.resolver(), mode="async")
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)

    def trained(make, loop):
      with strategy.scope():
        model, emb = build()
        optimizer = make()
        model.compile(optimizer, "mse")
      if loop:
        iterator = iter(coordinator.create_per_worker_dataset(lambda: dataset_fn()))
        step = _loop_step(strategy, model, optimizer)
        for _ in range(STEPS):
          coordinator.schedule(step, args=(iterator,))
        coordinator.join()
      else:
        model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
                  steps_per_epoch=STEPS, verbose=0)
      assert int(optimizer.iterations.numpy()) == STEPS  # one step per gradient
      return sorted_rows(emb.table), model.get_weights()

    for make, loop in ((lambda: keras.optimizers.Adam(0.05), False),
                       (lambda: keras.optimizers.Adagrad(0.2), True)):
      plain, plain_weights = trained(make, loop)
      wrapped, wrapped_weights = trained(lambda: GBA(make()), loop)
      np.testing.assert_array_equal(plain["keys"], wrapped["keys"])
      assert len(plain["keys"]) > 0 and plain["slots"].shape[1] in (1, 2)
      for f in ("values", "slots"):
        np.testing.assert_allclose(plain[f], wrapped[f], rtol=1e-6, atol=1e-6, err_msg=f)
      for f in ("frequency", "last_seen"):
        np.testing.assert_array_equal(plain[f], wrapped[f], err_msg=f)
      for a, b in zip(plain_weights, wrapped_weights):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
      # The rows moved from their initial values (a fresh table of the same seed finds those).
      with strategy.scope():
        _, fresh = build()
      initial = fresh.table.find(tf.constant(plain["keys"])).numpy()
      assert np.abs(plain["values"] - initial).max() > 1e-3

    def refused(strategy, make, loop, says):
      with strategy.scope():
        model, emb = build()
        optimizer = make()
        model.compile(optimizer, "mse")
      with pytest.raises(ValueError) as raised:
        if loop:
          coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
          iterator = iter(coordinator.create_per_worker_dataset(lambda: dataset_fn()))
          coordinator.schedule(_loop_step(strategy, model, optimizer), args=(iterator,))
        else:
          model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
                    steps_per_epoch=STEPS, verbose=0)
      message = str(raised.value)
      assert says in message and "\n" not in message, message
      assert emb.table.size() == 0 and int(optimizer.iterations.numpy()) == 0

    refused(strategy, lambda: keras.optimizers.RMSprop(0.1), False,
            "RMSprop is none of them: use tf_keras.optimizers.SGD")
    gba = GBAStrategy(cluster.resolver(), mode="gba")
    for loop in (False, True):
      refused(gba, lambda: keras.optimizers.Adam(0.05), loop,
              "GBAStrategy(mode='gba') aggregates gradients in buffers on the parameter servers, "
              "but Adam would apply every gradient on arrival (plain async): wrap it, "
              "tf_gba.optimizers.GBA(Adam(...)), or use mode=\"async\".")
