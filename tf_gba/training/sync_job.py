"""`--mode=sync`: the training binary's model trained synchronously, one process per worker.

Synchronous data parallelism is the baseline GBA is measured against: every step, each worker
computes the gradient of its own local batch, the gradients are all-reduced (a real collective
between the worker processes, MultiWorkerMirroredStrategy), and every worker applies the same mean
gradient to its copy of the model. The global batch is local batch x workers, and a step is as slow
as the slowest worker.

`run_sync(config)` is what the training binary runs for `--mode=sync`: it starts one process per
worker on 127.0.0.1 (`run_collective_cluster`), each running `run_worker`, echoes the chief's
progress lines, and returns the summary (the same keys as the parameter-server modes' summary),
which it also writes to `model_dir/summary.json`. On a real cluster, call `run_worker(config)` on
every worker with its own TF_CONFIG.

The model, optimizer (Adam), loss and checkpoint layout are those of the parameter-server modes, so
a checkpoint written by one mode restores in the other, and the same straggler profile slows the
same workers.
"""

import contextlib
import dataclasses
import hashlib
import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Dict, List

from absl import logging as absl_logging
import numpy as np
import tensorflow as tf
import tf_keras as keras

from tf_gba import data as data_lib
from tf_gba import models as models_lib
from tf_gba.data import pipeline as data_pipeline
from tf_gba.distribute import stragglers as stragglers_lib
from tf_gba.common import autograph
from tf_gba.common import interrupt
from tf_gba.common import metrics
from tf_gba.ops import hash_table_ops
from tf_gba.optimizers import hash_rows
from tf_gba.training import export as export_lib
from tf_gba.training import hash_tables
from tf_gba.training import preflight
from tf_gba.training import recovery
from tf_gba.training import resharding
from tf_gba.training import slow_interval
from tf_gba.training import summary as summary_lib
from tf_gba.training.config import TrainConfig
from tf_gba.training.evaluation import eval_dataset

MODE = "sync"
# The chief marks its progress lines so the launcher can pick them out of its log.
_PROGRESS_PREFIX = "[sync] "
# Created in model_dir by the launcher when SIGINT or SIGTERM reaches it (the workers, each in a
# session of its own, do not receive the terminal's or the platform's signal): the workers read it
# at each progress line and stop together, checkpointing.
STOP_FILE = "tf_gba_stop_request"


def validate(config: TrainConfig) -> None:
  """Raises ValueError, with the flag to change, if `config` cannot run in sync mode."""
  if config.num_workers < 1:
    raise ValueError(f"--num_workers must be >= 1, got {config.num_workers}.")
  if config.local_batch_size < 1:
    raise ValueError(f"--local_batch_size must be >= 1, got {config.local_batch_size}.")
  sync_batch = config.local_batch_size * config.num_workers
  if config.global_batch_size is not None and config.global_batch_size != sync_batch:
    raise ValueError(
        f"--mode=sync trains on local batch x workers = {config.local_batch_size} x "
        f"{config.num_workers} = {sync_batch} examples per step, but --global_batch_size="
        f"{config.global_batch_size}. Leave --global_batch_size unset, or set it to {sync_batch}.")
  # The remaining checks are shared with the other modes.
  dataclasses.replace(config, mode=MODE).validate()


def _worker_config(config: dict) -> TrainConfig:
  cfg = TrainConfig(**config)
  validate(cfg)
  return cfg


def _digest(variables) -> str:
  """sha256 of the variables' values: equal digests mean bit-identical state."""
  h = hashlib.sha256()
  for v in variables:
    h.update(np.ascontiguousarray(v.numpy()).tobytes())
  return h.hexdigest()


def _tables(model) -> Dict[str, Dict[str, np.ndarray]]:
  """{layer name: every row and pending count of its table, ordered by key} (--embedding=hash)."""
  out = {}
  for layer in model.layers:
    table = getattr(layer, "table", None)
    if isinstance(table, hash_table_ops.ShardedHashTable):
      rows = {f: v.numpy() for f, v in table.export().items()}
      order, pending = np.argsort(rows["keys"]), np.argsort(rows["pending_keys"])
      out[layer.name] = {f: v[pending if f.startswith("pending_") else order]
                         for f, v in rows.items()}
  return out


