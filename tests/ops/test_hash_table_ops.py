"""Hash embedding table ops against NumPy references (SPEC section 6).

The references below are written from the SPEC and the ops' documented formulas: splitmix64's
finaliser and counter stream in Python integers for the initial rows and shards, and the row
updates of SGD, Adagrad and LazyAdam in float64.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from tf_gba.ops import hash_table_ops

MASK = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
DIM = 4


def mix64_ref(z):
  z &= MASK
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
  return z ^ (z >> 31)


def uniform_ref(seed, key, i):
  base = mix64_ref((int(key) & MASK) + mix64_ref(int(seed) & MASK))
  return (mix64_ref(base + i * GAMMA) >> 11) * 2.0**-53


def initial_row_ref(seed, key, dim, initializer="uniform", a=-0.05, b=0.05):
  if initializer == "zeros":
    return np.zeros(dim, np.float32)
  if initializer == "uniform":
    return np.array([a + (b - a) * uniform_ref(seed, key, j + 1) for j in range(dim)], np.float32)
  out = []
  for j in range(dim):
    u1, u2 = uniform_ref(seed, key, 2 * j + 1), uniform_ref(seed, key, 2 * j + 2)
    out.append(a + b * math.sqrt(-2.0 * math.log1p(-u1)) * math.cos(2.0 * math.pi * u2))
  return np.array(out, np.float32)


KEYS = [0, 1, 2, 7, -1, -(2**63), 2**63 - 1, 10**12, 123456789, 42]


def _rows_by_key(export):
  keys = export["keys"].numpy()
  order = np.argsort(keys)
  return {f: export[f].numpy()[order] for f in hash_table_ops.EXPORT_FIELDS}


@pytest.mark.parametrize("initializer,a,b", [("uniform", -0.05, 0.05), ("uniform", 0.0, 2.0),
                                             ("normal", 0.0, 1.0), ("normal", 1.0, 0.1),
                                             ("zeros", 0.0, 0.0)])
def test_initial_rows_depend_on_seed_and_key_only(initializer, a, b):
  want = np.stack([initial_row_ref(5, k, DIM, initializer, a, b) for k in KEYS])
  one = hash_table_ops.ShardedHashTable(DIM, seed=5, initializer=initializer, init_a=a, init_b=b)
  three = hash_table_ops.ShardedHashTable(DIM, devices=["", "", ""], seed=5,
                                          initializer=initializer, init_a=a, init_b=b)
  got_one = one.lookup(tf.constant(KEYS, tf.int64), 0).numpy()
  order = np.random.default_rng(0).permutation(len(KEYS))
  got_three = np.empty_like(got_one)
  got_three[order] = three.lookup(tf.constant(np.array(KEYS)[order], tf.int64), 0).numpy()
  np.testing.assert_allclose(got_one, want, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(got_three, got_one)
  other_seed = hash_table_ops.ShardedHashTable(DIM, seed=6, initializer=initializer,
                                               init_a=a, init_b=b)
  if initializer != "zeros":
    assert not np.allclose(other_seed.lookup(tf.constant(KEYS, tf.int64), 0).numpy(), got_one)


def test_shards_are_mix64_mod_p():
  for p in (1, 2, 3, 7):
    got = hash_table_ops.shard_of_keys(tf.constant(KEYS, tf.int64), p).numpy()
    np.testing.assert_array_equal(got, [mix64_ref(k) % p for k in KEYS])
  assert [hash_table_ops.mix64(k) for k in KEYS] == [mix64_ref(k) for k in KEYS]
  # Sequential ids spread evenly.
  counts = np.bincount(hash_table_ops.shard_of_keys(tf.range(10000, dtype=tf.int64), 4).numpy())
  assert counts.min() > 2300


def test_string_keys_are_fingerprint64():
  words = tf.constant([["a", "bb"], ["ccc", ""]])
  keys = hash_table_ops.string_keys(words)
  assert keys.shape == (2, 2) and keys.dtype == tf.int64
  unsigned = [int(k) & MASK for k in keys.numpy().ravel()]
  # tf.strings.to_hash_bucket_fast is Fingerprint64(s) mod n: an independent way to the value.
  for n in (1000003, 2**62 + 7):
    buckets = tf.strings.to_hash_bucket_fast(tf.reshape(words, [-1]), n).numpy()
    assert [u % n for u in unsigned] == [int(x) for x in buckets]


def test_training_lookup_counts_and_find_inserts_nothing():
  table = hash_table_ops.ShardedHashTable(DIM, devices=["", ""], seed=1)
  missing = table.find(tf.constant([5, 6], tf.int64)).numpy()
  np.testing.assert_allclose(missing, np.stack([initial_row_ref(1, k, DIM) for k in (5, 6)]),
                             rtol=1e-6)
  assert table.size() == 0
  table.lookup(tf.constant([5, 9], tf.int64), 3)
  table.lookup(tf.constant([5], tf.int64), 7)
  assert table.size() == 2
  rows = _rows_by_key(table.export())
  np.testing.assert_array_equal(rows["keys"], [5, 9])
  np.testing.assert_array_equal(rows["frequency"], [2, 1])
  np.testing.assert_array_equal(rows["last_seen"], [7, 3])
  np.testing.assert_array_equal(rows["tags"], [-1, -1])
  table.find(tf.constant([5, 11], tf.int64))
  assert table.size() == 2
  np.testing.assert_array_equal(_rows_by_key(table.export())["frequency"], [2, 1])


def _reference_updates(optimizer, steps, seed, lr=0.1, beta_1=0.9, beta_2=0.999, eps=1e-7,
                       init_acc=0.1):
  """steps: (keys, grads) per apply. Returns {key: (value, slots)} in float64."""
  state = {}
  for t, (keys, grads) in enumerate(steps):
    summed = {}
    for k, g in zip(keys, grads):  # duplicates summed first
      summed[k] = summed.get(k, 0.0) + np.asarray(g, np.float64)
    alpha = lr * math.sqrt(1 - beta_2**(t + 1)) / (1 - beta_1**(t + 1))
    for k, g in summed.items():
      if k not in state:
        slots = [np.full(DIM, init_acc)] if optimizer == "adagrad" else (
            [np.zeros(DIM), np.zeros(DIM)] if optimizer == "adam" else [])
        state[k] = (initial_row_ref(seed, k, DIM).astype(np.float64), slots)
      w, slots = state[k]
      if optimizer == "sgd":
        w = w - lr * g
      elif optimizer == "adagrad":
        slots = [slots[0] + g * g]
        w = w - lr * g / np.sqrt(slots[0] + eps)
      else:
        m = beta_1 * slots[0] + (1 - beta_1) * g
        v = beta_2 * slots[1] + (1 - beta_2) * g * g
        slots = [m, v]
        w = w - alpha * m / (np.sqrt(v) + eps)
      state[k] = (w, slots)
  return state


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("num_shards", [1, 3])
def test_fused_apply_matches_reference(optimizer, num_shards):
  rng = np.random.default_rng(2)
  table = hash_table_ops.ShardedHashTable(DIM, devices=[""] * num_shards, seed=3)
  universe = [3, 17, 2**40, -5, 99]
  steps = []
  for _ in range(6):
    keys = list(rng.choice(universe, size=4))  # duplicates and absent rows on purpose
    grads = rng.normal(size=(4, DIM)).astype(np.float32)
    steps.append((keys, grads))
  table.lookup(tf.constant(universe, tf.int64), 0)
  for t, (keys, grads) in enumerate(steps):
    table.apply(tf.constant(keys, tf.int64), tf.constant(grads), optimizer, learning_rate=0.1,
                iteration=t, epsilon=1e-7, initial_accumulator=0.1)
  want = _reference_updates(optimizer, steps, seed=3)
  rows = _rows_by_key(table.export())
  for i, k in enumerate(rows["keys"]):
    if k in want:
      np.testing.assert_allclose(rows["values"][i], want[k][0], rtol=1e-5, atol=1e-6)
      for s, slot in enumerate(want[k][1]):
        np.testing.assert_allclose(rows["slots"][i, s], slot, rtol=1e-5, atol=1e-7)
    else:  # row-local: a row no step contained keeps its initial value and slots
      np.testing.assert_allclose(rows["values"][i], initial_row_ref(3, int(k), DIM), rtol=1e-6)
  assert rows["slots"].shape[1] == hash_table_ops.NUM_SLOTS[optimizer]


def test_export_import_round_trip_into_another_shard_count():
  rng = np.random.default_rng(4)
  src = hash_table_ops.ShardedHashTable(DIM, devices=["", ""], seed=8)
  keys = rng.integers(-2**62, 2**62, size=50)
  src.lookup(tf.constant(keys, tf.int64), 2)
  src.apply(tf.constant(keys[:20], tf.int64), tf.constant(rng.normal(size=(20, DIM)), tf.float32),
            "adam", learning_rate=0.01, iteration=0)
  exported = src.export()
  for p in (1, 3):
    dst = hash_table_ops.ShardedHashTable(DIM, devices=[""] * p, seed=8)
    dst.lookup(tf.constant([1, 2], tf.int64), 0)  # replaced by the import
    dst.import_rows(exported)
    a, b = _rows_by_key(exported), _rows_by_key(dst.export())
    for f in hash_table_ops.EXPORT_FIELDS:
      np.testing.assert_array_equal(a[f], b[f])
    for shard in dst.shards:  # each shard holds exactly its own keys
      k = shard.export()["keys"].numpy()
      assert all(mix64_ref(int(x)) % p == i for x in k for i in [dst.shards.index(shard)])


def test_changing_optimizer_relays_rows_out_keeping_values():
  table = hash_table_ops.ShardedHashTable(DIM, seed=0)
  keys = tf.constant([1, 2], tf.int64)
  table.apply(keys, tf.ones([2, DIM]), "sgd", learning_rate=1.0)
  before = _rows_by_key(table.export())
  table.apply(tf.constant([3], tf.int64), tf.ones([1, DIM]), "adagrad", learning_rate=1.0,
              initial_accumulator=0.5)
  after = _rows_by_key(table.export())
  np.testing.assert_array_equal(after["values"][:2], before["values"])
  np.testing.assert_array_equal(after["slots"][:2], np.full((2, 1, DIM), 0.5, np.float32))


@pytest.mark.parametrize("import_kind", ["full", "delta"])
def test_adagrad_rows_new_after_an_import_start_from_the_optimizers_accumulator(import_kind):
  """Imported Adagrad rows keep their accumulators; a key first seen after the import starts from
  the optimizer's initial accumulator (0.3 here), whether it was inserted by a training lookup
  before the first apply or by that apply itself, as in a table that was never restored."""
  lr, eps, acc0, seed = 0.5, 1e-7, 0.3, 5
  src = hash_table_ops.ShardedHashTable(DIM, seed=seed)
  g1 = np.full((1, DIM), 0.25, np.float32)
  src.apply(tf.constant([1], tf.int64), g1, "adagrad", learning_rate=lr, initial_accumulator=acc0)
  dst = hash_table_ops.ShardedHashTable(DIM, seed=seed)
  if import_kind == "full":
    dst.import_rows(src.export())
  else:
    dst.shards[0].import_delta(src.shards[0].export_delta(-1), replace=False)
  dst.lookup(tf.constant([2], tf.int64), 1)  # inserted before the apply
  g = np.array([[0.5, -1.0, 2.0, 0.0], [1.0, 1.0, -0.5, 0.25], [-2.0, 0.5, 1.0, 1.0]],
               np.float32)
  dst.apply(tf.constant([1, 2, 3], tf.int64), g, "adagrad", learning_rate=lr, iteration=1,
            initial_accumulator=acc0)
  got = _rows_by_key(dst.export())
  # NumPy: key 1 continues from its accumulator acc0 + g1^2; keys 2 and 3 start from acc0.
  prev1 = initial_row_ref(seed, 1, DIM).astype(np.float64) - lr * g1[0] / np.sqrt(
      acc0 + g1[0].astype(np.float64)**2 + eps)
  start = {1: (prev1, acc0 + g1[0].astype(np.float64)**2),
           2: (initial_row_ref(seed, 2, DIM).astype(np.float64), np.full(DIM, acc0)),
           3: (initial_row_ref(seed, 3, DIM).astype(np.float64), np.full(DIM, acc0))}
  np.testing.assert_array_equal(got["keys"], [1, 2, 3])
  for i, k in enumerate([1, 2, 3]):
    value, acc = start[k]
    acc = acc + g[i].astype(np.float64)**2
    np.testing.assert_allclose(got["slots"][i].reshape(DIM), acc, rtol=1e-6)
    np.testing.assert_allclose(got["values"][i], value - lr * g[i] / np.sqrt(acc + eps),
                               rtol=1e-5, atol=1e-7)


def _both_modes(fn):
  """Runs fn eagerly and inside a tf.function; returns the two exceptions."""
  errors = []

  def run():
    fn()  # stateful ops run inside a tf.function whether or not they are returned

  for wrap in (lambda f: f, tf.function):
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError, TypeError)) as e:
      wrap(run)()
    errors.append(str(e.value))
  return errors


def test_error_messages_eager_and_tf_function():
  shard = hash_table_ops.HashTableShard(DIM, seed=0)
  for msg in _both_modes(lambda: shard.lookup(tf.constant([[1, 2]], tf.int64), 0)):
    assert "rank 1" in msg or "must be a vector" in msg
  for msg in _both_modes(lambda: shard.apply(tf.constant([1, 2], tf.int64), tf.ones([2, DIM + 1]),
                                             "sgd", learning_rate=0.1)):
    assert f"must have shape [2,{DIM}]" in msg
  for msg in _both_modes(lambda: shard.import_rows(dict(
      keys=tf.constant([1, 1], tf.int64), values=tf.zeros([2, DIM]), slots=tf.zeros([2, 0, DIM]),
      tags=tf.constant([-1, -1], tf.int64), frequency=tf.zeros([2], tf.int64),
      last_seen=tf.zeros([2], tf.int64)))):
    assert "appears twice" in msg
  for msg in _both_modes(lambda: hash_table_ops.check_keys(tf.constant([1.0, 2.0]))):
    assert "must be integers (int32/int64) or strings, got float32" in msg
  with pytest.raises(TypeError, match="RaggedTensor"):
    hash_table_ops.check_keys(tf.ragged.constant([[1], [2, 3]], tf.int64))
  with pytest.raises(ValueError, match="dim"):
    hash_table_ops.ShardedHashTable(0)
  with pytest.raises(ValueError, match="optimizer must be one of"):
    shard.apply(tf.constant([1], tf.int64), tf.ones([1, DIM]), "rmsprop", learning_rate=0.1)


def test_empty_inputs():
  table = hash_table_ops.ShardedHashTable(DIM, devices=["", ""])
  empty = tf.zeros([0], tf.int64)
  assert table.lookup(empty, 0).shape == (0, DIM)
  assert table.find(empty).shape == (0, DIM)
  table.apply(empty, tf.zeros([0, DIM]), "adam", learning_rate=0.1)
  assert table.size() == 0
  exported = table.export()
  assert exported["keys"].shape == (0,)
  table.import_rows(exported)
  assert table.size() == 0
