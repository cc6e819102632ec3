"""HashEmbedding served by stock TensorFlow: the initial rows bit for bit, and a trained model's
SavedModel loaded in a process without tf_gba.

The initial row of a key is checked three ways against a NumPy reference of the table's formula
(splitmix64's counter-based stream, hash_table.h): the C++ op's find-only lookup, the stock-op
`initial_rows` and the SavedModel's `ServingRows.find` on a key it does not hold.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba.layers import HashEmbedding
from tf_gba.layers import hash_embedding_serving
from tf_gba.ops import hash_initial_rows
from tf_gba.ops import hash_table_ops
from tf_gba.optimizers import GBA
from tf_gba.training import export as export_lib

DIM, FIELDS = 5, 3
GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _np_mix64(z: np.ndarray) -> np.ndarray:
  z = z.astype(np.uint64)
  with np.errstate(over="ignore"):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return z ^ (z >> np.uint64(31))


def _np_initial_rows(keys, dim, seed, initializer, a, b) -> np.ndarray:
  """hash_table.h's InitialRow in NumPy: base = mix64(key + mix64(seed)); the i-th uniform is
  (mix64(base + i * gamma) >> 11) * 2^-53; uniform a + (b - a) u_{j+1}; normal: Box-Muller on
  u_{2j+1}, u_{2j+2}, a + b z. a and b are the op's float32 attributes, widened."""
  keys = np.asarray(keys, np.int64)
  if initializer == "zeros":
    return np.zeros([len(keys), dim], np.float32)
  a, b = float(np.float32(a)), float(np.float32(b))
  seed_mix = _np_mix64(np.array([seed], np.int64).view(np.uint64))[0]
  with np.errstate(over="ignore"):
    base = _np_mix64(keys.view(np.uint64) + seed_mix)
    count = dim if initializer == "uniform" else 2 * dim
    i = np.arange(1, count + 1, dtype=np.uint64)
    u = (_np_mix64(base[:, None] + i[None, :] * GAMMA) >> np.uint64(11)).astype(np.float64)
  u *= 2.0 ** -53
  if initializer == "uniform":
    return (a + (b - a) * u).astype(np.float32)
  z = np.sqrt(-2.0 * np.log1p(-u[:, 0::2])) * np.cos(2.0 * np.pi * u[:, 1::2])
  return (a + b * z).astype(np.float32)


def _keys(n=4000):
  rng = np.random.default_rng(1)
  edges = [0, 1, -1, 2, -2, 2**31, -2**31, 2**62, 2**63 - 1, -2**63, -2**63 + 1, 10**18]
  keys = np.concatenate([np.array(edges, np.int64),
                         rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64, endpoint=True),
                         rng.integers(-1000, 1000, 200)]).astype(np.int64)
  return rng.permutation(np.unique(keys))  # distinct, in no order


@pytest.mark.parametrize("initializer,a,b", [("uniform", -0.05, 0.05), ("uniform", -1.3, 2.7),
                                             ("normal", 0.0, 0.05), ("normal", 0.25, 1.5),
                                             ("zeros", 0.0, 0.0)])
@pytest.mark.parametrize("seed", [0, 11, -5])
def test_initial_rows_match_the_op_and_numpy_exactly(initializer, a, b, seed):
  keys = _keys()
  want = _np_initial_rows(keys, DIM, seed, initializer, a, b)
  if initializer != "zeros":
    assert np.ptp(want) > 0
  table = hash_table_ops.ShardedHashTable(DIM, seed=seed, initializer=initializer, init_a=a,
                                          init_b=b)
  np.testing.assert_array_equal(table.find(tf.constant(keys)).numpy(), want)  # the C++ op
  assert table.size() == 0
  np.testing.assert_array_equal(
      hash_initial_rows.initial_rows(tf.constant(keys), DIM, seed, initializer, a, b).numpy(),
      want)
  # ServingRows: held keys get their rows, any other its initial row, in a traced function too.
  held = keys[::7]
  held_rows = np.random.default_rng(2).normal(size=(len(held), DIM)).astype(np.float32)
  rows = hash_embedding_serving.ServingRows(held, held_rows, DIM, seed, initializer, a, b)
  expected = want.copy()
  expected[::7] = held_rows
  np.testing.assert_array_equal(tf.function(rows.find)(tf.constant(keys)).numpy(), expected)
  assert rows.size == len(held)


