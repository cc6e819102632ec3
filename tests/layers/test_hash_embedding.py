"""HashEmbedding in one process: the same training as a partitioned Keras Embedding, its lookups,
checkpoints and errors.

The partitioned model is the reference: with no collisions and SGD or Adagrad, Keras' sparse
update of a row and the hash table's fused update of that row are the same formula (SPEC section
6), so both models, started from the same rows and trained on the same batches, must end with the
same rows. The per-row formulas themselves are checked against NumPy in
tests/ops/test_hash_table_ops.py.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba.layers import HashEmbedding
from tf_gba.ops import hash_table_ops
from tf_gba.optimizers import GBA

DIM, FIELDS, BATCH = 4, 3, 8
IDS = np.array([5, 10**12, -7, 2**40 + 3, 0, 99, 123456, 77])  # distinct raw ids


def _batches(seed=0, steps=6):
  rng = np.random.default_rng(seed)
  pos = rng.integers(0, len(IDS), size=(steps, BATCH, FIELDS))
  y = rng.normal(size=(steps, BATCH, 1)).astype(np.float32)
  return pos, y


def _head(name):
  return keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(
      1, kernel_initializer=keras.initializers.GlorotUniform(seed=1), name=name)])


def hash_model(**kwargs):
  ids = keras.Input(shape=(FIELDS,), dtype=tf.int64)
  emb = HashEmbedding(DIM, seed=3, name="hash", **kwargs)
  return keras.Model(ids, _head("dense")(emb(ids))), emb


def vocab_model():
  pos = keras.Input(shape=(FIELDS,), dtype=tf.int64)
  emb = keras.layers.Embedding(len(IDS), DIM, name="vocab")
  return keras.Model(pos, _head("dense")(emb(pos))), emb


@pytest.mark.parametrize("wrap", [GBA, lambda inner: inner], ids=["GBA", "plain"])
@pytest.mark.parametrize("make_inner", [lambda: keras.optimizers.SGD(0.3),
                                        lambda: keras.optimizers.Adagrad(0.2)],
                         ids=["SGD", "Adagrad"])
def test_same_rows_as_a_partitioned_embedding(make_inner, wrap):
  hmodel, hemb = hash_model()
  vmodel, vemb = vocab_model()
  # The same starting rows: the vocabulary model gets the hash table's initial rows.
  vemb.set_weights([hemb.table.find(tf.constant(IDS, tf.int64)).numpy()])
  assert hemb.table.size() == 0  # find inserts nothing
  vmodel.layers[-1].set_weights(hmodel.layers[-1].get_weights())
  # GBA: M = 1 outside a strategy, every gradient applied. Plain: the table applies the rows.
  hmodel.compile(wrap(make_inner()), "mse")
  vmodel.compile(make_inner(), "mse")
  pos, y = _batches()
  for p, t in zip(pos, y):
    hmodel.train_on_batch(IDS[p], t)
    vmodel.train_on_batch(p, t)
  rows = hemb.table.export()
  by_key = dict(zip(rows["keys"].numpy().tolist(), rows["values"].numpy()))
  seen = sorted(set(pos.ravel().tolist()))
  assert sorted(by_key) == sorted(int(IDS[i]) for i in seen)
  want = vemb.get_weights()[0]
  for i in seen:
    np.testing.assert_allclose(by_key[int(IDS[i])], want[i], rtol=1e-6, atol=1e-6)
  for a, b in zip(hmodel.layers[-1].get_weights(), vmodel.layers[-1].get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  counts = np.array([sum(int(i) in set(p.ravel().tolist()) for p in pos) for i in seen])
  got_freq = dict(zip(rows["keys"].numpy().tolist(), rows["frequency"].numpy().tolist()))
  assert [got_freq[int(IDS[i])] for i in seen] == counts.tolist()  # batches holding the id


def test_custom_loop_with_strings_and_eval_lookup_inserts_nothing():
  layer = HashEmbedding(DIM, seed=1)
  words = tf.constant([["a", "b"], ["b", "zzz"]])
  optimizer = GBA(keras.optimizers.SGD(1.0))
  with tf.GradientTape() as tape:
    out = layer(words, training=True)
    loss = tf.reduce_sum(out)
  grads = tape.gradient(loss, layer.trainable_variables)
  optimizer.apply_gradients(zip(grads, layer.trainable_variables))
  assert out.shape == (2, 2, DIM)
  keys = hash_table_ops.string_keys(tf.constant(["a", "b", "zzz"])).numpy()
  rows = layer.table.export()
  got = dict(zip(rows["keys"].numpy().tolist(), rows["values"].numpy()))
  init = layer.table.find(tf.constant([12345], tf.int64))  # unrelated key, for the shape only
  assert init.shape == (1, DIM)
  # SGD lr 1 on d(sum)/d(row) = number of occurrences: "b" appears twice.
  first = {k: v for k, v in zip(keys.tolist(), out.numpy().reshape(-1, DIM)[[0, 1, 3]])}
  for k, n in zip(keys.tolist(), [1, 2, 1]):
    np.testing.assert_allclose(got[k], first[k] - n, rtol=1e-6)
  size = layer.table.size()
  layer(tf.constant([["never seen"]]), training=False)
  assert layer.table.size() == size


def test_bad_inputs_get_one_line():
  layer = HashEmbedding(DIM)
  with pytest.raises(TypeError, match="must be integers .* got float32"):
    layer(tf.constant([1.0, 2.0]))
  with pytest.raises(TypeError, match="RaggedTensor"):
    layer(tf.ragged.constant([[1], [2, 3]], tf.int64))
  with pytest.raises(ValueError, match="are a scalar"):
    layer(tf.constant(3, tf.int64))
  with pytest.raises(ValueError, match="output_dim"):
    HashEmbedding(0)
  with pytest.raises(ValueError, match="embeddings_initializer"):
    HashEmbedding(4, embeddings_initializer="glorot_uniform")
  with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
    with pytest.raises(ValueError, match="cannot live under OneDeviceStrategy"):
      HashEmbedding(DIM)(tf.constant([1], tf.int64))


def test_one_replica_mirrored_strategy_trains_rows_in_this_process():
  """Under an all-reduce strategy the table is this process's (one replica per process):
  a training step inside strategy.run counts each id once and applies the summed rows' gradient
  (SGD here: row -= lr * sum of the id's gradients; the NumPy reference below)."""
  from tf_gba.optimizers import hash_rows  # pylint: disable=g-import-not-at-top

  strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
  ids = tf.constant([[5, 9], [5, 2**50]], tf.int64)
  c = np.arange(1, DIM + 1, dtype=np.float32)
  with strategy.scope():
    layer = HashEmbedding(DIM, seed=3)
    optimizer = keras.optimizers.SGD(0.5)
    layer.build(ids.shape)
  assert [s.device for s in layer.table.shards] == ["/device:CPU:0"]
  before = layer.table.find(tf.constant([5, 9, 2**50], tf.int64)).numpy()

  @tf.function
  def step():
    def replica_fn():
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids, training=True) * c)
      grads = tape.gradient(loss, [layer.hash_anchor])
      return hash_rows.apply_replicated(optimizer, zip(grads, [layer.hash_anchor]))
    strategy.run(replica_fn)

  step()
  exported = layer.table.export()
  order = np.argsort(exported["keys"].numpy())
  rows = {f: exported[f].numpy()[order] for f in ("keys", "values", "frequency")}
  np.testing.assert_array_equal(rows["keys"], [5, 9, 2**50])
  np.testing.assert_array_equal(rows["frequency"], [1, 1, 1])
  np.testing.assert_allclose(rows["values"], before - 0.5 * np.outer([2, 1, 1], c), rtol=1e-6)


