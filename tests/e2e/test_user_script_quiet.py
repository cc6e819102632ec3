"""A user's own script on a LocalCluster prints what it prints itself, and no more.

Plain scripts (no redirection of file descriptor 2): the README's "Using it in your own model"
snippet, and TensorFlow's parameter-server tutorial with GBAStrategy and GBA (`model.fit` with
TensorBoard, ModelCheckpoint and BackupAndRestore; a custom loop with ClusterCoordinator and
preprocessing layers). What every TensorFlow program prints at start-up (measured here, with a
program that imports TensorFlow and runs one op) is not counted.

A script that compiles with a plain tf_keras optimizer: under GBAStrategy(mode="gba") (the
README's snippet with `Adam` unwrapped) it ends in one Python exception whose message is one line
naming `tf_gba.optimizers.GBA(...)`; a HashEmbedding under mode="async" trains with a plain Adam,
and refuses RMSprop in one line. A refused script prints nothing from TensorFlow's runtime or the
servers.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The scripts prefix their own lines with this.
_OWN = "OWN "
# Lines that are not the script's own and not a start-up notice of any TF program: at most this
# many ("Started server with target: grpc://..." of the coordinator's in-process server).
_MAX_FOREIGN = 3

_ANY_TF_PROGRAM = "import tensorflow as tf\nprint('OWN', int(tf.constant(1) + 1))\n"

_README = textwrap.dedent("""
    import json
    import tf_gba                      # sets up Keras 2 (tf_keras) before TensorFlow is imported
    import tensorflow as tf
    import tf_keras as keras

    def build_my_model():
      return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                               keras.layers.Dense(1, activation="sigmoid")])

    def dataset_fn(ctx):
      x = tf.random.uniform((256, 4))
      y = tf.cast(tf.reduce_sum(x, 1, keepdims=True) > 2, tf.float32)
      return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)

    with tf_gba.distribute.LocalCluster(num_ps=2, num_workers=2) as cluster:
      strategy = tf_gba.distribute.GBAStrategy(
          cluster.resolver(), mode="gba",
          variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner(
              min_shard_bytes=256 << 10, max_shards=2))
      with strategy.scope():
        model = build_my_model()
        optimizer = tf_gba.optimizers.GBA(keras.optimizers.Adam(1e-3),
                                          global_batch_size=16, local_batch_size=8,
                                          staleness_threshold=3)
        model.compile(optimizer, loss="binary_crossentropy")
      history = model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
                          steps_per_epoch=10, verbose=0)
      print("OWN", json.dumps({"loss": history.history["loss"], "stats": optimizer.stats()}))