def test_empty_serving_rows_give_initial_rows():
  keys = _keys(50)
  rows = hash_embedding_serving.ServingRows(np.zeros([0], np.int64), np.zeros([0, DIM]), DIM, 3,
                                            "uniform", -0.05, 0.05)
  np.testing.assert_array_equal(rows.find(tf.constant(keys)).numpy(),
                                _np_initial_rows(keys, DIM, 3, "uniform", -0.05, 0.05))


def test_with_admission_a_key_without_a_row_serves_the_zero_row():
  """SPEC 6: with min_frequency > 1 a key without a row reads the zero row, served as trained."""
  keys = _keys(40)
  held = keys[::5]
  held_rows = np.arange(len(held) * DIM, dtype=np.float32).reshape(-1, DIM)
  rows = hash_embedding_serving.ServingRows(held, held_rows, DIM, 3, "uniform", -0.05, 0.05,
                                            admission=True)
  expected = np.zeros([len(keys), DIM], np.float32)
  expected[::5] = held_rows
  np.testing.assert_array_equal(rows.find(tf.constant(keys)).numpy(), expected)


# Loads SavedModels in a process that cannot import tf_gba (what TF Serving does), serves `inputs`
# through `serving_default` and reports the served rows' count before and after.
_SERVE = textwrap.dedent("""
    import json, os, sys
    sys.modules["tf_gba"] = None
    import numpy as np
    import tensorflow as tf
    out = {}
    for path in json.loads(sys.argv[1]):
      loaded = tf.saved_model.load(path)
      serve = loaded.signatures["serving_default"]
      keys = [v for v in serve.variables if "sorted_keys" in v.name]
      before = [v.numpy().copy() for v in keys]
      _, specs = serve.structured_input_signature
      (name, spec), = specs.items()
      (pred,) = serve(**{name: tf.constant(json.loads(sys.argv[2]), spec.dtype)}).values()
      assert all(np.array_equal(b, v.numpy()) for b, v in zip(before, keys))  # nothing inserted
      out[path] = {"pred": np.asarray(pred).ravel().tolist(), "rows": [len(b) - 1 for b in before]}
    assert sys.modules["tf_gba"] is None and not any(m.startswith("tf_gba.") for m in sys.modules)
    print(json.dumps(out))
""")


def _serve(paths, inputs) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  proc = subprocess.run([sys.executable, "-c", _SERVE, json.dumps(paths), json.dumps(inputs)],
                        capture_output=True, text=True, timeout=300, env=env, cwd="/",
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _gba_ops_in(path: str) -> list:
  with open(os.path.join(path, "saved_model.pb"), "rb") as f:
    return sorted({m.decode() for m in re.findall(rb"GBA>[A-Za-z]+", f.read())})


def _train(ids_dtype, train_ids, initializer):
  ids = keras.Input(shape=(FIELDS,), dtype=ids_dtype, name="ids")
  emb = HashEmbedding(DIM, seed=7, embeddings_initializer=initializer, name="hash")
  head = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=1))
  model = keras.Model(ids, head(keras.layers.Flatten()(emb(ids))))
  model.compile(GBA(keras.optimizers.Adagrad(0.2)), "mse")
  y = np.random.default_rng(3).normal(size=(len(train_ids), 1)).astype(np.float32)
  model.fit(train_ids, y, batch_size=8, epochs=2, verbose=0)
  return model, emb