def test_optimizers_the_table_cannot_apply_are_refused():
  model, _ = hash_model()
  model.compile(GBA(keras.optimizers.SGD(0.1, momentum=0.9)), "mse")
  pos, y = _batches()
  with pytest.raises(ValueError, match="plain SGD"):
    model.train_on_batch(IDS[pos[0]], y[0])


def _sorted_rows(table):
  rows = table.export()
  order = np.argsort(rows["keys"].numpy())
  return {f: rows[f].numpy()[order] for f in hash_table_ops.EXPORT_FIELDS}


@pytest.mark.parametrize("make", [
    lambda: keras.optimizers.SGD(0.3),
    lambda: keras.optimizers.Adagrad(0.2, initial_accumulator_value=0.05),
    lambda: keras.optimizers.Adam(0.05),
    lambda: keras.optimizers.Adam(0.05, beta_1=0.8, clipnorm=0.01)],
    ids=["SGD", "Adagrad", "Adam", "Adam-clipnorm"])
def test_a_plain_optimizer_trains_the_rows_gba_trains(make):
  """A plain tf_keras optimizer in compile: the table applies its rows itself, as GBA(it) does
  with M = 1 (SPEC section 6): the same rows, slots, counts and dense weights, step by step."""
  pos, y = _batches(seed=5)
  models = []
  for wrap in (lambda inner: inner, GBA):
    model, emb = hash_model()
    model.compile(wrap(make()), "mse")
    models.append((model, emb))
  for p, t in zip(pos, y):
    for model, _ in models:
      model.train_on_batch(IDS[p], t)
    (plain, plain_emb), (gba, gba_emb) = models
    a, b = _sorted_rows(plain_emb.table), _sorted_rows(gba_emb.table)
    np.testing.assert_array_equal(a["keys"], b["keys"])
    for f in ("values", "slots"):
      np.testing.assert_allclose(a[f], b[f], rtol=1e-6, atol=1e-6, err_msg=f)
    for f in ("frequency", "last_seen"):
      np.testing.assert_array_equal(a[f], b[f], err_msg=f)
    for u, v in zip(plain.get_weights(), gba.get_weights()):
      np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-6)
  assert int(plain.optimizer.iterations.numpy()) == len(pos)
  assert a["slots"].shape[1] == {"SGD": 0, "Adagrad": 1, "Adam": 2}[type(plain.optimizer).__name__]
  # The rows moved (the comparison is not of two untouched tables); as in Sync, no tags written.
  assert not np.allclose(a["values"], hash_model()[1].table.find(tf.constant(a["keys"])).numpy())
  assert (a["tags"] == -1).all()


