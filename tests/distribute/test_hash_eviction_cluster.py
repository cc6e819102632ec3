"""HashEmbedding admission and eviction on real TF servers (LocalCluster on 127.0.0.1): the
parameter servers evict every `eviction_interval` global steps within the GBA step, and each
shard's counters add up."""

import numpy as np
import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute import GBAStrategy
from tf_gba.distribute import LocalCluster
from tf_gba.layers import HashEmbedding
from tf_gba.ops import hash_table_ops
from tf_gba.optimizers import GBA

DIM, FIELDS, BATCH, STEPS, MAX_ROWS, INTERVAL = 4, 3, 8, 8, 10, 2
POOL = np.arange(60, dtype=np.int64) * 1000003 - 2**40


def dataset_fn(_=None):
  ids = tf.constant(POOL)
  # Unseeded, so that each worker's pipeline draws its own ids. With one seed both workers would
  # read the same batches, and the second worker's lookup of a batch would admit its ids before
  # the first worker's gradient reached the servers whenever the two ran close together: no
  # gradient row would then be filtered. With distinct draws, the first two batches alone hold
  # ids that one lookup saw once when their gradients are applied.
  rng = tf.data.Dataset.random().batch(BATCH * FIELDS)

  def to_batch(r):
    x = tf.gather(ids, tf.reshape(r % len(POOL), [BATCH, FIELDS]))
    return x, tf.cast(tf.reshape(r[:BATCH] % 7, [BATCH, 1]), tf.float32) / 7.0

  return rng.map(to_batch).repeat()


def test_servers_admit_and_evict_and_counters_add_up():
  with LocalCluster(num_ps=2, num_workers=2) as cluster:
    strategy = GBAStrategy(cluster.resolver(), mode="gba")
    with strategy.scope():
      ids = keras.Input(shape=(FIELDS,), dtype=tf.int64)
      emb = HashEmbedding(DIM, seed=7, min_frequency=2, max_rows=MAX_ROWS,
                          eviction_interval=INTERVAL, name="hash")
      model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids))))
      optimizer = GBA(keras.optimizers.Adagrad(0.1))
      model.compile(optimizer, "mse")
    model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
              steps_per_epoch=STEPS, verbose=0)
    steps = int(optimizer.iterations.numpy())
    assert steps == STEPS // 2  # M = 2
    budgets = [MAX_ROWS // 2, MAX_ROWS // 2]
    for i, (shard, budget) in enumerate(zip(emb.table.shards, budgets)):
      assert shard.device.startswith(f"/job:ps/replica:0/task:{i}")
      c = dict(zip(hash_table_ops.COUNTER_FIELDS, shard.counters().numpy().tolist()))
      rows = shard.export()
      keys = rows["keys"].numpy()
      # The last global step's aggregation (a multiple of INTERVAL) came after every lookup and
      # evicted down to the shard's budget.
      assert c["rows"] == len(keys) <= budget
      assert c["rows"] == c["admitted"] - c["evicted"]
      assert c["evicted"] > 0 and c["filtered"] > 0
      assert c["pending"] == len(rows["pending_keys"].numpy())
      assert all(hash_table_ops.mix64(int(k)) % 2 == i for k in keys)
      # Admitted rows counted at least min_frequency lookups; pending keys fewer.
      assert (rows["frequency"].numpy() >= 2).all()
      assert (rows["pending_counts"].numpy() == 1).all()
    total = emb.table.counters()
    assert total["rows"] == emb.table.size() <= MAX_ROWS
