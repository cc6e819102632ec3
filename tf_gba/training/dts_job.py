"""`--mode=dts`: the training binary's model and data under DTS, one process per worker.

DTS is synchronous data parallelism (MultiWorkerMirroredStrategy), so every worker runs the same
program: `run_worker` is what each process of `run_collective_cluster` runs. `train_dts` is the
loop it uses, on `tf_gba.distribute.dts_training.DTSTrainer`: a custom loop rather than
`model.fit` because under MultiWorkerMirroredStrategy fit's own cross-worker collectives (its
metrics' all-reduce every step) would interleave with the exchange thread's, and collectives must
run in the same order on every worker. Under a single-process MirroredStrategy `model.fit` with
`DTS.exchange_callback()` does the same training.
"""

import dataclasses
import math
import os
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import tensorflow as tf
import tf_keras as keras

from tf_gba import data as data_lib
from tf_gba import models as models_lib
from tf_gba.common import interrupt
from tf_gba.common import metrics
from tf_gba.distribute import collective_cluster
from tf_gba.distribute.dts_training import DTSTrainer
from tf_gba.optimizers.dts import DTS
from tf_gba.training import summary as summary_lib
from tf_gba.training.config import TrainConfig


def _binary_crossentropy(labels, probs):
  labels = tf.reshape(tf.cast(labels, probs.dtype), [-1])
  return tf.reduce_mean(keras.losses.binary_crossentropy(labels[:, None],
                                                         tf.reshape(probs, [-1, 1])))


def _worker_checkpoint_dir(checkpoint_dir: str, strategy) -> str:
  """Each worker keeps its own DTS checkpoint: its replicas' compensation state is its own."""
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    return checkpoint_dir
  return os.path.join(checkpoint_dir, f"worker_{strategy.cluster_resolver.task_id or 0}")


def evaluate_binary(model, dataset) -> Dict[str, float]:
  """AUC and log loss of `model` (probabilities) on a dataset of (features, labels) batches."""
  predict = tf.function(lambda x: model(x, training=False))
  labels, scores = [], []
  for features, y in dataset:
    labels.append(np.reshape(y.numpy(), [-1]))
    scores.append(np.reshape(predict(features).numpy(), [-1]))
  labels, scores = np.concatenate(labels), np.concatenate(scores)
  return {"auc": metrics.auc(labels, scores), "log_loss": metrics.logloss(labels, scores),
          "examples": int(labels.size)}


