"""A model trained with GBA is served by stock TensorFlow: its SavedModel needs none of tf_gba's ops.

Each SavedModel is loaded in a fresh process that cannot import tf_gba (what TF Serving does) and
its `serving_default` predictions are compared with the trained model's own.
"""

import glob
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
from tests import script_process
import tensorflow as tf
import tf_keras as keras

import tf_gba
from tf_gba import data as data_lib
from tf_gba import models as models_lib
from tf_gba.training import export as export_lib
from tf_gba.training.config import TrainConfig

_VOCAB = 64

# Run outside the checkout, with `import tf_gba` made to fail (the virtualenv may have it
# installed): nothing loaded can come from tf_gba, its op libraries included.
_LOAD = textwrap.dedent("""
    import json, os, sys
    sys.modules["tf_gba"] = None
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import numpy as np
    import tensorflow as tf
    inputs = json.loads(sys.argv[2])
    loaded = tf.saved_model.load(sys.argv[1])
    serve = loaded.signatures["serving_default"]
    _, specs = serve.structured_input_signature
    feed = {name: tf.constant(inputs[name], spec.dtype) for name, spec in specs.items()}
    out = serve(**feed)
    assert sys.modules["tf_gba"] is None and not any(m.startswith("tf_gba.") for m in sys.modules)
    print(json.dumps({k: np.asarray(v).ravel().tolist() for k, v in out.items()}))
""")


