"""A GBA training job on a real local cluster, run as its own process by the end-to-end tests.

Each run starts a fresh cluster (2 PS, 3 workers by default), trains an embedding + MLP model whose
embedding is sharded across both parameter servers with `model.fit`, and writes what it saw to a
JSON file: losses, optimizer statistics, and the values of every restored tensor.
"""

import argparse
import json
import os
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import tf_gba  # noqa: E402,F401
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

from tf_gba.common import exiting  # noqa: E402
from tf_gba.distribute import GBAStrategy  # noqa: E402
from tf_gba.distribute import LocalCluster  # noqa: E402
from tf_gba.optimizers import GBA  # noqa: E402

VOCAB, WIDTH = 1000, 3


def build_model():
  inp = keras.Input((WIDTH,), dtype=tf.int64)
  x = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, 8, name="emb")(inp))
  x = keras.layers.Dense(16, activation="relu")(x)
  return keras.Model(inp, keras.layers.Dense(1, activation="sigmoid")(x))


def dataset_fn(ctx):
  seed = ctx.input_pipeline_id if ctx else 0
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, VOCAB, (8192, WIDTH))
  y = ((ids % 7).sum(1) > 9).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices((ids, y)).repeat().batch(32)


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--model_dir", required=True)
  p.add_argument("--restore", action="store_true")
  p.add_argument("--epochs", type=int, default=3)
  p.add_argument("--steps_per_epoch", type=int, default=24)
  p.add_argument("--num_workers", type=int, default=3)
  p.add_argument("--num_ps", type=int, default=2)
  p.add_argument("--steps_per_execution", type=int, default=None,
                 help="compile()'s; by default the strategy's")
  p.add_argument("--kill_worker_after_epoch", type=int, default=-1)
  p.add_argument("--kill_worker_during_epoch", type=int, default=-1,
                 help="kill worker 0 while this epoch's closures are running")
  args = p.parse_args(argv)
  m = 3
  report = {}
  with LocalCluster(num_ps=args.num_ps, num_workers=args.num_workers) as cluster:
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=4096, max_shards=args.num_ps)
    strategy = GBAStrategy(cluster.resolver(), variable_partitioner=partitioner, mode="gba")
    with strategy.scope():
      model = build_model()
      opt = GBA(keras.optimizers.Adam(0.01), num_aggregate=m, staleness_threshold=3)
      model.compile(opt, loss="binary_crossentropy",
                    steps_per_execution=args.steps_per_execution)
    report["variables"] = [(v.name, v.shape.as_list(), v.device)
                           for v in model.trainable_variables]
    ckpt = tf.train.Checkpoint(model=model)
    manager = tf.train.CheckpointManager(ckpt, args.model_dir, max_to_keep=2)
    if args.restore:
      # Slots first, then restore: a deferred restore of sharded slots would run on one PS and
      # need to reach the others, which parameter servers cannot.
      opt.build(model.trainable_variables)
      ckpt.restore(manager.latest_checkpoint).expect_partial()
      report["restored"] = {
          "model": {v.name: v.numpy().tolist() for v in model.weights},
          "optimizer": [v.numpy().tolist() for v in opt.variables
                        if v is not opt.iterations],
          "iterations": int(opt.iterations.numpy()),
          "token_count": int(opt._token_source().count().numpy()),  # pylint: disable=protected-access
      }
      report["restored_from"] = manager.latest_checkpoint
    losses, stats = [], []

    for epoch in range(args.epochs):
      if epoch == args.kill_worker_during_epoch:
        # Dies mid-step: the coordinator re-runs its closure on another worker.
        threading.Timer(1.0, cluster.kill, args=("worker", 0)).start()
      hist = model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
                       steps_per_epoch=args.steps_per_epoch, verbose=0)
      if epoch == args.kill_worker_after_epoch:
        cluster.kill("worker", 0)  # a worker dies between epochs; its closures go elsewhere
      losses.append(hist.history["loss"][-1])
      stats.append(opt.stats())
    report["losses"] = losses
    report["stats"] = stats
    report["buffers"] = {}
    for name, buf in opt._gba_state._trackable_children().items():  # pylint: disable=protected-access
      if hasattr(buf, "export_state"):
        step, tags = buf.export_state()
        report["buffers"][name] = {"global_step": int(step), "row_tags": tags.numpy().tolist()}
      elif hasattr(buf, "global_step"):
        report["buffers"][name] = {"global_step": int(buf.global_step())}
    report["saved_to"] = manager.save()
    report["final_iterations"] = int(opt.iterations.numpy())
  with open(args.out, "w") as f:
    json.dump(report, f)
  # Skip interpreter teardown: the cluster is gone and TF would only log failed remote cleanups.
  exiting.exit_now(0)


if __name__ == "__main__":
  main()