def train_dts(model_fn: Callable[[], keras.Model],
              dataset_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset],
              steps: int, delay: int = 1, period: int = 1, latency_ms: float = 0.0,
              strategy: Optional[tf.distribute.Strategy] = None, inner: str = "sgd",
              learning_rate: float = 0.01, momentum: float = 0.9,
              eval_dataset_fn: Optional[Callable[[], tf.data.Dataset]] = None,
              checkpoint_dir: Optional[str] = None, checkpoint_every: int = 0,
              log_every: int = 0, global_batch_size: Optional[int] = None,
              exchange_timeout_s: float = 600.0) -> Dict:
  """Trains a binary-label tf_keras model with DTS and returns a summary.

  Args:
    model_fn: builds the model (called under `strategy.scope()`); the model maps features to
      probabilities. If it is not built yet, it is built on one batch of `dataset_fn`.
    dataset_fn: `InputContext -> tf.data.Dataset` of (features, labels) batches of the
      per-replica batch size, repeating (as for `distribute_datasets_from_function`).
    steps: total number of steps (restored steps count).
    delay, period: see `tf_gba.optimizers.DTS`.
    inner, learning_rate, momentum: the local update: "sgd" (`SGD(learning_rate)`) or "momentum"
      (`SGD(learning_rate, momentum=momentum)`), the inner optimizer DTS wraps.
    latency_ms: injected latency per exchange.
    strategy: defaults to the current (default) strategy.
    eval_dataset_fn: `() -> tf.data.Dataset` of (features, labels) batches; evaluated after the
      final `synchronize()`, when every replica holds the replicas' average model.
    checkpoint_dir: if set, restore the latest checkpoint there and save every `checkpoint_every`
      steps (0: only at the end). Multi-worker: each worker uses `<dir>/worker_<task>`.
    log_every: print the loss every this many steps (0: never).
    global_batch_size: examples per step over all replicas; if given, the summary also has
      `examples_per_sec`.
    exchange_timeout_s: see `DTSTrainer`.

  Returns:
    dict with the configuration, `steps_per_sec` (steady state: the first `delay + period - 1`
    steps, which trace the step functions, are not timed), `examples_per_sec` (global),
    `final_loss` (mean training loss of the last min(20, steps) steps on this worker's replicas),
    `exchanges`, `blocked_seconds` (time the loop waited for exchanges), and with an eval set
    `eval_auc`, `eval_log_loss`.
  """
  strategy = strategy or tf.distribute.get_strategy()
  if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    # A finite dataset makes every `next()` on the distributed iterator a cross-worker collective
    # (to agree on the last partial batch), which would interleave with the exchange's.
    if dataset_fn(tf.distribute.InputContext()).cardinality() != tf.data.INFINITE_CARDINALITY:
      raise ValueError("dataset_fn must return a repeating (infinite) dataset under "
                       "MultiWorkerMirroredStrategy")
  with strategy.scope():
    model = model_fn()
    if not model.built:
      features, _ = next(iter(dataset_fn(tf.distribute.InputContext())))
      model(features)
    if inner not in ("sgd", "momentum"):
      raise ValueError(f"inner must be 'sgd' or 'momentum', got {inner!r}.")
    sgd = keras.optimizers.SGD(learning_rate, momentum=momentum if inner == "momentum" else 0.0)
    optimizer = DTS(sgd, delay=delay, period=period)
    optimizer.build(model.trainable_variables)

  def replica_loss(batch):
    features, labels = batch
    loss = _binary_crossentropy(labels, model(features, training=True))
    if model.losses:
      loss += tf.add_n(model.losses)
    return loss

  manager = None
  if checkpoint_dir:
    task_dir = _worker_checkpoint_dir(checkpoint_dir, strategy)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(checkpoint, task_dir, max_to_keep=2)
    if manager.latest_checkpoint:
      checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()

  iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
  losses: List[float] = []
  warmup = delay + period - 1
  with DTSTrainer(strategy, optimizer, model.trainable_variables, replica_loss,
                  latency_ms=latency_ms, exchange_timeout_s=exchange_timeout_s) as trainer:
    trainer.resume()
    first = trainer.steps
    begin = time.perf_counter()
    timed_from, timed_steps = begin, 0
    while trainer.steps < steps:
      losses.append(trainer.step(iterator))
      done = trainer.steps
      if done - first == warmup:
        timed_from, timed_steps = time.perf_counter(), 0
      elif done - first > warmup:
        timed_steps += 1
      if log_every and done % log_every == 0:
        print(f"[dts] step {done} loss {losses[-1]:.5f}", flush=True)
      if manager is not None and checkpoint_every and done % checkpoint_every == 0:
        manager.save(checkpoint_number=done)
    end = time.perf_counter()
    if timed_steps == 0:  # Too few steps to leave out the warm-up.
      timed_from, timed_steps = begin, len(losses)
    trainer.synchronize()
    if manager is not None:
      manager.save(checkpoint_number=trainer.steps)
    summary = {
        "mode": "dts", "inner": inner, "delay": delay, "period": period,
        "latency_ms": float(latency_ms), "learning_rate": learning_rate,
        "momentum": optimizer.momentum, "steps": trainer.steps, "steps_run": len(losses),
        "num_replicas": strategy.num_replicas_in_sync,
        "steps_per_sec": timed_steps / max(end - timed_from, 1e-9),
        "train_seconds": end - begin,
        "final_loss": float(np.mean(losses[-20:])) if losses else float("nan"),
        "exchanges": trainer.exchange.num_started,
        "blocked_seconds": trainer.exchange.blocked_seconds,
    }
  if global_batch_size:
    summary["examples_per_sec"] = summary["steps_per_sec"] * global_batch_size
  if eval_dataset_fn is not None:
    metrics = evaluate_binary(model, eval_dataset_fn())
    summary.update(eval_auc=metrics["auc"], eval_log_loss=metrics["log_loss"],
                   eval_examples=metrics["examples"])
  return summary



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
  """`--mode=dts`: one MultiWorkerMirroredStrategy process per worker on 127.0.0.1; the summary
  (written and printed)."""
  if os.environ.get("TF_CONFIG"):
    raise ValueError("--mode=dts runs its workers on this machine; on a real cluster call "
                     "tf_gba.training.dts_job.run_worker on every worker with its TF_CONFIG.")
  print(f"tf_gba: mode=dts model={config.model} data={config.data} "
        f"workers={config.num_workers} delay={config.dts_delay} period={config.dts_period} "
        f"latency={config.dts_latency_ms} ms inner={config.dts_inner} lr={config.learning_rate}",
        flush=True)
  t0 = time.time()

  def stop():
    # DTS's exchanges run in threads of their own, between the steps: no progress point where
    # the workers could agree to stop. The workers are ended (run_collective_cluster's cleanup).
    raise interrupt.Interrupted(
        interrupt.requested(), None, None,
        detail="--mode=dts writes its checkpoints only at the end of a run, so this run's steps "
               f"are lost; rerun the same command to train again from the checkpoints in "
               f"{os.path.join(config.model_dir, 'dts')} (if any).")

  interrupt.on_request(stop)
  try:
    results = collective_cluster.run_collective_cluster(
        "tf_gba.training.dts_job:run_worker", num_workers=config.num_workers,
        kwargs={"config": dataclasses.asdict(config)}, timeout_s=3600.0,
        log_dir=os.path.join(config.model_dir, "worker_logs"))
  finally:
    interrupt.remove_on_request(stop)
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
