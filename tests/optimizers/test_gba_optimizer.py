"""The GBA optimizer wrapper in one process, against NumPy references of the aggregate and of the
inner optimizers' update rules (SGD, Adam, Adagrad as tf_keras defines them)."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute import step_context
from tf_gba.optimizers import GBA
from tf_gba.optimizers import resolve_num_aggregate

ROWS, DIM, WIDTH = 6, 2, 3


# ---- NumPy references ---------------------------------------------------------------------------
def f32(x):
  # tf_keras keeps the learning rate in a float32 variable, whatever the variables' dtype.
  return float(np.float32(x))


class SGDRef:
  def __init__(self, lr):
    self.lr = f32(lr)

  def apply(self, name, w, g, step):
    del name, step
    return w - self.lr * g


class AdamRef:
  def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-7):
    self.lr, self.b1, self.b2, self.eps, self.m, self.v = f32(lr), b1, b2, eps, {}, {}

  def apply(self, name, w, g, step):
    m = self.m.get(name, np.zeros_like(w))
    v = self.v.get(name, np.zeros_like(w))
    t = step + 1
    # tf_keras casts the python betas through float32 for the bias-correction powers only.
    alpha = self.lr * np.sqrt(1 - f32(self.b2)**t) / (1 - f32(self.b1)**t)
    m = m + (g - m) * (1 - self.b1)
    v = v + (g * g - v) * (1 - self.b2)
    self.m[name], self.v[name] = m, v
    return w - m * alpha / (np.sqrt(v) + self.eps)


class AdagradRef:
  def __init__(self, lr, init=0.1, eps=1e-7):
    self.lr, self.init, self.eps, self.acc = f32(lr), init, eps, {}

  def apply(self, name, w, g, step):
    del step
    acc = self.acc.get(name, np.full_like(w, self.init)) + g * g
    self.acc[name] = acc
    return w - self.lr * g / np.sqrt(acc + self.eps)


def reference_training(pushes, m, iota, inner_ref, w0, e0, sparse_normalize="num_aggregate"):
  """Replays pushes (token, dense grad, ids, rows) through SPEC section 1 and the inner rule.

  Embedding rows: per-ID staleness max(0, tag + 1 - token); divisor M (rows absent from an entry
  count as zero) or c(id) with sparse_normalize="per_id".
  """
  w, e, k = w0.copy(), e0.copy(), 0
  tags = -np.ones(ROWS, np.int64)
  batch = []
  for push in pushes:
    batch.append(push)
    if len(batch) < m:
      continue
    dense = sum((1.0 if k - tok <= iota else 0.0) * g for tok, g, _, _ in batch) / m
    sparse = np.zeros_like(e)
    updated = []
    for i in range(ROWS):
      c, kept, num = 0, 0, np.zeros(DIM)
      for tok, _, ids, rows in batch:
        if i in ids:
          c += 1
          wgt = 1.0 if max(0, tags[i] + 1 - tok) <= iota else 0.0
          kept += wgt > 0
          num = num + wgt * rows[ids == i].sum(axis=0)
      if kept:
        sparse[i] = num / (c if sparse_normalize == "per_id" else m)
        updated.append(i)
    # Missing rows carry a zero gradient: tf_keras' sparse SGD/Adagrad leave them unchanged
    # and its sparse Adam decays every row's moments, exactly like a dense zero gradient.
    w = inner_ref.apply("w", w, dense, k)
    e = inner_ref.apply("e", e, sparse, k)
    tags[updated] = k
    k, batch = k + 1, []
  return w, e, k, tags


def scripted_pushes(n, m, max_lag, seed):
  rng = np.random.default_rng(seed)
  pushes = []
  for i in range(n):
    token = max(0, i // m - int(rng.integers(0, max_lag + 1)))
    ids = rng.integers(0, ROWS, int(rng.integers(1, 5)))
    pushes.append((token, rng.normal(size=WIDTH), ids, rng.normal(size=(len(ids), DIM))))
  return pushes


def run_wrapper(opt, pushes, w0, e0):
  w, e = tf.Variable(w0), tf.Variable(e0)

  @tf.function
  def step(token, ticket, g, ids, rows):
    # Tokens are scripted through the step context, as GBAStrategy.run publishes them.
    with step_context.scope(step_context.StepInfo(token=token, ticket=ticket)):
      opt.apply_gradients([(g, w), (tf.IndexedSlices(rows, ids, tf.constant([ROWS, DIM],
                                                                               tf.int64)), e)])

  for ticket, (token, g, ids, rows) in enumerate(pushes):
    step(tf.constant(token, tf.int64), tf.constant(ticket, tf.int64), tf.constant(g),
         tf.constant(ids, tf.int64), tf.constant(rows))
  return w.numpy(), e.numpy()


@pytest.mark.parametrize("make_inner,make_ref", [
    (lambda: keras.optimizers.SGD(0.1), lambda: SGDRef(0.1)),
    (lambda: keras.optimizers.Adam(0.01), lambda: AdamRef(0.01)),
    (lambda: keras.optimizers.Adagrad(0.1), lambda: AdagradRef(0.1)),
], ids=["sgd", "adam", "adagrad"])
@pytest.mark.parametrize("sparse_normalize", ["num_aggregate", "per_id"])
def test_training_matches_numpy_reference(make_inner, make_ref, sparse_normalize):
  m, iota = 3, 1
  pushes = scripted_pushes(45, m, max_lag=4, seed=7)
  rng = np.random.default_rng(0)
  w0, e0 = rng.normal(size=WIDTH), rng.normal(size=(ROWS, DIM))
  opt = GBA(make_inner(), num_aggregate=m, staleness_threshold=iota,
            sparse_normalize=sparse_normalize)
  w, e = run_wrapper(opt, pushes, w0, e0)
  w_ref, e_ref, k_ref, tags_ref = reference_training(pushes, m, iota, make_ref(), w0, e0,
                                                     sparse_normalize)
  np.testing.assert_allclose(w, w_ref, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(e, e_ref, rtol=1e-10, atol=1e-12)
  assert int(opt.iterations.numpy()) == k_ref == 15
  stats = opt.stats()
  assert stats["dense"]["pushes"] == 45 and stats["dense"]["dropped"] > 0
  sparse_buffer = [b for b in opt._gba_state._trackable_children().values()
                   if hasattr(b, "export_state")][0]
  np.testing.assert_array_equal(sparse_buffer.export_state()[1].numpy(), tags_ref)


def test_iterations_advance_once_per_global_step_without_strategy():
  w = tf.Variable([1.0, 2.0])
  opt = GBA(keras.optimizers.SGD(1.0), num_aggregate=4)
  for i in range(10):
    opt.apply_gradients([(tf.constant([1.0, 1.0]), w)])
  # Outside any strategy the wrapper fetches its own tokens: 10 pushes -> 2 global steps.
  assert int(opt.iterations.numpy()) == 2
  np.testing.assert_allclose(w.numpy(), [-1.0, 0.0])


def test_clipnorm_applies_to_the_aggregate():
  w = tf.Variable([0.0, 0.0])
  opt = GBA(keras.optimizers.SGD(1.0, clipnorm=1.0), num_aggregate=2)
  opt.apply_gradients([(tf.constant([3.0, 4.0]), w)])
  opt.apply_gradients([(tf.constant([3.0, 4.0]), w)])
  # aggregate = [3, 4] (norm 5) clipped to norm 1 -> [0.6, 0.8]; per-push clipping would give
  # the same here, so also check a case where it differs:
  np.testing.assert_allclose(w.numpy(), [-0.6, -0.8], rtol=1e-6)
  w2 = tf.Variable([0.0])
  opt2 = GBA(keras.optimizers.SGD(1.0, clipnorm=1.0), num_aggregate=2)
  opt2.apply_gradients([(tf.constant([3.0]), w2)])
  opt2.apply_gradients([(tf.constant([-1.0]), w2)])
  np.testing.assert_allclose(w2.numpy(), [-1.0])  # mean 1.0, norm 1: not clipped (per-push: 0)


def test_weight_decay_applied_once_per_global_step():
  w = tf.Variable([1.0])
  opt = GBA(keras.optimizers.SGD(0.5, weight_decay=0.1), num_aggregate=2)
  opt.apply_gradients([(tf.constant([0.0]), w)])
  np.testing.assert_allclose(w.numpy(), [1.0])
  opt.apply_gradients([(tf.constant([0.0]), w)])
  np.testing.assert_allclose(w.numpy(), [1.0 - 1.0 * 0.1 * 0.5], rtol=1e-6)


@pytest.mark.parametrize("inner,message", [
    (lambda: keras.optimizers.Adam(global_clipnorm=1.0), "global_clipnorm"),
    (lambda: keras.optimizers.Adam(use_ema=True), "use_ema"),
    (lambda: keras.optimizers.legacy.Adam(), "Legacy optimizers"),
    (lambda: __import__("keras").optimizers.Adam(), "Keras 3"),  # the `keras` package is Keras 3
])
def test_unsupported_inner_optimizers_are_refused(inner, message):
  with pytest.raises((ValueError, TypeError), match=message):
    GBA(inner())


def test_resolve_num_aggregate():
  assert resolve_num_aggregate(None, 4096, 512) == 8
  assert resolve_num_aggregate(4, None, None) == 4
  assert resolve_num_aggregate(None, None, None) is None
  with pytest.raises(ValueError, match="not a multiple"):
    resolve_num_aggregate(None, 1000, 300)
  with pytest.raises(ValueError, match="Pass only two"):
    resolve_num_aggregate(3, 1000, 500)
  with pytest.raises(ValueError, match=">= 1"):
    resolve_num_aggregate(0, None, None)
  with pytest.raises(ValueError, match="both"):
    resolve_num_aggregate(None, 1000, None)
  with pytest.raises(ValueError, match="not a multiple"):
    GBA(keras.optimizers.SGD(), global_batch_size=100, local_batch_size=30)
  with pytest.raises(ValueError, match="decay must be"):
    GBA(keras.optimizers.SGD(), decay="cosine")


def test_get_config_round_trip():
  opt = GBA(keras.optimizers.Adam(0.003, beta_1=0.8), num_aggregate=5, staleness_threshold=4,
            decay="exponential", decay_alpha=0.25, sparse_normalize="per_id")
  config = opt.get_config()
  assert config["sparse_normalize"] == "per_id"
  again = GBA.from_config(config)
  strip = lambda c: {k: v for k, v in c.items() if k != "inner"}
  assert strip(again.get_config()) == strip(config)
  assert again.inner_optimizer.get_config() == opt.inner_optimizer.get_config()
  assert isinstance(again.inner_optimizer, keras.optimizers.Adam)
  assert again.inner_optimizer.beta_1 == pytest.approx(0.8)
  assert again.num_aggregate == 5
  # Also through Keras' own (de)serialisation, as model saving uses it.
  restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt),
                                          custom_objects={"GBA": GBA})
  assert isinstance(restored, GBA)
  assert restored.inner_optimizer.get_config() == opt.inner_optimizer.get_config()
  assert {k: v for k, v in restored.get_config().items() if k != "inner"} == {
      k: v for k, v in config.items() if k != "inner"}


def _tiny_model():
  inp = keras.Input((2,), dtype=tf.int64)
  x = keras.layers.Flatten()(keras.layers.Embedding(10, 3)(inp))
  model = keras.Model(inp, keras.layers.Dense(1, activation="sigmoid")(x))
  return model


def _tiny_data():
  rng = np.random.default_rng(0)
  x = rng.integers(0, 10, (256, 2))
  y = (x.sum(1) > 9).astype(np.float32)
  return x, y


def test_model_fit_without_strategy_and_checkpoint_round_trip(tmp_path):
  x, y = _tiny_data()
  model = _tiny_model()
  opt = GBA(keras.optimizers.Adam(0.05), num_aggregate=2)
  model.compile(opt, loss="binary_crossentropy")
  hist = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
  assert hist.history["loss"][-1] < hist.history["loss"][0]
  assert int(opt.iterations.numpy()) == 3 * 16 // 2
  path = str(tmp_path / "weights")
  model.save_weights(path)
  saved = {n: tf.train.load_variable(path, n) for n, _ in tf.train.list_variables(path)}
  assert any("gba/buffer" in n and "row_tags" in n for n in saved)
  assert any("gba/token_generator" in n for n in saved)

  fresh = _tiny_model()
  opt2 = GBA(keras.optimizers.Adam(0.05), num_aggregate=2)
  fresh.compile(opt2, loss="binary_crossentropy")
  fresh.load_weights(path)
  fresh.fit(x[:32], y[:32], batch_size=16, epochs=1, verbose=0)  # builds slots and buffers
  # Restored state at build time, then one global step of training on top:
  assert int(opt2.iterations.numpy()) == int(opt.iterations.numpy()) + 1
  tags_before = [v for n, v in saved.items() if n.endswith("row_tags/.ATTRIBUTES/VARIABLE_VALUE")
                 or "row_tags" in n][0]
  after = {n: tf.train.load_variable(path, n) for n, _ in tf.train.list_variables(path)}
  np.testing.assert_array_equal(tags_before, [v for n, v in after.items() if "row_tags" in n][0])


def test_sync_checkpoint_restores_into_gba_and_back(tmp_path):
  # Switching: a checkpoint written with plain Adam restores into GBA(Adam) with every slot, and
  # a GBA checkpoint restores into plain Adam (its extra "gba" entries are simply unused).
  x, y = _tiny_data()
  sync_model = _tiny_model()
  sync_model.compile(keras.optimizers.Adam(0.05), loss="binary_crossentropy")
  sync_model.fit(x, y, batch_size=32, epochs=1, verbose=0)
  path = str(tmp_path / "sync")
  sync_model.save_weights(path)

  gba_model = _tiny_model()
  gba_opt = GBA(keras.optimizers.Adam(0.05), num_aggregate=2)
  gba_model.compile(gba_opt, loss="binary_crossentropy")
  status = gba_model.load_weights(path)
  gba_opt.build(gba_model.trainable_variables)
  # The GBA-only state (token count, buffers) is not in a synchronous checkpoint; all else is.
  status.expect_partial()
  for a, b in zip(sync_model.optimizer.variables, gba_opt.variables):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  for a, b in zip(sync_model.weights, gba_model.weights):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  # Tokens start at the restored global step, so the first GBA pushes are not stale.
  assert int(gba_opt._token_source().count().numpy()) == 2 * int(gba_opt.iterations.numpy())
  gba_model.fit(x, y, batch_size=16, epochs=1, verbose=0)
  assert gba_opt.stats()["dense"]["dropped"] == 0
  path2 = str(tmp_path / "gba")
  gba_model.save_weights(path2)

  back = _tiny_model()
  back.compile(keras.optimizers.Adam(0.05), loss="binary_crossentropy")
  back.load_weights(path2)
  back.optimizer.build(back.trainable_variables)
  for a, b in zip(gba_opt.variables, back.optimizer.variables):
    np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_created_outside_a_strategy_refuses_to_run_under_one():
  # Outside any strategy GBA aggregates in this process; applied under a strategy it would train
  # something else than the user asked for, so it says what to do instead.
  var = tf.Variable([1.0, 2.0])
  opt = GBA(keras.optimizers.SGD(1.0), num_aggregate=2)
  strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
  with pytest.raises(RuntimeError, match="create the optimizer inside"):
    strategy.run(lambda: opt.apply_gradients([(tf.constant([1.0, 1.0]), var)]))
  with strategy.scope(), pytest.raises(RuntimeError, match="GBAStrategy"):
    GBA(keras.optimizers.SGD(1.0))


def test_public_state_api_names_the_checkpoint_layout(tmp_path):
  dense = tf.Variable([1.0, 2.0])
  table = tf.Variable(tf.zeros([5, 2]))
  opt = GBA(keras.optimizers.SGD(1.0), num_aggregate=2)
  opt.build([dense, table])
  assert opt.variable_index(dense) == 0 and opt.variable_index(table) == 1
  opt.apply_gradients([(tf.constant([1.0, 1.0]), dense),
                       (tf.IndexedSlices(tf.ones([1, 2]), tf.constant([3], tf.int64),
                                         tf.constant([5, 2], tf.int64)), table)])
  opt.apply_gradients([(tf.constant([1.0, 1.0]), dense),
                       (tf.IndexedSlices(tf.ones([1, 2]), tf.constant([3], tf.int64),
                                         tf.constant([5, 2], tf.int64)), table)])
  state = opt.gba_state()
  assert state[GBA.TOKENS_KEY] is opt.token_generator
  assert int(opt.token_generator.count().numpy()) == 2
  assert sorted(state["buffers"]) == [0, 1]
  assert state["buffers"][0]["variable"] is dense and not state["buffers"][0]["sparse"]
  assert state["buffers"][1]["sparse"] and opt.buffer(table, sparse=True) is (
      state["buffers"][1]["buffer"])
  path = tf.train.Checkpoint(optimizer=opt).write(str(tmp_path / "ckpt"))
  saved = dict(tf.train.list_variables(path))
  prefix = f"optimizer/{GBA.STATE_KEY}/"
  assert any(k.startswith(f"{prefix}{GBA.TOKENS_KEY}/") for k in saved)
  tags = [k for k in saved if k.startswith(prefix + GBA.buffer_key(1) + "/") and "row_tags" in k]
  assert len(tags) == 1
  # Row 3 was updated by global step 0's aggregate, which made step 1; the others never were.
  np.testing.assert_array_equal(tf.train.load_variable(path, tags[0]), [-1, -1, -1, 0, -1])
  assert GBA.buffer_index(GBA.buffer_key(7)) == 7 and GBA.buffer_index("token_generator") is None


def test_the_gradients_of_one_device_travel_as_one_tensor():
  """The packing before the pushes: the dense gradients of one device's variables and one
  embedding gradient (IndexedSlices) are split back from one concatenated tensor (one transfer
  per device) with the values, ids and shapes they had, to the bit: ids whose bits read as NaN
  or infinity in float32 included, int64 and int32; a second embedding gradient and a lone
  dense gradient pass as they are."""
  from tf_gba.optimizers import gba as gba_lib  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  shapes = [[3, 2], [2], [4, 1, 2]]
  grads = [rng.normal(size=s).astype(np.float32) for s in shapes]
  variables = [tf.Variable(tf.zeros(s)) for s in shapes]
  table, other_table = tf.Variable(tf.zeros([5, 2])), tf.Variable(tf.zeros([5, 2]))
  # 0x7FC00001 and 0x7F800001FF: a quiet NaN's and an infinity's bits in a float32 word.
  ids = np.array([2**40 + 5, 0x7FC00001, -1, 3, 0x7F800001FF], np.int64)
  values = rng.normal(size=[5, 2]).astype(np.float32)

  @tf.function
  def pack(id_dtype):
    rows = tf.IndexedSlices(tf.constant(values), tf.constant(ids.astype(id_dtype)),
                            tf.constant([5, 2], id_dtype))
    second = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([3], id_dtype))
    pairs = ([(tf.constant(g), v) for g, v in zip(grads, variables)] + [(rows, table)]
             + [(second, other_table)])
    out, _ = gba_lib._one_transfer_per_device(pairs)  # pylint: disable=protected-access
    ops = [op.type for op in tf.compat.v1.get_default_graph().get_operations()]
    return [g for g, _ in out[:3]], out[3][0], out[4][0], ops.count("ConcatV2"), (
        ops.count("Split") + ops.count("SplitV"))

  for id_dtype in (np.int64, np.int32):
    dense, sparse, second, concats, splits = pack(id_dtype)
    assert (concats, splits) == (1, 1)
    for got, want in zip(dense, grads):
      np.testing.assert_array_equal(got.numpy(), want)
    assert isinstance(sparse, tf.IndexedSlices) and sparse.indices.dtype == id_dtype
    np.testing.assert_array_equal(sparse.indices.numpy(), ids.astype(id_dtype))
    np.testing.assert_array_equal(sparse.values.numpy(), values)
    np.testing.assert_array_equal(sparse.dense_shape.numpy(), [5, 2])
    np.testing.assert_array_equal(second.indices.numpy(), [3])
  lone, _ = gba_lib._one_transfer_per_device([(tf.constant(grads[0]), variables[0])])  # pylint: disable=protected-access
  assert lone[0][0].shape == (3, 2)