""")

_TUTORIAL = textwrap.dedent("""
    import json, os, random, sys
    import tf_gba
    import tensorflow as tf
    import tf_keras as keras

    work = sys.argv[1]
    with tf_gba.distribute.LocalCluster(num_ps=2, num_workers=2) as cluster:
      strategy = tf_gba.distribute.GBAStrategy(
          cluster.resolver(),
          variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner(
              min_shard_bytes=(256 << 10), max_shards=2))

      # model.fit with the tutorial's callbacks.
      def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(64)
        x = tf.random.uniform((10, 10))
        y = tf.random.uniform((10,))
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10).repeat()
        dataset = dataset.shard(input_context.num_input_pipelines,
                                input_context.input_pipeline_id)
        return dataset.batch(batch_size).prefetch(2)

      with strategy.scope():
        model = keras.models.Sequential([keras.Input((10,)), keras.layers.Dense(10)])
        fit_optimizer = tf_gba.optimizers.GBA(keras.optimizers.RMSprop(), num_aggregate=2)
        model.compile(fit_optimizer, loss="mse", steps_per_execution=2)
      callbacks = [
          keras.callbacks.TensorBoard(log_dir=os.path.join(work, "log")),
          keras.callbacks.ModelCheckpoint(filepath=os.path.join(work, "ckpt")),
          keras.callbacks.BackupAndRestore(backup_dir=os.path.join(work, "backup")),
      ]
      history = model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=2,
                          steps_per_epoch=2, callbacks=callbacks, verbose=0)
      print("OWN", json.dumps({"fit_loss": history.history["loss"],
                               "fit_stats": fit_optimizer.stats()}))

      # A custom loop with ClusterCoordinator and preprocessing layers.
      feature_vocab = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong",
                       "wonder_woman"]
      label_vocab = ["yes", "no"]
      with strategy.scope():
        feature_lookup_layer = keras.layers.StringLookup(vocabulary=feature_vocab,
                                                         mask_token=None)
        label_lookup_layer = keras.layers.StringLookup(vocabulary=label_vocab, num_oov_indices=0,
                                                       mask_token=None)
        raw_feature_input = keras.layers.Input(shape=(3,), dtype=tf.string, name="feature")
        feature_preprocess_stage = keras.Model({"features": raw_feature_input},
                                               feature_lookup_layer(raw_feature_input))
        raw_label_input = keras.layers.Input(shape=(1,), dtype=tf.string, name="label")
        label_preprocess_stage = keras.Model({"label": raw_label_input},
                                             label_lookup_layer(raw_label_input))

      rng = random.Random(0)
      examples = {"features": [], "label": []}
      for _ in range(200):
        features = rng.sample(feature_vocab, 3)
        examples["features"].append(features)
        examples["label"].append(["yes"] if "avenger" in features else ["no"])

      def per_worker_dataset_fn():
        ds = tf.data.Dataset.from_tensor_slices(examples)
        ds = ds.map(lambda x: (feature_preprocess_stage(x["features"]),
                               label_preprocess_stage(x["label"])))
        return ds.shuffle(200).batch(32).repeat()

      with strategy.scope():
        model_input = keras.layers.Input(shape=(3,), dtype=tf.int64, name="model_input")
        emb_layer = keras.layers.Embedding(input_dim=len(feature_lookup_layer.get_vocabulary()),
                                           output_dim=16)
        emb_output = tf.reduce_mean(emb_layer(model_input), axis=1)
        dense_output = keras.layers.Dense(units=1, activation="sigmoid")(emb_output)
        model = keras.Model({"features": model_input}, dense_output)
        optimizer = tf_gba.optimizers.GBA(keras.optimizers.RMSprop(learning_rate=0.1),
                                          num_aggregate=2)
        accuracy = keras.metrics.Accuracy()

      @tf.function
      def step_fn(iterator):
        def replica_fn(batch_data, labels):
          with tf.GradientTape() as tape:
            pred = model(batch_data, training=True)
            per_example_loss = keras.losses.BinaryCrossentropy(
                reduction=tf.keras.losses.Reduction.NONE)(labels, pred)
            loss = tf.nn.compute_average_loss(per_example_loss)
          gradients = tape.gradient(loss, model.trainable_variables)
          optimizer.apply_gradients(zip(gradients, model.trainable_variables))
          accuracy.update_state(labels, tf.cast(tf.greater(pred, 0.5), tf.int64))
          return loss
        batch_data, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(batch_data, labels))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

      coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

      @tf.function
      def per_worker_dataset_fn_wrapped():
        return strategy.distribute_datasets_from_function(lambda _: per_worker_dataset_fn())

      per_worker_iterator = iter(coordinator.create_per_worker_dataset(
          per_worker_dataset_fn_wrapped))
      for _ in range(8):
        loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
      coordinator.join()
      print("OWN", json.dumps({"loop_loss": float(loss.fetch()),
                               "accuracy": float(accuracy.result()),
                               "loop_stats": optimizer.stats()}))
""")

# The README's snippet as a user who compiles with a plain optimizer first writes it.
_README_PLAIN = re.sub(r"tf_gba\.optimizers\.GBA\(keras\.optimizers\.Adam\(1e-3\),[^)]*\)",
                       "keras.optimizers.Adam(1e-2)", _README)

# A HashEmbedding model under GBAStrategy(mode=argv[1]), compiled with keras.optimizers.<argv[2]>.
_HASH = textwrap.dedent("""
    import json, sys
    import tf_gba
    import tensorflow as tf
    import tf_keras as keras

    mode, optimizer_name = sys.argv[1:]

    def dataset_fn(ctx):
      ids = tf.random.stateless_uniform((256, 3), (1, 2), 0, 1000, tf.int64) * 1000003
      y = tf.cast(ids[:, :1] % 2, tf.float32)
      return tf.data.Dataset.from_tensor_slices((ids, y)).repeat().batch(8)

    with tf_gba.distribute.LocalCluster(num_ps=2, num_workers=2) as cluster:
      strategy = tf_gba.distribute.GBAStrategy(cluster.resolver(), mode=mode)
      with strategy.scope():
        ids = keras.Input(shape=(3,), dtype=tf.int64)
        embedding = tf_gba.layers.HashEmbedding(8, seed=1)
        head = keras.layers.Dense(1, activation="sigmoid")
        model = keras.Model(ids, head(keras.layers.Flatten()(embedding(ids))))
        model.compile(getattr(keras.optimizers, optimizer_name)(1e-2), loss="binary_crossentropy")
      history = model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
                          steps_per_epoch=10, verbose=0)
      print("OWN", json.dumps({"loss": history.history["loss"], "rows": embedding.table.size(),
                               "steps": int(model.optimizer.iterations.numpy())}))