def _tables_digest(tables: Dict[str, Dict[str, np.ndarray]]) -> str:
  """sha256 of the tables' rows (keys, values, slots, tags, frequency, last_seen, pending counts)
  by key: equal digests mean the same table on every worker."""
  h = hashlib.sha256()
  for name in sorted(tables):
    for f in sorted(tables[name]):
      h.update(f"{name}/{f}".encode())
      h.update(np.ascontiguousarray(tables[name][f]).tobytes())
  return h.hexdigest()


def _step_stats() -> Dict[str, float]:
  """This process's straggler counters: steps, busy and injected-delay seconds."""
  # The op reads the counters of the process it runs in; eagerly that is this worker's own.
  steps, busy, delay, first = [int(x) for x in stragglers_lib._ops().gba_worker_step_stats().numpy()[:4]]  # pylint: disable=protected-access
  return {"steps": steps, "busy_seconds": busy * 1e-9, "delay_seconds": delay * 1e-9,
          "first_step_unix": first * 1e-9}


def build_and_restore(cfg: TrainConfig, strategy, info=None):
  """The sync model and its Adam under `strategy`, restored from `cfg.model_dir` if it has one.

  Returns:
    (model, optimizer, restored_from): the checkpoint path restored, or None.
  """
  info = info or data_lib.data_info(cfg.data, **cfg.data_kwargs())
  with strategy.scope():
    # --embedding=hash: a HashEmbedding whose table every worker holds whole
    # (tf_gba.optimizers.hash_rows.apply_replicated keeps the copies identical).
    model = models_lib.build_model(cfg.model, info, embedding_dim=cfg.embedding_dim,
                                   seed=cfg.seed, embedding=cfg.embedding,
                                   hash_options=cfg.hash_options())
    optimizer = keras.optimizers.Adam(cfg.learning_rate)
    model.compile(optimizer, loss=keras.losses.BinaryCrossentropy())
    # Slots now, so that a restore fills them and the checkpoint has the parameter-server modes'
    # layout (model -> optimizer -> Adam's slots).
    optimizer.build(model.trainable_variables)
  # Checkpoints of the parameter-server modes may hold a sharded embedding and GBA state; the
  # resharding restore maps them onto this unsharded model. A truncated newest checkpoint is
  # passed over for the one before it.
  latest, _ = preflight.restore_latest_usable(
      cfg.model_dir, lambda path: resharding.restore_training_state(path, model, optimizer),
      lambda line: print(line, flush=True))
  if latest:
    # The tables' own step (their lookups' last_seen) from the restored global step.
    hash_rows.align_replicated_step(optimizer, model.trainable_variables)
  return model, optimizer, latest


def train_iterator(strategy, cfg: TrainConfig, data_kwargs: dict):
  """This worker's iterator of its shard of the training data, repeating: with a finite dataset
  every next() on the distributed iterator would be a cross-worker collective (agreeing on the
  last partial batch).

  Without tf.data's autotuning thread (`data_pipeline.distributed_iterator_on_a_worker`):
  deleting the iterator, as `run_worker` returns, would wait until that thread wakes, and the
  job's end would wait for its last worker.
  """
  def dataset_fn(ctx):
    return data_lib.make_dataset(
        cfg.data, split="train", batch_size=cfg.local_batch_size,
        num_shards=ctx.num_input_pipelines, shard_index=ctx.input_pipeline_id, day=cfg.day,
        repeat=True, shuffle_seed=cfg.seed, strict=cfg.strict_data, **data_kwargs)

  return data_pipeline.distributed_iterator_on_a_worker(strategy, dataset_fn)


