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
import signal
import threading
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import tensorflow as tf
import tf_keras as keras

from tf_gba import data as data_lib
from tf_gba import models as models_lib
from tf_gba.data import pipeline as data_pipeline
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


STOP_FILE = "tf_gba_stop_request"
# Steps past the furthest worker's report where the workers stop: a worker may run ahead of the
# slowest by up to `delay + period` steps before it waits on an exchange, and each report is up
# to a step old.
_STOP_MARGIN = 2


class StopAgreement:
  """How DTS's workers stop together, at a signal, without a collective of their own.

  DTS's exchanges run collectives in a thread of their own, and collectives must run in the same
  order on every worker, so the loop cannot all-reduce a "stop now" vote as sync does. Instead
  each worker reports its step in a file beside `path` before each step, and the launcher, asked
  to stop, writes into `path` one step past every report (`request`); each worker stops when it
  reaches that step, where all then synchronize and write their checkpoints.
  """

  def __init__(self, path: str, task: int = 0):
    self.path, self.task = path, task

  def _progress(self, task: int) -> str:
    return f"{self.path}.worker_{task}"

  @staticmethod
  def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
    os.replace(tmp, path)  # a reader sees the whole number or nothing

  def report(self, step: int) -> None:
    self._write(self._progress(self.task), str(step))

  def target(self) -> Optional[int]:
    """The step to stop at, once the launcher has written it."""
    try:
      with open(self.path, encoding="utf-8") as f:
        return int(f.read())
    except (FileNotFoundError, ValueError):
      return None

  def clear(self, num_workers: int) -> None:
    for path in [self.path] + [self._progress(i) for i in range(num_workers)]:
      if os.path.exists(path):
        os.remove(path)

  def request(self, num_workers: int, margin: int, done: Callable[[], bool]) -> Optional[int]:
    """Waits for every worker's report (or for `done()`), then writes the step to stop at."""
    steps = []
    while not done():
      steps = []
      for i in range(num_workers):
        try:
          with open(self._progress(i), encoding="utf-8") as f:
            steps.append(int(f.read()))
        except (FileNotFoundError, ValueError):
          break
      if len(steps) == num_workers:
        break
      time.sleep(0.05)
    if len(steps) != num_workers:
      return None
    target = max(steps) + margin
    self._write(self.path, str(target))
    return target


def evaluate_binary(model, dataset) -> Dict[str, float]:
  """`metrics.evaluate_binary` with the key this job's summary uses (`log_loss`)."""
  out = metrics.evaluate_binary(model, dataset)
  out["log_loss"] = out.pop("logloss")
  return out


def train_dts(model_fn: Callable[[], keras.Model],
              dataset_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset],
              steps: int, delay: int = 1, period: int = 1, latency_ms: float = 0.0,
              strategy: Optional[tf.distribute.Strategy] = None, inner: str = "sgd",
              learning_rate: float = 0.01, momentum: float = 0.9,
              eval_dataset_fn: Optional[Callable[[], tf.data.Dataset]] = None,
              checkpoint_dir: Optional[str] = None, checkpoint_every: int = 0,
              log_every: int = 0, global_batch_size: Optional[int] = None,
              exchange_timeout_s: float = 600.0,
              stop: Optional[StopAgreement] = None) -> Dict:
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
    stop: where the launcher asks the workers to stop (`StopAgreement`); at the step it names,
      every worker synchronizes and writes its checkpoint, and the summary has `interrupted`.

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

  # Deleted as this returns: without tf.data's autotuning thread, which that deletion waits for.
  iterator = data_pipeline.distributed_iterator_on_a_worker(strategy, dataset_fn)
  losses: List[float] = []
  warmup = delay + period - 1
  with DTSTrainer(strategy, optimizer, model.trainable_variables, replica_loss,
                  latency_ms=latency_ms, exchange_timeout_s=exchange_timeout_s) as trainer:
    trainer.resume()
    first = trainer.steps
    begin = time.perf_counter()
    timed_from, timed_steps = begin, 0
    interrupted = False
    while trainer.steps < steps:
      if stop is not None:
        stop.report(trainer.steps)
        target = stop.target()
        if target is not None and trainer.steps >= target:
          if trainer.steps > target:
            raise RuntimeError(
                f"asked to stop at step {target}, but this worker is at step {trainer.steps} "
                "already; the run's steps since its last checkpoint are lost.")
          interrupted = True
          break
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
    saved = None
    if manager is not None:
      saved = manager.save(checkpoint_number=trainer.steps)
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
  if interrupted:
    summary.update(interrupted=True, checkpoint=saved)
    return summary  # the rerun evaluates at its end
  if global_batch_size:
    summary["examples_per_sec"] = summary["steps_per_sec"] * global_batch_size
  if eval_dataset_fn is not None:
    metrics = evaluate_binary(model, eval_dataset_fn())
    summary.update(eval_auc=metrics["auc"], eval_log_loss=metrics["log_loss"],
                   eval_examples=metrics["examples"])
  return summary



def run_worker(config: dict, stop_file: Optional[str] = None) -> dict:
  """One DTS worker of the binary's run (its TF_CONFIG set by run_collective_cluster).
  `stop_file`: the `StopAgreement` path through which the launcher stops the run at a signal."""
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
      eval_dataset_fn=eval_dataset_fn, checkpoint_dir=os.path.join(cfg.model_dir, "dts"),
      stop=(StopAgreement(stop_file, strategy.cluster_resolver.task_id or 0)
            if stop_file else None))
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
  # At a signal the workers stop together a few steps on (`StopAgreement`), synchronize and write
  # their checkpoints; the rerun resumes from them.
  agreement = StopAgreement(os.path.join(config.model_dir, STOP_FILE))
  agreement.clear(config.num_workers)  # a previous run's
  finished = threading.Event()

  def request_stop():
    margin = _STOP_MARGIN + 2 * (config.dts_delay + config.dts_period)
    threading.Thread(target=agreement.request, daemon=True, name="dts-stop",
                     args=(config.num_workers, margin, finished.is_set)).start()

  interrupt.on_request(request_stop)
  try:
    results = collective_cluster.run_collective_cluster(
        "tf_gba.training.dts_job:run_worker", num_workers=config.num_workers,
        kwargs={"config": dataclasses.asdict(config), "stop_file": agreement.path},
        timeout_s=3600.0, log_dir=os.path.join(config.model_dir, "worker_logs"))
  finally:
    finished.set()
    interrupt.remove_on_request(request_stop)
    agreement.clear(config.num_workers)
  first = results[0]
  if first.get("interrupted"):
    raise interrupt.Interrupted(interrupt.requested() or signal.SIGTERM, first["checkpoint"],
                                int(first["steps"]))
  wall = time.time() - t0
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
      global_step=int(first.get("steps", 0)),
      start_global_step=int(first.get("steps", 0)) - int(first.get("steps_run", 0)),
      final_train_loss=first.get("final_loss"), eval_auc=first.get("eval_auc"),
      eval_logloss=first.get("eval_log_loss"), eval_examples=first.get("eval_examples"),
      checkpoint=os.path.join(config.model_dir, "dts"),
      exchanges=first.get("exchanges"), blocked_seconds=first.get("blocked_seconds"))
  summary_lib.write(config.model_dir, summary)
  summary_lib.print_summary(summary)
  return summary