""")

# A custom loop that ends in an exception while two functions still run on the workers: an
# `atexit` handler registered before the cluster reads the coordinator's threads after tf_gba's
# handler has run, one registered after the coordinator reads them before.
_IN_FLIGHT = textwrap.dedent("""
    import atexit, json, threading, time
    import tf_gba
    import tensorflow as tf

    def coordinator_threads():
      return sorted(t.name for t in threading.enumerate()
                    if t.name.startswith(("WorkerClosureProcessingLoop", "WorkerPreemptionHandler")))

    atexit.register(lambda: print("OWN", json.dumps({"after": coordinator_threads()}), flush=True))
    with tf_gba.distribute.LocalCluster(num_ps=1, num_workers=2) as cluster:
      strategy = tf_gba.distribute.GBAStrategy(cluster.resolver(), mode="async")
      coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
      queue = coordinator._cluster.closure_queue
      atexit.register(lambda: print("OWN", json.dumps({
          "before": coordinator_threads(), "in_flight": queue._inflight_closure_count}), flush=True))
      @tf.function(autograph=False)  # a script given by `python -c` has no source for AutoGraph
      def four_seconds():
        start = tf.timestamp()
        return tf.while_loop(lambda n: tf.timestamp() - start < 4.0, lambda n: n + 1.0, [0.0])

      for _ in range(2):
        coordinator.schedule(four_seconds)
      while queue._inflight_closure_count < 2:
        time.sleep(0.01)
      raise ValueError("the script's own error")