def _serve(path: str, inputs: dict) -> np.ndarray:
  """The SavedModel's predictions, from a process without tf_gba."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  proc = subprocess.run([sys.executable, "-c", _LOAD, path, json.dumps(inputs)],
                        capture_output=True, text=True, timeout=300, env=env, cwd="/",
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (values,) = json.loads(proc.stdout.strip().splitlines()[-1]).values()
  return np.asarray(values)


def _gba_ops_in(path: str) -> list:
  """Op types of tf_gba's libraries named anywhere in the SavedModel's graph."""
  with open(os.path.join(path, "saved_model.pb"), "rb") as f:
    data = f.read()
  return sorted({m.decode() for m in __import__("re").findall(rb"GBA>[A-Za-z]+", data)})


def _train(optimizer_fn, save):
  """Trains an embedding + dense model on 2 workers under GBAStrategy, then `save(model)`."""
  ids = np.random.RandomState(0).randint(0, _VOCAB, size=(16, 1)).astype(np.int64)
  with tf_gba.distribute.LocalCluster(num_ps=2, num_workers=2) as cluster:
    strategy = tf_gba.distribute.GBAStrategy(
        cluster.resolver(), mode="gba",
        variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=64, max_shards=2))
    with strategy.scope():
      inp = keras.Input((1,), dtype=tf.int64, name="ids")
      h = keras.layers.Flatten()(keras.layers.Embedding(_VOCAB, 4)(inp))
      model = keras.Model(inp, keras.layers.Dense(1, activation="sigmoid")(h))
      optimizer = optimizer_fn()
      model.compile(optimizer, loss="binary_crossentropy")

    def dataset_fn(_):
      x = tf.random.stateless_uniform((256, 1), (1, 2), 0, _VOCAB, tf.int64)
      return tf.data.Dataset.from_tensor_slices((x, tf.cast(x % 2, tf.float32))).repeat().batch(8)

    model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=8,
              verbose=0)
    assert int(optimizer.iterations.numpy()) >= 1  # global steps were applied
    # The table is sharded over both parameter servers.
    assert len(model.layers[1].embeddings.variables) == 2
    expected = model(ids, training=False).numpy().ravel()
    save(model)
  return ids, expected


def test_model_save_and_tf_saved_model_save_serve_without_tf_gba(tmp_path):
  keras_path, tf_path = str(tmp_path / "keras"), str(tmp_path / "tf")

  def save(model):
    model.save(keras_path)  # Keras 2's default: SavedModel format, optimizer included
    tf.saved_model.save(model, tf_path)

  ids, expected = _train(
      lambda: tf_gba.optimizers.GBA(keras.optimizers.Adam(1e-2), num_aggregate=2), save)
  assert np.ptp(expected) > 0
  for path in (keras_path, tf_path):
    assert _gba_ops_in(path) == []
    np.testing.assert_allclose(_serve(path, {"ids": ids.tolist()}), expected, rtol=1e-5,
                               atol=1e-6)


def test_adaptive_revision_and_export_for_serving(tmp_path):
  path, keras_path = str(tmp_path / "export" / "7"), str(tmp_path / "keras")

  def save(model):
    export_lib.export_for_serving(model, path)
    model.save(keras_path)  # with AdaptiveRevision's slots

  ids, expected = _train(lambda: tf_gba.optimizers.AdaptiveRevision(alpha=0.1), save)
  assert sorted(os.listdir(tmp_path / "export")) == ["7"]  # no partial directory left
  for saved in (path, keras_path):
    assert _gba_ops_in(saved) == []
    np.testing.assert_allclose(_serve(saved, {"ids": ids.tolist()}), expected, rtol=1e-5,
                               atol=1e-6)


def test_checkpoints_still_hold_the_gba_state(tmp_path):
  # Left out of SavedModels only: a checkpoint of the same optimizer keeps optimizer/gba/.
  optimizer = tf_gba.optimizers.GBA(keras.optimizers.SGD(0.1), num_aggregate=1)
  var = tf.Variable(tf.ones([3, 2]))
  optimizer.apply_gradients([(tf.ones([3, 2]), var)])
  prefix = tf.train.Checkpoint(optimizer=optimizer).write(str(tmp_path / "ckpt"))
  names = [name for name, _ in tf.train.list_variables(prefix)]
  assert any(name.startswith("optimizer/gba/") for name in names), names
  saved = str(tmp_path / "module")
  module = tf.Module()
  module.optimizer, module.var = optimizer, var
  tf.saved_model.save(module, saved)
  assert _gba_ops_in(saved) == []


def test_export_dir_flag_values():
  assert export_lib.export_dir("/m", None) == os.path.join("/m", "export")
  assert export_lib.export_dir("/m", "/serving/ctr") == "/serving/ctr"
  assert export_lib.export_dir("/m", "") is None


def _binary_export(tmp_path, *flags):
  """A short binary run with `flags`: (its summary, its export's path, the served predictions of
  an eval batch, those of the final checkpoint's parameters in the same model built here outside
  any strategy, that model)."""
  model_dir = tmp_path / "m"
  proc = script_process.run(
      ["--mode=gba", "--num_ps=1", "--num_workers=2", "--steps=8", "--log_every=4",
       "--local_batch_size=32", "--eval_examples=256", "--stragglers=none",
       "--data_options=num_examples=4000", f"--model_dir={model_dir}", *flags], timeout=400)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  with open(model_dir / "summary.json") as f:
    summary = json.load(f)
  (path,) = glob.glob(str(model_dir / "export" / "*"))
  # Numbered by the global step of the final checkpoint, as TF Serving's versions.
  assert os.path.basename(path) == str(summary["global_step"]) and summary["global_step"] >= 1
  assert f"serving SavedModel {path}" in proc.stdout
  assert _gba_ops_in(path) == []
  # The reference: the final checkpoint's parameters in the same model, built outside any strategy.
  config = TrainConfig(model_dir=str(model_dir), data_options="num_examples=4000",
                       embedding=summary.get("embedding", "vocab"))
  data_kwargs = config.data_kwargs()
  info = data_lib.data_info(config.data, **data_kwargs)
  model = models_lib.build_model(config.model, info, embedding_dim=config.embedding_dim,
                                 seed=config.seed, embedding=config.embedding)
  tf.train.Checkpoint(model=model).read(summary["checkpoint"]).expect_partial()
  features, _ = next(iter(data_lib.make_dataset(config.data, split="eval", batch_size=64,
                                                shuffle_seed=None, **data_kwargs)))
  expected = model(features, training=False).numpy().ravel()
  assert np.ptp(expected) > 0
  served = _serve(path, {k: v.numpy().tolist() for k, v in features.items()})
  return summary, path, served, expected, model, features


def test_the_binary_exports_a_servable_model(tmp_path):
  _, _, served, expected, _, _ = _binary_export(tmp_path)
  np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)


def test_the_binary_exports_hash_embeddings_servable_without_tf_gba(tmp_path):
  summary, path, served, expected, model, features = _binary_export(
      tmp_path, "--embedding=hash", "--num_ps=2")
  table = model.get_layer("categorical_embedding").table
  rows = summary["hash_tables"]["categorical_embedding"]["rows"]
  assert table.size() == rows > 0  # the reference's finds inserted nothing
  # The export holds every row of the final checkpoint, and its serving inserted none (the
  # loaded process's table is two variables; their sizes are read from the checkpoint).
  sizes = {name: shape for name, shape in tf.train.list_variables(
      os.path.join(path, "variables", "variables")) if "serving_rows" in name}
  assert sorted(sizes.values()) == sorted([[rows + 1], [rows + 1, table.dim]])
  # The eval batch holds ids the training never saw (served their initial rows): a training
  # lookup of it here inserts them.
  model(features, training=True)
  assert table.size() > rows
  np.testing.assert_allclose(served, expected, rtol=1e-6, atol=1e-6)


def test_an_empty_export_dir_writes_none(tmp_path):
  config = TrainConfig(model_dir=str(tmp_path), export_dir="")
  assert export_lib.export_after_run(object(), config, 3) is None
  assert not os.path.exists(tmp_path / "export")