@pytest.mark.parametrize("make, says", [
    (lambda: keras.optimizers.RMSprop(0.1), "RMSprop is none of them: use tf_keras.optimizers.SGD"),
    (lambda: keras.optimizers.SGD(0.1, momentum=0.9), "plain SGD"),
    (lambda: keras.optimizers.Adam(amsgrad=True), "without amsgrad"),
    (lambda: keras.optimizers.Adam(use_ema=True), "use_ema=False"),
    (lambda: keras.optimizers.AdamW(0.1), "weight_decay=None"),
    (lambda: keras.optimizers.legacy.Adagrad(0.1),
     "cannot be updated by tf_keras.optimizers.legacy.Adagrad: use tf_keras.optimizers.SGD")])
def test_a_plain_optimizer_the_table_cannot_apply_is_refused_in_one_line(make, says):
  model, emb = hash_model()
  model.compile(make(), "mse")
  pos, y = _batches()
  with pytest.raises(ValueError) as raised:
    model.train_on_batch(IDS[pos[0]], y[0])
  message = str(raised.value)
  assert says in message and "\n" not in message, message   # not AutoGraph's "in user code:"
  assert emb.table.size() == 0  # refused while the step was traced: it never ran


def test_a_plain_optimizer_under_an_all_reduce_strategy_is_sent_to_apply_replicated():
  strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
  with strategy.scope():
    layer = HashEmbedding(DIM, seed=3)
    optimizer = keras.optimizers.SGD(0.5)
    layer.build((2,))

  @tf.function
  def step():
    def replica_fn():
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.constant([5, 9], tf.int64), training=True))
      optimizer.apply_gradients(zip(tape.gradient(loss, [layer.hash_anchor]),
                                    [layer.hash_anchor]))
    strategy.run(replica_fn)

  with pytest.raises(ValueError, match="apply_replicated, not by SGD.apply_gradients") as raised:
    step()
  assert "\n" not in str(raised.value)


def test_checkpoint_round_trip_keeps_every_row_field(tmp_path):
  model, emb = hash_model()
  model.compile(GBA(keras.optimizers.Adam(0.01)), "mse")
  pos, y = _batches(seed=2)
  for p, t in zip(pos, y):
    model.train_on_batch(IDS[p], t)
  path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(tmp_path / "ckpt"))
  before = emb.table.export()
  assert before["slots"].shape[1] == 2 and int(tf.reduce_max(before["tags"])) >= 0
  restored, remb = hash_model()
  restored.compile(GBA(keras.optimizers.Adam(0.01)), "mse")
  restored(IDS[pos[0]])  # built: the table exists before the restore
  tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(path)
  after = remb.table.export()
  order_a, order_b = np.argsort(before["keys"].numpy()), np.argsort(after["keys"].numpy())
  for f in hash_table_ops.EXPORT_FIELDS:
    np.testing.assert_array_equal(before[f].numpy()[order_a], after[f].numpy()[order_b])
  # Training goes on identically from the restored state.
  model.train_on_batch(IDS[pos[0]], y[0])
  restored.train_on_batch(IDS[pos[0]], y[0])
  a, b = emb.table.export(), remb.table.export()
  np.testing.assert_allclose(a["values"].numpy()[np.argsort(a["keys"].numpy())],
                             b["values"].numpy()[np.argsort(b["keys"].numpy())], rtol=1e-6)