def run_worker(config: dict, auto: dict = None, stop_file: str = None,
               tables_dir: str = None) -> dict:
  """Trains on this worker (one process of a MultiWorkerMirroredStrategy cluster).

  With `auto` (`--mode=auto`: `tf_gba.training.auto_policy.AutoPolicy.to_dict()`), the workers
  gather their step times at every progress line and stop together, checkpointing, when the
  policy decides to switch to GBA; the chief's result then holds `auto` (the observations and the
  decision). `stop_file`: a path whose existence, checked by every worker at each progress line,
  stops the run there with a checkpoint (the result then has `interrupted`). `tables_dir`
  (--embedding=hash): each worker writes its tables' rows there at the end, ordered by key, as
  `worker_<task>.npz` (entries `<layer>/<field>`), to compare the workers' copies.

  Every worker must run this with the same `config` (a `TrainConfig` as a dict); the cluster comes
  from TF_CONFIG. Runs `max(1, steps // workers)` global steps (one global step is one local batch
  on every worker, so `steps` counts worker steps as in the parameter-server modes), continuing the
  optimizer's iterations from the checkpoint in `model_dir` if there is one.

  Returns:
    This worker's numbers: `task`, `num_workers`, `start_global_step`, `global_step`, `steps_run`
    (global steps), `worker_steps` (steps counted by the straggler kernels), `busy_seconds`,
    `delay_seconds` (injected by the straggler profile), `measured_steps` and `measured_seconds`
    (after the first logging interval), `train_seconds`, `final_train_loss` (mean over workers of
    the last interval), `weights_digest` (sha256 of the model weights and optimizer state: the
    same on every worker), `restored_from` and `restored_digest` (the state right after the
    restore, None without a checkpoint), with --embedding=hash `tables_digest` (sha256 of every
    table's rows by key after the final checkpoint's eviction: the same on every worker) and
    `hash_tables` (training/hash_tables.py's report); the chief (task 0) adds `checkpoint`,
    `eval_auc`, `eval_logloss`, `eval_examples`, `global_qps`.
  """
  started_unix = time.time()  # --mode=auto's account of a switch: this process is running
  cfg = _worker_config(config)
  tf.get_logger().setLevel("WARNING")
  absl_logging.set_verbosity(absl_logging.WARNING)
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  num_workers = strategy.num_replicas_in_sync
  task = int(strategy.cluster_resolver.task_id or 0)
  is_chief = task == 0
  profile = stragglers_lib.parse(cfg.stragglers)
  options = cfg.data_kwargs()
  info = data_lib.data_info(cfg.data, **options)

  def log(msg: str) -> None:
    if is_chief:
      print(_PROGRESS_PREFIX + msg, flush=True)

  model, optimizer, restored_from = build_and_restore(cfg, strategy, info)
  restored_unix = time.time()  # cluster, model and optimizer built, checkpoint restored
  checkpoint = tf.train.Checkpoint(model=model)
  # Each worker's straggler position (step count, trace clock), in the checkpoint as the
  # parameter-server modes keep it: a trace goes on across a switch instead of starting over.
  position = tf.Module(name="straggler_position")
  position.steps = tf.Variable(tf.zeros([num_workers], tf.int64), trainable=False, name="steps")
  position.elapsed_ns = tf.Variable(tf.zeros([num_workers], tf.int64), trainable=False,
                                    name="elapsed_ns")
  checkpoint.straggler_position = position
  if restored_from:
    _restore_straggler_position(restored_from, num_workers, task)
  restored_digest = None
  if restored_from:
    restored_digest = _digest(list(model.weights) + list(optimizer.variables))
    log(f"restored from {restored_from} (resharding), global step "
        f"{int(optimizer.iterations.numpy())}")
  start_step = int(optimizer.iterations.numpy())
  total = max(1, cfg.steps // num_workers)
  resume = None

  # A loop of its own rather than model.fit (which the parameter-server modes use): the straggler
  # delay must stretch this worker's compute and come before the all-reduce (see replica_step),
  # while Keras's train_step computes and applies the gradients, all-reduce included, in one call
  # with no place between the two.
  iterator = train_iterator(strategy, cfg, options)
  variables = model.trainable_variables
  # Per example, averaged here: the same mean binary cross-entropy as the other modes' compiled
  # loss (Keras refuses its default reduction inside a distribution strategy).
  bce = keras.losses.BinaryCrossentropy(reduction=keras.losses.Reduction.NONE)

  @autograph.framework_function  # the model's own call is still converted (Keras converts it)
  def replica_step(batch):
    features, labels = batch
    start = stragglers_lib.timed_step_start(profile)
    with tf.control_dependencies([] if start is None else [start]):
      with tf.GradientTape() as tape:
        probs = tf.reshape(model(features, training=True), [-1, 1])
        loss = tf.reduce_mean(bce(tf.reshape(tf.cast(labels, probs.dtype), [-1, 1]), probs))
        if model.losses:
          loss += tf.add_n(model.losses)
        # The optimizer sums the replicas' gradients: each contributes 1/workers of the mean.
        scaled = loss / num_workers
      grads = tape.gradient(scaled, variables)
    # The straggler delay stretches this worker's own compute (forward and backward), as a slow
    # machine would, and comes before the all-reduce: the collective, and so every worker, waits
    # for the slowest one. Timing the all-reduce too would count the wait for other stragglers as
    # this worker's compute and stretch it again.
    computed = [t for t in tf.nest.flatten([loss, grads], expand_composites=True)
                if t is not None]
    with tf.control_dependencies(computed):
      delay = stragglers_lib.timed_step_end(start, profile, cfg.straggler_seed)
    with tf.control_dependencies([delay]):
      grads = [None if g is None else tf.nest.map_structure(tf.identity, g,
                                                            expand_composites=True)
               for g in grads]
      loss = tf.identity(loss)
    # Hash rows: all-gathered, summed per key and applied by every worker's table (first: the
    # table's LazyAdam step is this step's iterations, which apply_gradients advances). The other
    # variables: all-reduce SUM across the workers, then Adam.
    hashed, dense = hash_rows.split_hash_gradients(zip(grads, variables))
    with tf.control_dependencies([hash_rows.apply_replicated(optimizer, hashed)]):
      optimizer.apply_gradients(dense)
    return loss

  @tf.function
  def train_step(it):
    return strategy.run(replica_step, args=(next(it),))

  @tf.function
  def mean_over_workers(value):
    @autograph.framework_function
    def replica_fn(v):
      # The identity puts the value on this replica's device, where the collective runs.
      return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.MEAN,
                                                            tf.identity(v))
    return strategy.run(replica_fn, args=(value,))

  def worker_mean(value: float) -> float:
    # A collective: every worker calls it at the same steps.
    out = mean_over_workers(tf.constant(value, tf.float32))
    return float(strategy.experimental_local_results(out)[0].numpy())

  @tf.function
  def sum_over_workers(value):
    @autograph.framework_function
    def replica_fn(v):
      return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM,
                                                            tf.identity(v))
    return strategy.run(replica_fn, args=(value,))

  def gather(row) -> np.ndarray:
    """[N, len(row)]: every worker's `row` (a collective, as worker_mean). Each worker fills its
    own row of zeros, so the sum is exact and identical on every worker."""
    rows = np.zeros([num_workers, len(row)], np.float64)
    rows[task] = row
    out = sum_over_workers(tf.constant(rows, tf.float64))
    return strategy.experimental_local_results(out)[0].numpy()

  def save(number: int) -> str:
    # A collective too: every worker saves at the same steps.
    stats = stragglers_lib._ops().gba_worker_step_stats().numpy()  # pylint: disable=protected-access
    positions = gather([float(stats[4]), float(stats[5])]).astype(np.int64)
    position.steps.assign(positions[:, 0])
    position.elapsed_ns.assign(positions[:, 1])
    return manager.save(checkpoint_number=number)

  if auto is None:
    # Where the run ends, in global steps: the chief's progress record, as in the other modes
    # (tf_gba.training.recovery); a rerun after an interruption goes on to the same target. Every
    # worker takes the chief's target (a collective).
    mine = [0.0]
    if is_chief:
      os.makedirs(cfg.model_dir, exist_ok=True)
      resume = recovery.begin(cfg.model_dir, MODE, cfg.steps, start_step,
                              target_if_new=start_step + total)
      mine = [float(resume.target_global_step)]
      if resume.resumed:
        log(f"resuming an interrupted run (restart {resume.restarts}): global step {start_step} "
            f"of {resume.target_global_step}, {resume.steps_redone} global steps redone so far")
    total = max(0, int(gather(mine)[0, 0]) - start_step)
  interrupted = False

  policy = None
  if auto is not None:
    # Imported here: the policy imports the simulator, which the plain sync mode does not need.
    from tf_gba.training import auto_policy  # pylint: disable=g-import-not-at-top
    policy = auto_policy.AutoPolicy.from_dict(auto)
  decision = None
  timeline = []
  own_last = None  # (steps, busy + delay seconds) of this worker at the last progress line
  last_unix = None  # the chief's clock at the last progress line (an interval's start)

  writer = (tf.summary.create_file_writer(os.path.join(cfg.model_dir, "tensorboard"))
            if is_chief else None)
  eval_cache = {}

  def evaluate() -> dict:
    if "ds" not in eval_cache:
      eval_cache["ds"] = eval_dataset(cfg, options).cache()
    return metrics.evaluate_binary(model, eval_cache["ds"])

  log(f"training {total} global steps of {num_workers} x {cfg.local_batch_size} examples "
      f"(global step {start_step} -> {start_step + total})")
  losses: List[tf.Tensor] = []
  interval_losses: List[float] = []
  final_loss = float("nan")
  last_eval = 0
  logged = 0
  begin = time.perf_counter()
  begin_unix = time.time()  # --mode=auto's account of a switch: when training started
  interval_begin = begin
  warm = None  # (time, global steps) after the first interval: tracing and start-up excluded
  # Every worker saves (MultiWorkerMirroredStrategy may need them all to take part); only the
  # chief's copy is kept, in model_dir.
  scratch = None if is_chief else tempfile.mkdtemp(prefix="tf_gba_sync_worker_")
  manager = tf.train.CheckpointManager(checkpoint, cfg.model_dir if is_chief else scratch,
                                       max_to_keep=cfg.keep_checkpoints)
  # Periodic checkpoints: every worker must save at the same step, so the step interval is in
  # global steps (worker steps / workers) and the time interval is agreed on at the logging
  # points, through an all-reduce of each worker's clock.
  every = max(1, cfg.checkpoint_every_steps // num_workers) if cfg.checkpoint_every_steps else 0
  last_save = time.perf_counter()
  periodic = 0
  slow = slow_interval.SlowIntervalWatch(waits_for_every_worker=True)
  for step in range(1, total + 1):
    losses.append(strategy.experimental_local_results(train_step(iterator))[0])
    if every and step % every == 0 and step != total:
      save(int(optimizer.iterations.numpy()))
      periodic += 1
      last_save = time.perf_counter()
    if step % cfg.log_every and step != total:
      continue
    if (cfg.checkpoint_every_secs and step != total and
        worker_mean(float(time.perf_counter() - last_save >= cfg.checkpoint_every_secs)) > 0):
      save(int(optimizer.iterations.numpy()))
      periodic += 1
      last_save = time.perf_counter()
    local = float(np.mean([x.numpy() for x in losses]))  # waits for the interval's steps
    losses.clear()
    now = time.perf_counter()
    final_loss = worker_mean(local)
    interval_losses.append(final_loss)
    qps = ((step - logged) * cfg.local_batch_size * num_workers /
           max(now - interval_begin, 1e-9))
    logged, interval_begin = step, now
    if warm is None and step < total:
      warm = (now, step)
    log(f"step {step * num_workers}/{total * num_workers}  global step {start_step + step}  "
        f"loss {final_loss:.4f}  QPS {qps:,.0f}")
    said = slow.interval(now, step * num_workers)
    if said:
      log(said)
    if is_chief and resume is not None:
      recovery.report(cfg.model_dir, start_step + step)
    if (stop_file and step < total and
        worker_mean(float(os.path.exists(stop_file))) > 0):  # a collective: all stop here
      interrupted = True
      total = step
      break
    if policy is not None and step < total:
      own = _step_stats()
      own_now = (own["steps"], stragglers_lib.in_step_seconds(own))
      # The chief's clock for every worker: the decision must be the same everywhere.
      # The chief's clock and QPS too: the decision must be the same everywhere.
      rows = gather([own_now[0] - (own_last or own_now)[0], own_now[1] - (own_last or own_now)[1],
                     now - begin, qps, time.time()])
      if own_last is not None:  # the first interval pays for tracing: not an observation
        trained_s = float(rows[0, 2])
        decision = policy.observe(trained_s, rows[:, 1] / np.maximum(rows[:, 0], 1.0),
                                  float(rows[0, 3]))
        timeline.append({"trained_s": trained_s, "unix": float(rows[0, 4]), "qps": qps,
                         "start_unix": last_unix, "steps": step * num_workers})
        if decision is not None:
          decision["at_step"] = step * num_workers
          log(auto_policy.describe(decision))
          total = step
          break
      if own_last is None:
        policy.started(float(rows[0, 4]))  # the switch into this stay ends here (auto_job)
      own_last, last_unix = own_now, float(rows[0, 4])
    if writer is not None:
      with writer.as_default(step=step * num_workers):
        tf.summary.scalar("train/loss", final_loss)
        tf.summary.scalar("train/global_qps", qps)
        # The other workers wait for the chief in the next all-reduce meanwhile; as in the
        # parameter-server modes, evaluation time counts in the measured wall time.
        if cfg.eval_every and step * num_workers - last_eval >= cfg.eval_every and step < total:
          last_eval = step * num_workers
          result = evaluate()
          tf.summary.scalar("eval/auc", result["auc"])
          tf.summary.scalar("eval/logloss", result["logloss"])
          log(f"  eval at step {step * num_workers}: AUC {result['auc']:.4f}  "
              f"logloss {result['logloss']:.4f}")
      writer.flush()
  end = time.perf_counter()
  if warm is None:  # One interval only: nothing to leave out.
    warm = (begin, 0)
  measured_steps = total - warm[1]
  measured_seconds = max(end - warm[0], 1e-9)
  stats = _step_stats()
  global_step = int(optimizer.iterations.numpy())
  digest = _digest(list(model.weights) + list(optimizer.variables))

  checkpoint_begin_unix = time.time()
  saved = save(global_step)
  # After the save, which evicts first: the tables as the checkpoint holds them.
  tables = _tables(model)
  if tables and tables_dir:
    os.makedirs(tables_dir, exist_ok=True)
    np.savez(os.path.join(tables_dir, f"worker_{task}.npz"),
             **{f"{name}/{f}": v for name, rows in tables.items() for f, v in rows.items()})
  # Every worker writes it (saving reads mirrored variables through collectives); the chief's is
  # kept. A run stopped by a signal or handing over to GBA (--mode=auto) exports nothing: the run
  # that finishes does.
  exporting = decision is None and not interrupted
  if exporting and is_chief:
    export_lib.export_after_run(model, cfg, global_step)
  elif exporting and export_lib.export_dir(cfg.model_dir, cfg.export_dir) is not None:
    export_lib.export_for_serving(model, os.path.join(scratch, "export"))
  if scratch:
    shutil.rmtree(scratch, ignore_errors=True)

  result = {
      "task": task, "num_workers": num_workers, "start_global_step": start_step,
      "global_step": global_step, "steps_run": total, "worker_steps": stats["steps"],
      "busy_seconds": stats["busy_seconds"], "delay_seconds": stats["delay_seconds"],
      "measured_steps": measured_steps, "measured_seconds": measured_seconds,
      "train_seconds": end - begin, "final_train_loss": final_loss,
      "interval_losses": interval_losses, "weights_digest": digest,
      "restored_from": restored_from, "restored_digest": restored_digest,
      "periodic_checkpoints": periodic,
  }
  if tables:
    result.update(tables_digest=_tables_digest(tables),
                  hash_tables=hash_tables.report(model, optimizer))
  if policy is not None:
    result["auto"] = {"decision": decision, "observations": policy.observations,
                      "timeline": timeline, "skipped": policy.skipped,
                      "efficiency": policy.stay_efficiency(),
                      "overhead_s": policy.stay_overhead_s(),
                      "base_step_s": policy.stay_base_step_s(), "started_unix": started_unix,
                      "restored_unix": restored_unix, "train_begin_unix": begin_unix,
                      # When this worker began its first step (tracing done; the op's clock).
                      "first_step_unix": stats["first_step_unix"] or None,
                      "checkpoint_begin_unix": checkpoint_begin_unix, "saved_unix": time.time()}
  if resume is not None:
    result.update(target_global_step=resume.target_global_step, restarts=resume.restarts,
                  restart_causes=resume.restart_causes, steps_redone=resume.steps_redone,
                  batches_reread=resume.steps_redone * num_workers)
    recovery.report(cfg.model_dir, global_step, finished=not interrupted)
  if interrupted:
    result.update(interrupted=True, checkpoint=saved)
    return result
  if is_chief:
    # A stay that hands over to GBA (--mode=auto) is not evaluated: the job that continues is.
    try:
      evaluation = (evaluate() if decision is None else
                    {"auc": float("nan"), "logloss": float("nan"), "examples": 0})
    except (OSError, ValueError, tf.errors.OpError) as e:
      # After the checkpoint: the launcher reports it in one line, the model is safe.
      result.update(checkpoint=saved, after_training_error=preflight.first_line(e)[:300])
      return result
    result.update(
        checkpoint=saved, eval_auc=evaluation["auc"], eval_logloss=evaluation["logloss"],
        eval_examples=evaluation["examples"],
        global_qps=measured_steps * cfg.local_batch_size * num_workers / measured_seconds)
    with writer.as_default(step=total * num_workers):
      tf.summary.scalar("eval/auc", evaluation["auc"])
      tf.summary.scalar("eval/logloss", evaluation["logloss"])
    writer.flush()
  return result


def _restore_straggler_position(path: str, num_workers: int, task: int) -> None:
  """Puts this worker's straggler position stored in checkpoint `path` (by this mode or a
  parameter-server mode with the same number of workers) on this worker's process."""
  saved = resharding.saved_module(path, "straggler_position", ("steps", "elapsed_ns"))
  if not saved or any(v.shape != (num_workers,) for v in saved.values()):
    return  # none stored, or another number of workers: worker i is not that run's worker i
  steps, elapsed = saved["steps"], saved["elapsed_ns"]
  # Eagerly, without a device: the op sets the counters of the process it runs in, this one.
  stragglers_lib._ops().gba_set_step_position(  # pylint: disable=protected-access
      tf.constant(int(steps[task]), tf.int64), tf.constant(int(elapsed[task]), tf.int64))


def _echo_progress(path: str, stop: threading.Event) -> None:
  """Prints the chief's progress lines from its log as they come, until `stop` and the log end."""
  f = None
  while f is None:
    try:
      f = open(path, "r", errors="replace")  # pylint: disable=consider-using-with
    except FileNotFoundError:
      if stop.is_set():
        return
      time.sleep(0.2)
  pending = ""
  with f:
    while True:
      chunk = f.read()
      if chunk:
        pending += chunk
        *lines, pending = pending.split("\n")
        for line in lines:
          if line.startswith(_PROGRESS_PREFIX):
            print(line[len(_PROGRESS_PREFIX):], flush=True)
      elif stop.is_set():
        return
      else:
        time.sleep(0.2)


def summarize(config: TrainConfig, results: List[dict]) -> dict:
  """The run's summary from the workers' results, with the parameter-server modes' keys."""
  chief = results[0]
  num_workers = int(chief["num_workers"])
  steps = int(chief["steps_run"]) * num_workers  # worker steps, as the other modes count them
  measured = int(chief["measured_steps"]) * num_workers
  per_worker = [{
      "worker": int(r["task"]), "steps": int(r["worker_steps"]),
      "qps": r["measured_steps"] * config.local_batch_size / max(r["measured_seconds"], 1e-9),
      "injected_delay_seconds": round(r["delay_seconds"], 3)} for r in results]
  # Synchronous: every gradient is applied to the step it was computed for, none dropped, no
  # barrier but the all-reduce (in the step time): the schema's defaults (training/summary.py).
  return summary_lib.new(
      config, mode=MODE, num_workers=num_workers,
      # Every global step aggregates one local batch from each worker.
      num_aggregate=num_workers, global_batch_size=config.local_batch_size * num_workers,
      steps=steps, examples=steps * config.local_batch_size,
      # The training loop's time, as in the other modes (start-up and final evaluation apart).
      wall_seconds=chief["train_seconds"],
      global_qps=chief["global_qps"], qps_measured_over_steps=measured,
      per_worker=per_worker, global_step=int(chief["global_step"]),
      start_global_step=int(chief["start_global_step"]),
      final_train_loss=chief["final_train_loss"], eval_auc=chief["eval_auc"],
      eval_logloss=chief["eval_logloss"], eval_examples=chief["eval_examples"],
      checkpoint=chief["checkpoint"],
      **({"auto": chief["auto"]} if "auto" in chief else {}),
      **{k: chief[k] for k in ("target_global_step", "restarts", "restart_causes",
                               "steps_redone", "batches_reread") if k in chief},
      # (The summary's recovery line counts restarted processes: none restarts on its own here.)
      **({"worker_restarts": 0} if "restarts" in chief else {}))


# What a worker's log ends with when a peer of its all-reduce died or its link failed: it exits
# with an error of TF's runtime, not of the model's.
_PEER_LOST = ("UnavailableError", "Connection reset", "Socket closed", "Connection refused",
              "failed to connect", "DeadlineExceededError", "Collective ops is aborted",
              "AbortedError")


@contextlib.contextmanager
def _lost_worker_is_restartable(log_dir: str):
  """A worker killed, or one that lost its peers, ends the run as a WorkerLost (one line, exit
  75: the rerun resumes from the last checkpoint) rather than the cluster's traceback: sync's
  all-reduce cannot go on without every worker, and this process restarts none of them. Any
  other failure (the model's own error, a time-out) stays a ClusterError with the logs' ends."""
  from tf_gba.distribute.collective_cluster import ClusterError  # pylint: disable=g-import-not-at-top
  try:
    yield
  except ClusterError as e:
    killed = sorted((i, -c) for i, c in e.exit_codes.items() if c is not None and c < 0)
    lost = sorted(i for i, tail in e.log_tails.items() if any(p in tail for p in _PEER_LOST))
    if killed:
      what = f"worker:{killed[0][0]} was killed ({signal.Signals(killed[0][1]).name})"
    elif lost:
      cause = next(p for p in _PEER_LOST if p in e.log_tails[lost[0]])
      what = f"worker:{lost[0]} lost a peer or its link ({cause})"
    else:
      raise
    raise recovery.WorkerLost(
        f"{what}; sync's all-reduce cannot go on without every worker. Rerun the same command "
        "(once every worker can be reached) to resume from the last checkpoint in model_dir "
        f"(the workers' logs: {log_dir}).") from e


def run_sync(config: TrainConfig, timeout_s: float = 24 * 3600.0, auto: dict = None) -> dict:
  """Trains synchronously on `config.num_workers` local worker processes; returns the summary.

  Also writes the summary to `model_dir/summary.json` and prints it; the workers' logs are kept
  in `model_dir/worker_logs`. `auto`: see `run_worker`.

  Raises:
    ValueError: a bad configuration, or TF_CONFIG is set (this starts its own workers).
    tf_gba.distribute.collective_cluster.ClusterError: a worker failed or `timeout_s` passed; the
      message holds the end of each worker's log.
  """
  from tf_gba.distribute.collective_cluster import run_collective_cluster  # pylint: disable=g-import-not-at-top

  if os.environ.get("TF_CONFIG"):
    raise ValueError("--mode=sync starts its own worker processes on this machine; TF_CONFIG is "
                     "set. On a real cluster call tf_gba.training.sync_job.run_worker on every "
                     "worker with its TF_CONFIG (or unset TF_CONFIG to train locally).")
  validate(config)
  config = dataclasses.replace(config, mode=MODE)
  os.makedirs(config.model_dir, exist_ok=True)
  print(f"tf_gba: mode=sync model={config.model} data={config.data} "
        f"workers={config.num_workers} local batch={config.local_batch_size} "
        f"global batch={config.local_batch_size * config.num_workers} "
        f"global steps={max(1, config.steps // config.num_workers)} "
        f"stragglers={config.stragglers}", flush=True)
  log_dir = os.path.join(config.model_dir, "worker_logs")
  chief_log = os.path.join(log_dir, "worker_0.log")
  if os.path.exists(chief_log):
    os.remove(chief_log)  # A previous run's lines must not be echoed again.
  stop = threading.Event()
  echo = threading.Thread(target=_echo_progress, args=(chief_log, stop), daemon=True)
  echo.start()
  stop_file = os.path.join(config.model_dir, STOP_FILE)
  if os.path.exists(stop_file):
    os.remove(stop_file)  # a previous run's request

  def request_stop():
    with open(stop_file, "w"):
      pass

  interrupt.on_request(request_stop)
  try:
    with _lost_worker_is_restartable(log_dir):
      results = run_collective_cluster(
          "tf_gba.training.sync_job:run_worker", num_workers=config.num_workers,
          kwargs={"config": dataclasses.asdict(config), "stop_file": stop_file,
                  **({"auto": auto} if auto is not None else {})},
          timeout_s=timeout_s, log_dir=log_dir)
  finally:
    interrupt.remove_on_request(request_stop)
    stop.set()
    echo.join(5.0)
    if os.path.exists(stop_file):
      os.remove(stop_file)
  chief = results[0]
  if chief.get("interrupted"):
    raise interrupt.Interrupted(interrupt.requested() or signal.SIGTERM, chief["checkpoint"],
                                int(chief["global_step"]))
  if chief.get("after_training_error"):
    raise recovery.AfterTrainingError(
        f"training finished and its checkpoint {chief['checkpoint']} was written, but the final "
        f"evaluation failed: {chief['after_training_error']}.")
  summary = summarize(config, results)
  if config.embedding == "hash":  # as the parameter-server modes report their tables
    summary["embedding"] = config.embedding
    summary["hash_tables"] = chief.get("hash_tables") or {}
  summary_lib.write(config.model_dir, summary)
  summary_lib.print_summary(summary)
  return summary
