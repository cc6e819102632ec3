"""`--mode=dts`: the training binary's model and data under DTS, one process per worker.

DTS is synchronous data parallelism (MultiWorkerMirroredStrategy), so every worker runs the same
program: `run_worker` is what each process of `run_collective_cluster` runs.
"""

import math
import os

import tensorflow as tf

from tf_gba import data as data_lib
from tf_gba import models as models_lib
from tf_gba.distribute.dts_training import train_dts
from tf_gba.training.config import TrainConfig


def run_worker(config: dict) -> dict:
  cfg = TrainConfig(**config)
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  num_workers = strategy.num_replicas_in_sync
  options = cfg.data_kwargs()
  info = data_lib.data_info(cfg.data, **options)

  def dataset_fn(ctx):
    return data_lib.make_dataset(
        cfg.data, split="train", batch_size=cfg.local_batch_size,
        num_shards=ctx.num_input_pipelines, shard_index=ctx.input_pipeline_id, day=cfg.day,
        repeat=True, shuffle_seed=cfg.seed, strict=cfg.strict_data, **options)

  def eval_dataset_fn():
    return data_lib.make_dataset(cfg.data, split="eval", batch_size=1024, day=cfg.day,
                                 shuffle_seed=None, strict=cfg.strict_data,
                                 **options).take(max(1, math.ceil(cfg.eval_examples / 1024)))

  summary = train_dts(
      model_fn=lambda: models_lib.build_model(cfg.model, info, embedding_dim=cfg.embedding_dim,
                                              seed=cfg.seed),
      dataset_fn=dataset_fn, steps=max(1, cfg.steps // num_workers), delay=cfg.dts_delay,
      period=cfg.dts_period, latency_ms=cfg.dts_latency_ms, strategy=strategy,
      inner=cfg.dts_inner, learning_rate=cfg.learning_rate, momentum=cfg.dts_momentum,
      eval_dataset_fn=eval_dataset_fn, checkpoint_dir=os.path.join(cfg.model_dir, "dts"))
  summary["num_workers"] = num_workers
  return summary