def test_sharded_table_checkpoint_restores_into_another_shard_count(tmp_path):
  src = hash_table_ops.ShardedHashTable(DIM, devices=["", ""], seed=4)
  keys = tf.constant(np.arange(-20, 20) * 7919, tf.int64)
  src.lookup(keys, 5)
  src.apply(keys[:10], tf.ones([10, DIM]), "adagrad", learning_rate=0.1)
  path = tf.train.Checkpoint(table=src).save(str(tmp_path / "t"))
  want = src.export()
  for p in (1, 3):
    dst = hash_table_ops.ShardedHashTable(DIM, devices=[""] * p, seed=4)
    tf.train.Checkpoint(table=dst).restore(path).assert_consumed()
    got = dst.export()
    oa, ob = np.argsort(want["keys"].numpy()), np.argsort(got["keys"].numpy())
    for f in hash_table_ops.EXPORT_FIELDS:
      np.testing.assert_array_equal(want[f].numpy()[oa], got[f].numpy()[ob])
    for i, shard in enumerate(dst.shards):
      shard_keys = shard.export()["keys"].numpy()
      assert all(hash_table_ops.mix64(int(k)) % p == i for k in shard_keys)


@pytest.mark.parametrize("wrap", [GBA, lambda inner: inner], ids=["GBA", "plain"])
def test_admission_and_interval_eviction_in_a_training_loop(wrap):
  # Zero initial rows and SGD lr 1 on sum(out): an admitted row ends at -(its occurrences in the
  # batches applied since it got the row). The reference follows the SPEC: a row at the second
  # lookup, eviction after the apply of every second global step (the shard's step), TTL 3 then
  # a budget of 3 rows, lowest frequency first, ties to the oldest last_seen, then the smallest key.
  # The same with GBA(SGD) and with a plain SGD, whose rows the table applies itself.
  layer = HashEmbedding(DIM, embeddings_initializer="zeros", min_frequency=2, ttl_steps=3,
                        max_rows=3, eviction_interval=2)
  assert HashEmbedding.from_config(layer.get_config()).get_config() == layer.get_config()
  optimizer = wrap(keras.optimizers.SGD(1.0))
  rng = np.random.default_rng(4)
  rows, pending, filtered, evicted = {}, {}, 0, 0
  for step in range(14):
    batch = rng.choice(IDS, size=(2, 3))
    with tf.GradientTape() as tape:
      out = layer(tf.constant(batch), training=True)
      loss = tf.reduce_sum(out)
    optimizer.apply_gradients(zip(tape.gradient(loss, layer.trainable_variables),
                                  layer.trainable_variables))
    keys, counts = np.unique(batch, return_counts=True)
    for k, c in zip(keys.tolist(), counts.tolist()):
      if k in rows:
        rows[k][0] += 1
        rows[k][1] = step
      else:
        pending[k] = [pending.get(k, [0])[0] + 1, step]
        if pending[k][0] == 2:
          rows[k] = [2, step, 0.0]
          del pending[k]
        else:
          filtered += 1
          continue
      rows[k][2] -= c
    if (step + 1) % 2 == 0:
      now = step + 1
      gone = [k for k, r in rows.items() if now - r[1] > 3]
      pending = {k: p for k, p in pending.items() if now - p[1] <= 3}
      left = sorted((r[0], r[1], k) for k, r in rows.items() if k not in gone)
      gone += [k for _, _, k in left[:max(0, len(left) - 3)]]
      for k in gone:
        del rows[k]
      evicted += len(gone)
  got = layer.table.export()
  by_key = {int(k): (int(f), int(s), v) for k, f, s, v in zip(
      got["keys"].numpy(), got["frequency"].numpy(), got["last_seen"].numpy(),
      got["values"].numpy())}
  assert sorted(by_key) == sorted(rows)
  for k, (f, s, v) in by_key.items():
    assert (f, s) == (rows[k][0], rows[k][1])
    np.testing.assert_array_equal(v, np.full(DIM, rows[k][2], np.float32))
  assert layer.table.counters() == {"rows": len(rows), "pending": len(pending),
                                    "admitted": len(rows) + evicted, "filtered": filtered,
                                    "evicted": evicted}
  assert evicted > 0 and filtered > 0
  # Evaluation counts nothing: no row, no pending count (the zero row it reads is checked with a
  # non-zero initializer in tests/ops/test_hash_table_eviction.py).
  layer(tf.constant([IDS.tolist()]), training=False)
  assert layer.table.counters()["rows"] == len(rows)
  assert layer.table.counters()["pending"] == len(pending)