def test_int_ids_trained_exported_and_served_without_tf_gba(tmp_path):
  rng = np.random.default_rng(0)
  vocab = np.concatenate([rng.integers(-2**63, 2**63 - 1, 20, dtype=np.int64, endpoint=True),
                          np.arange(-5, 5)])
  train_ids = vocab[rng.integers(0, len(vocab), size=(48, FIELDS))]
  model, emb = _train(tf.int64, train_ids, "normal")
  size = emb.table.size()
  assert size == len(np.unique(train_ids))
  unseen = np.array([[2**63 - 1, -2**63, 123456789], [-77, 10**17, 999]], np.int64)
  assert not set(unseen.ravel()) & set(train_ids.ravel())
  query = np.concatenate([train_ids[:6], unseen, np.stack([train_ids[0, :2].tolist() + [-77]])])
  expected = model(query, training=False).numpy().ravel()
  assert np.ptp(expected) > 0
  paths = [str(tmp_path / "export" / "1"), str(tmp_path / "keras"), str(tmp_path / "tf")]
  export_lib.export_for_serving(model, paths[0])
  model.save(paths[1])  # optimizer included
  tf.saved_model.save(model, paths[2])
  assert emb.table.size() == size  # the exports inserted nothing
  served = _serve(paths, query.tolist())
  for path in paths:
    assert _gba_ops_in(path) == []
    assert served[path]["rows"] == [size]
    np.testing.assert_allclose(served[path]["pred"], expected, rtol=1e-6, atol=1e-6)
  # Unseen keys are served their initial rows: the served embedding of a row of only unseen ids.
  np.testing.assert_array_equal(
      emb(unseen, training=False).numpy().reshape(-1, DIM),
      _np_initial_rows(unseen.ravel(), DIM, 7, "normal", 0.0, 0.05))
  # Checkpoints keep the table itself, not the exported copy of its rows.
  prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
  names = [n for n, _ in tf.train.list_variables(prefix)]
  assert not [n for n in names if hash_embedding_serving.CHILD in n]
  assert any("/table/.ATTRIBUTES/keys" in n for n in names)


def test_string_ids_and_a_later_save_with_the_same_options_serve_the_later_rows(tmp_path):
  words = np.array([f"w{i}" for i in range(12)])
  rng = np.random.default_rng(5)
  train_ids = words[rng.integers(0, 6, size=(24, FIELDS))]  # w0..w5 only
  model, emb = _train(tf.string, train_ids, "uniform")
  query = np.array([["w0", "w1", "w7"], ["w10", "w11", "never seen"]])
  expected_first = model(query, training=False).numpy().ravel()
  first = str(tmp_path / "1")
  options = tf.saved_model.SaveOptions()  # one object for both saves
  tf.saved_model.save(model, first, options=options)
  size_first = emb.table.size()
  # More training on new words, then a second export: it holds the new rows too.
  more = words[rng.integers(6, 9, size=(16, FIELDS))]
  model.fit(more, np.ones((16, 1), np.float32), batch_size=8, verbose=0)
  second = str(tmp_path / "2")
  model.save(second, options=options)
  size_second = emb.table.size()
  assert size_second == size_first + len(np.unique(more))
  expected = model(query, training=False).numpy().ravel()
  served = _serve([first, second], query.tolist())
  assert served[first]["rows"] == [size_first] and served[second]["rows"] == [size_second]
  # Each export serves the model of its time (w7: its initial row in the first, trained since).
  np.testing.assert_allclose(served[first]["pred"], expected_first, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(served[second]["pred"], expected, rtol=1e-6, atol=1e-6)
  assert not np.allclose(expected_first, expected, rtol=1e-6, atol=1e-6)


def test_bad_ids_get_one_line_before_any_lookup():
  # Besides those of tests/layers/test_hash_embedding.py: sparse ids, ids of rank 0 in a traced
  # function, and float64 ids, named as passed (Keras casts them to float32 otherwise).
  layer = HashEmbedding(DIM)
  with pytest.raises(TypeError, match=r"SparseTensor: pass a dense tensor of ids \(tf.sparse"):
    layer(tf.sparse.from_dense(tf.constant([[1, 0], [0, 2]], tf.int64)))
  with pytest.raises(ValueError, match="are a scalar: pass at least one dimension"):
    tf.function(layer)(tf.constant(3, tf.int64))
  for ids in (np.array([[1.0, 2.0]]), tf.constant([[1.0]], tf.float64)):
    with pytest.raises(TypeError) as e:
      layer(ids)
    assert str(e.value) == (
        f"The ids of {layer.name} must be integers (int32/int64) or strings, got float64: cast "
        "float ids with tf.cast(ids, tf.int64) if they hold whole numbers.")
