"""`--mode=dts`: the training binary's model and data under DTS, one process per worker.

DTS is synchronous data parallelism (MultiWorkerMirroredStrategy), so every worker runs the same
program: `run_worker` is what each process of `run_collective_cluster` runs.
"""

import dataclasses
import math
import os
import time

import tensorflow as tf

from tf_gba import data as data_lib
from tf_gba import models as models_lib
from tf_gba.distribute.dts_training import train_dts
from tf_gba.training import summary as summary_lib
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


def run(config: TrainConfig) -> dict:
  """`--mode=dts`: one MultiWorkerMirroredStrategy process per worker on 127.0.0.1; the summary."""
  if os.environ.get("TF_CONFIG"):
    raise ValueError("--mode=dts runs its workers on this machine; on a real cluster call "
                     "tf_gba.training.dts_job.run_worker on every worker with its TF_CONFIG.")
  from tf_gba.distribute.collective_cluster import run_collective_cluster  # pylint: disable=g-import-not-at-top
  print(f"tf_gba: mode=dts model={config.model} data={config.data} "
        f"workers={config.num_workers} delay={config.dts_delay} period={config.dts_period} "
        f"latency={config.dts_latency_ms} ms inner={config.dts_inner} lr={config.learning_rate}",
        flush=True)
  t0 = time.time()
  results = run_collective_cluster(
      "tf_gba.training.dts_job:run_worker", num_workers=config.num_workers,
      kwargs={"config": dataclasses.asdict(config)}, timeout_s=3600.0,
      log_dir=os.path.join(config.model_dir, "worker_logs"))
  wall = time.time() - t0
  first = results[0]
  steps_run = int(first.get("steps_run", first.get("steps", 0))) * config.num_workers
  qps = float(first.get("examples_per_sec") or first.get("steps_per_sec", 0.0) *
              config.local_batch_size * config.num_workers)
  summary = summary_lib.new(
      config, num_aggregate=1, global_batch_size=config.local_batch_size * config.num_workers,
      dts_delay=config.dts_delay, dts_period=config.dts_period,
      dts_latency_ms=config.dts_latency_ms, stragglers="none",
      steps=steps_run, examples=steps_run * config.local_batch_size,
      wall_seconds=wall, global_qps=qps, qps_measured_over_steps=steps_run,
      per_worker=[{"worker": i, "steps": int(r.get("steps_run", 0)),
                   "qps": qps / config.num_workers,
                   "injected_delay_seconds": 0.0} for i, r in enumerate(results)],
      global_step=int(first.get("steps_run", 0)),
      final_train_loss=first.get("final_loss"), eval_auc=first.get("eval_auc"),
      eval_logloss=first.get("eval_log_loss"), eval_examples=first.get("eval_examples"),
      checkpoint=os.path.join(config.model_dir, "dts"),
      exchanges=first.get("exchanges"), blocked_seconds=first.get("blocked_seconds"))
  summary_lib.write(config.model_dir, summary)
  summary_lib.print_summary(summary)
  return summary
