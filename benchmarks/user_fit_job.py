"""A user's own script, measured by `benchmarks.step_cost --modes=user_fit`.

The binary's default model, data and optimizer (DeepFM on synthetic data, GBA(Adam) with M = the
workers) under `GBAStrategy(resolver)` on a `LocalCluster` of 1 PS, with `compile` and `fit` as
Keras documents them and nothing set that the strategy or Keras chooses by default (the worker
steps per scheduled function among them). Prints `step N/T` at each epoch's end, the lines
step_cost's window is read between.

  python benchmarks/user_fit_job.py [--steps=4000] [--num_workers=4] [--local_batch_size=256]
                                    [--log_every=200]

Imports only tf_gba (the tree step_cost runs it with) and Keras.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tf_gba  # noqa: E402,F401  (first: Keras 2 before TensorFlow)
import tf_keras as keras  # noqa: E402

from tf_gba import data as data_lib  # noqa: E402
from tf_gba import models as models_lib  # noqa: E402
from tf_gba.distribute import GBAStrategy  # noqa: E402
from tf_gba.distribute import LocalCluster  # noqa: E402
from tf_gba.optimizers import GBA  # noqa: E402
from tf_gba.training.config import TrainConfig  # noqa: E402


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=4000, help="worker steps in all")
  p.add_argument("--num_workers", type=int, default=4)
  p.add_argument("--local_batch_size", type=int, default=256)
  p.add_argument("--log_every", type=int, default=200, help="worker steps per epoch")
  args = p.parse_args(argv)
  config = TrainConfig()
  info = data_lib.data_info(config.data)

  def dataset_fn(ctx):
    return data_lib.make_dataset(config.data, split="train", batch_size=args.local_batch_size,
                                 repeat=True, shuffle_seed=config.seed + ctx.input_pipeline_id)

  class Progress(keras.callbacks.Callback):

    def on_epoch_end(self, epoch, logs=None):
      print(f"step {(epoch + 1) * args.log_every}/{args.steps}", flush=True)

  with LocalCluster(num_ps=1, num_workers=args.num_workers) as cluster:
    strategy = GBAStrategy(cluster.resolver())
    with strategy.scope():
      model = models_lib.build_model(config.model, info, embedding_dim=config.embedding_dim,
                                     seed=config.seed)
      model.compile(GBA(keras.optimizers.Adam(config.learning_rate),
                        global_batch_size=args.local_batch_size * args.num_workers,
                        local_batch_size=args.local_batch_size),
                    loss=keras.losses.BinaryCrossentropy())
    model.fit(keras.utils.experimental.DatasetCreator(dataset_fn),
              epochs=args.steps // args.log_every, steps_per_epoch=args.log_every, verbose=0,
              callbacks=[Progress()])


if __name__ == "__main__":
  main()