""")

# glog's prefix: severity, date, time, thread; what follows names the source line and says what.
_GLOG_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ ")


def _env():
  env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # as in a user's shell (the tests' conftest sets it)
  return env


def _start(code: str, *args):
  return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=_env(), cwd=_ROOT)


def _finish(proc, timeout=420):
  out, _ = proc.communicate(timeout=timeout)
  return proc.returncode, out.splitlines()


def _split(lines, baseline):
  """(the script's own records, the other lines less those any TF program prints)."""
  own = [json.loads(l[len(_OWN):]) for l in lines if l.startswith(_OWN)]
  usual = [_GLOG_PREFIX.sub("", l) for l in baseline if not l.startswith(_OWN)]
  foreign = []
  for line in lines:
    if line.startswith(_OWN):
      continue
    text = _GLOG_PREFIX.sub("", line)
    if text in usual:
      usual.remove(text)
    else:
      foreign.append(line)
  return own, foreign


def test_the_readme_snippet_and_the_tutorial_end_quietly(tmp_path):
  # All three at once: the machine's cores serve the servers of both scripts while they wait.
  procs = [_start(_ANY_TF_PROGRAM), _start(_README), _start(_TUTORIAL, str(tmp_path / "work"))]
  (base_rc, baseline), (readme_rc, readme), (tutorial_rc, tutorial) = map(_finish, procs)
  assert base_rc == 0, baseline

  assert readme_rc == 0, "\n".join(readme[-60:])
  own, foreign = _split(readme, baseline)
  assert len(foreign) <= _MAX_FOREIGN, "\n".join(foreign[:60])
  (result,) = own
  stats = result["stats"]
  # 10 local batches of 8 on 2 workers, M = 16 / 8 = 2: every push takes one of the M places.
  # A push is dropped exactly when it is more than staleness_threshold = 3 steps stale; that
  # happens when the coordinator schedules one worker's steps while the other waits (a loaded
  # machine), so the count is checked against the staleness histogram, not assumed to be 0.
  assert stats["num_aggregate"] == 2 and stats["tokens_fetched"] == 10
  dense = stats["dense"]
  assert dense["pushes"] == 10 and sum(dense["histogram"]) == 10
  assert dense["nonfinite"] == 0 and dense["dropped"] == sum(dense["histogram"][4:])
  assert stats["global_step"] == 5
  assert all(0.0 < l < 10.0 for l in result["loss"])

  assert tutorial_rc == 0, "\n".join(tutorial[-60:])
  own, foreign = _split(tutorial, baseline)
  assert len(foreign) <= _MAX_FOREIGN, "\n".join(foreign[:60])
  fit, loop = own
  assert fit["fit_stats"]["tokens_fetched"] == 4 and fit["fit_stats"]["global_step"] == 2
  assert all(l == l and l >= 0.0 for l in fit["fit_loss"]) and len(fit["fit_loss"]) == 2
  # Every epoch wrote the model and the backup.
  assert os.path.exists(tmp_path / "work" / "ckpt" / "saved_model.pb")
  # The strategy's token generator serves both optimizers: 4 steps of fit, then 8 of the loop.
  assert loop["loop_stats"]["tokens_fetched"] == 12, loop
  assert loop["loop_stats"]["global_step"] == 4, loop
  assert 0.0 <= loop["accuracy"] <= 1.0 and loop["loop_loss"] == loop["loop_loss"]


def _one_exception(lines, baseline) -> str:
  """The last line of a script that ended in one Python exception, checked to be all it printed
  beyond the start-up notices: Python's traceback (its frames), then that one line."""
  own, foreign = _split(lines, baseline)
  assert not own, own
  start = foreign.index("Traceback (most recent call last):")
  assert len(foreign[:start]) <= _MAX_FOREIGN, "\n".join(foreign)
  frames, last = foreign[start + 1:-1], foreign[-1]
  # Frames only: no chained exception, no second traceback, no line of TensorFlow's runtime.
  assert frames and all(l.startswith("  ") for l in frames), "\n".join(foreign)
  for word in ("InvalidArgumentError", "/job:", "[Op:", "in user code", "Traceback"):
    assert not any(word in l for l in foreign[start + 1:]), "\n".join(foreign)
  return last


def test_plain_optimizers_train_or_are_refused_in_one_line():
  assert "GBA(" not in _README_PLAIN and "keras.optimizers.Adam(1e-2)" in _README_PLAIN
  procs = [_start(_ANY_TF_PROGRAM), _start(_README_PLAIN), _start(_HASH, "async", "RMSprop"),
           _start(_HASH, "async", "Adam")]
  (base_rc, baseline), (readme_rc, readme), (rms_rc, rms), (adam_rc, adam) = map(_finish, procs)
  assert base_rc == 0, baseline

  # The README's snippet with a plain Adam under mode="gba": refused, before any step.
  assert readme_rc == 1, "\n".join(readme[-60:])
  assert _one_exception(readme, baseline) == (
      "ValueError: GBAStrategy(mode='gba') aggregates gradients in buffers on the parameter "
      "servers, but Adam would apply every gradient on arrival (plain async): wrap it, "
      "tf_gba.optimizers.GBA(Adam(...)), or use mode=\"async\".")

  # A HashEmbedding with RMSprop, which its table cannot apply: refused, before any step.
  assert rms_rc == 1, "\n".join(rms[-60:])
  assert _one_exception(rms, baseline) == (
      "ValueError: HashEmbedding rows are updated by the table's fused SGD, Adagrad or Adam "
      "(LazyAdam); RMSprop is none of them: use tf_keras.optimizers.SGD (without momentum), "
      "Adagrad or Adam (without amsgrad), alone or in tf_gba.optimizers.GBA(...).")

  # ... and with a plain Adam under mode="async": trained, quietly, every step applied.
  assert adam_rc == 0, "\n".join(adam[-60:])
  own, foreign = _split(adam, baseline)
  assert len(foreign) <= _MAX_FOREIGN, "\n".join(foreign[:60])
  (result,) = own
  assert result["steps"] == 10 and 0 < result["rows"] <= 10 * 8 * 3
  assert all(0.0 < l < 10.0 for l in result["loss"])


def test_a_script_ending_with_functions_in_flight_exits_with_its_exception():
  """ClusterCoordinator stops its threads only in `__del__`, during interpreter finalization: a
  script that raised with functions in flight was seen to abort there (exit status -6). tf_gba
  stops them at exit first (`coordinator_exit`): each finishes its function and leaves."""
  procs = [_start(_ANY_TF_PROGRAM), _start(_IN_FLIGHT)]
  (base_rc, baseline), (rc, lines) = map(_finish, procs)
  assert base_rc == 0, baseline
  assert rc == 1, "\n".join(lines[-60:])
  own, _ = _split(lines, baseline)
  before, after = own
  assert before["in_flight"] == 2, own
  assert sorted(before["before"]) == ["WorkerClosureProcessingLoop-0",
                                      "WorkerClosureProcessingLoop-1", "WorkerPreemptionHandler"]
  assert after["after"] == [], own
  others = [l for l in lines if not l.startswith(_OWN)]
  assert _one_exception(others, baseline) == "ValueError: the script's own error"
