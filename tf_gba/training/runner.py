"""The main job: a CTR model trained on a parameter-server cluster in one of the modes.

`run(config)` starts (or joins) the cluster, builds the model under a `GBAStrategy`, restores from
`model_dir` if a checkpoint is there, trains with `model.fit`, evaluates, and returns the summary it
also prints and writes to `model_dir/summary.json` (TensorBoard scalars go to
`model_dir/tensorboard`).
"""

import contextlib
import dataclasses
import math
import os
import threading
import time
from typing import List, NamedTuple, Optional

from absl import logging as absl_logging
import numpy as np
import tensorflow as tf
import tf_keras as keras

from tf_gba import data as data_lib
from tf_gba.data import pipeline as data_pipeline
from tf_gba import models as models_lib
from tf_gba.distribute import GBAStrategy
from tf_gba.distribute import LocalCluster
from tf_gba.distribute import stragglers as stragglers_lib
from tf_gba.distribute import tf_config as tf_config_lib
from tf_gba.ops import worker_clock
from tf_gba.optimizers import GBA
from tf_gba.common import bounded_calls
from tf_gba.common import exiting
from tf_gba.common import interrupt
from tf_gba.common import metrics
from tf_gba.common import scalars as scalars_lib
from tf_gba.training import config as config_lib
from tf_gba.training import delta_checkpoints
from tf_gba.training import export as export_lib
from tf_gba.training import hash_tables
from tf_gba.training import mode_registry
from tf_gba.training import pipelining
from tf_gba.training import preflight
from tf_gba.training import recovery
from tf_gba.training import resharding
from tf_gba.training import save_watch
from tf_gba.training import slow_interval
from tf_gba.training import summary as summary_lib
from tf_gba.training.config import TrainConfig
from tf_gba.training.evaluation import eval_dataset


def _log(msg: str) -> None:
  print(msg, flush=True)


def _partitioner(num_ps: int):
  # Shard what is big (the embedding table), leave small dense layers whole: each shard costs one
  # buffer push per step.
  return tf.distribute.experimental.partitioners.MinSizePartitioner(
      min_shard_bytes=256 << 10, max_shards=num_ps)


def make_strategy(config: TrainConfig, resolver) -> GBAStrategy:
  """The `GBAStrategy` of a parameter-server mode, as `config` (the binary's flags) describes it."""
  return GBAStrategy(resolver, variable_partitioner=_partitioner(config.num_ps),
                     mode=config.strategy_mode,
                     num_aggregate=config.num_aggregate if config.mode == "gba" else None,
                     stragglers=config.stragglers, straggler_seed=config.straggler_seed,
                     bsp_aggregate=config.bsp_aggregate, hop_bs_bound=config.hop_bs_bound,
                     hop_bs_timeout_s=config.hop_bs_timeout_s,
                     hop_bw_backup=config.hop_bw_backup,
                     straggler_delay=config.straggler_delay,
                     pack_reads=config.pack_reads)


@contextlib.contextmanager
def _cluster(config: TrainConfig):
  """The local multi-process cluster, or the one TF_CONFIG describes (this task: the chief)."""
  if os.environ.get("TF_CONFIG"):
    # (Checked before: preflight.check_cluster.)
    wait_for_cluster(config)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    yield resolver, None
    return
  with LocalCluster(num_ps=config.num_ps, num_workers=config.num_workers,
                    log_dir=config.log_dir, keep_logs=config.keep_logs, restart_workers=True,
                    num_tfdata_workers=config.tfdata_workers if config.uses_data_list else 0
                    ) as cluster:
    stop = threading.Event()
    threading.Thread(target=watch_servers, args=(cluster, stop, config.model_dir),
                     daemon=True, name="server_watchdog").start()
    try:
      yield cluster.resolver(), cluster
    finally:
      stop.set()


# Seconds a local parameter server may be dead before the watchdog ends the job: a loss the job
# notices (an error of a call to it) is reported within a few seconds (recovery.raise_if_lost).
LOST_PS_GRACE_S = 20.0
# The tf.data dispatcher's loss no call of the job's reports: its tf.data workers ask it for the
# next batch again and again, and the workers' reads wait on them.
LOST_DISPATCHER_GRACE_S = 2.0


def watch_servers(cluster, stop: threading.Event, model_dir: str,
                  grace_s: Optional[float] = None, exit_now=exiting.exit_now) -> None:
  """Ends the job (exit 75: the binary's supervisor restarts it) when a parameter server of the
  local cluster has been dead for `grace_s` (default LOST_PS_GRACE_S) and the job has not
  noticed, or its tf.data dispatcher for LOST_DISPATCHER_GRACE_S (or `grace_s`). Measured by the
  chaos drill (benchmarks/chaos.py): a parameter server killed while a restarted job was
  connecting to its cluster left the job waiting for it with no end and no message; no step was
  scheduled yet, so the stall watchdog had nothing to watch."""
  graces = {"ps": LOST_PS_GRACE_S if grace_s is None else grace_s,
            "tfdata_dispatcher": LOST_DISPATCHER_GRACE_S if grace_s is None else grace_s}
  dead_since = {}
  while not stop.wait(min(1.0, min(graces.values()) / 4)):
    for job, grace in graces.items():
      dead = cluster.dead(job)
      if not dead:
        dead_since.pop(job, None)
        continue
      since = dead_since.setdefault(job, time.time())
      if time.time() - since < grace or stop.is_set():
        continue
      if job == "ps":
        error = recovery.ParameterServerLost(
            f"{', '.join(dead)} died and the job has waited {grace:.0f} s without noticing (a "
            "call to it that never returns); its variables are lost. Rerun the same command to "
            "resume from the last checkpoint in model_dir.")
      else:
        error = recovery.DataListLost(
            f"{', '.join(dead)} (the shared data list's tf.data dispatcher) died; the list's "
            "position in the day is lost with it. Rerun the same command to resume from the last "
            "checkpoint in model_dir.")
      recovery.end_for_restart(model_dir, error, exit_now)
      return


def wait_for_cluster(config: TrainConfig) -> None:
  """On a real cluster: returns once TF_CONFIG's parameter servers and workers (and the tf.data
  dispatcher, if any) accept connections, saying every few seconds which it waits for; TF itself
  would wait in silence."""
  cfg = preflight.tf_config()
  tasks = cfg.addresses(("ps", "worker"))
  if config.uses_data_list and config.tfdata_dispatcher:
    tasks.append(("the tf.data dispatcher", config.tfdata_dispatcher))
  tf_config_lib.wait_for_servers(tasks, config.cluster_wait_s, _log)


class _Progress(keras.callbacks.Callback):
  """Prints progress, writes TensorBoard scalars and evaluates every `eval_every` steps."""

  def __init__(self, job: "_Job"):
    super().__init__()
    self._job = job
    self._t0 = time.time()
    self._last_eval = 0
    self.warm = None  # (time, steps, per-worker stats) after the first interval (tracing, start-up)
    self._last_line = None  # steps finished at the last progress line
    self._slow = slow_interval.SlowIntervalWatch(waits_for_every_worker=False)
    self._silent = slow_interval.SilentWorkers()
    # The loss of the last epoch that trained (see `_epoch_loss`).
    self.last_loss = None
    self._read_loss = None  # (the loss metric, a function reading its total and count)

  def _epoch_loss(self, logs) -> float:
    """The epoch's mean loss, or the last one of an epoch that trained.

    Keras reads the loss from the model's loss metric, reset when an epoch begins. On the shared
    list an epoch can train nothing: its steps are the no-op reads of workers that have seen the
    end of the list, while the last batches' steps finished before the reset (the epochs'
    ends do not wait for them, `pipelining`). The metric then counts nothing and reads 0.
    """
    metric = next((m for m in self.model.metrics if m.name == "loss"), None)
    if getattr(metric, "count", None) is None or getattr(metric, "total", None) is None:
      loss = (logs or {}).get("loss", float("nan"))
    else:
      # Read with its count, in one call to the parameter server that holds them: a step still
      # running may have added to them since Keras read the loss.
      if self._read_loss is None or self._read_loss[0] is not metric:
        self._read_loss = (metric, tf.function(lambda: tf.stack(
            [tf.cast(metric.total, tf.float64), tf.cast(metric.count, tf.float64)])))
      total, count = self._read_loss[1]().numpy()
      if count == 0:
        return float("nan") if self.last_loss is None else self.last_loss
      loss = float(total / count)
    self.last_loss = loss
    return loss

  def on_epoch_end(self, epoch, logs=None):
    job = self._job
    steps = (epoch + 1) * epoch_steps(job.config)
    if steps % job.config.log_every and steps < job.total_steps:
      return  # an epoch that ends at a checkpoint only
    elapsed = time.time() - self._t0
    workers = job.read_workers()
    readable = not any(w.get("unreachable") for w in workers)
    if readable:
      # Steps finished (the epoch's last ones may still run, see `pipelining`), and with the
      # shared list those that trained a batch (its no-op reads at the end are not steps).
      steps = sum(w["steps"] for w in workers)
      if steps == self._last_line:
        # Nothing trained since the last line: at the end of a day the workers that have seen
        # the end of the list run through epochs of no-op reads while the last steps finish.
        return
      self._last_line = steps
      said = self._slow.interval(time.time(), steps, [w["steps"] for w in workers],
                                 job.strategy.function_seconds(), job.checkpoint_seconds)
      job.checkpoint_seconds = 0.0
      # An interval in which a worker did not answer: `SilentWorkers` says what happened.
      if said and not self._silent.silent:
        _log(said)  # beside the progress lines: what the job did, not an error
    # Reads only, so read again when TF's runtime cancels them (recovery.retry_cancelled).
    stats = recovery.retry_cancelled(lambda: _optimizer_stats(job.optimizer))
    for line in self._silent.update(time.time(), [w["worker"] for w in workers
                                                  if w.get("no_answer")],
                                    job.strategy.running_seconds(), stats["global_step"]):
      _log(line)
    # The data position reads every worker, so not while one cannot be read (it would wait).
    seen = (recovery.retry_cancelled(job.shared_input.seen_total)
            if job.shared_input is not None and readable else None)
    if seen is not None:
      recovery.record_seen(job.config.model_dir, seen, stats["global_step"])
    recovery.report(job.config.model_dir, stats["global_step"])
    dense = stats["dense"] or {}
    loss = self._epoch_loss(logs)
    qps = steps * job.config.local_batch_size / max(elapsed, 1e-9)
    if self.warm is None:
      self.warm = (time.time(), steps, workers)
    _log(f"step {steps}/{job.total_steps}  global step {stats['global_step']}  "
         f"loss {loss:.4f}  QPS {qps:,.0f}  staleness mean {dense.get('mean_staleness', 0):.2f} "
         f"max {dense.get('staleness_max', 0)}  dropped batches {dense.get('dropped', 0)}")
    scalars = {"train/loss": loss, "train/global_qps": qps,
               "gba/mean_staleness": dense.get("mean_staleness", 0.0),
               "gba/max_staleness": dense.get("staleness_max", 0),
               "gba/dropped_batches": dense.get("dropped", 0)}
    if job.config.mode == "hop_bw":
      scalars["hop_bw/ignored_gradients"] = dense.get("dropped", 0)
    hop_bs = job.strategy.hop_bs_stats()
    if hop_bs:
      scalars["hop_bs/max_lead"] = hop_bs["max_lead"]
      for i, blocked in enumerate(hop_bs["blocked_seconds"]):
        scalars[f"hop_bs/blocked_seconds_{i}"] = blocked
    for w in workers:
      scalars[f"workers/qps_{w['worker']}"] = (
          w["steps"] * job.config.local_batch_size / max(elapsed, 1e-9))
    if job.config.eval_every and steps - self._last_eval >= job.config.eval_every:
      self._last_eval = steps
      result = job.evaluate()
      scalars["eval/auc"] = result["auc"]
      scalars["eval/logloss"] = result["logloss"]
      _log(f"  eval at step {steps}: AUC {result['auc']:.4f}  logloss {result['logloss']:.4f}")
    job.writer.write(steps, scalars)


def epoch_steps(config: TrainConfig) -> int:
  """Worker steps per `fit` epoch: each logging and each checkpoint point ends an epoch.

  ParameterServerStrategy takes no batch-level callbacks. An epoch's end does not wait for the
  steps still running (`pipelining`); a checkpoint written there waits for them first, and holds
  exactly the steps scheduled.
  """
  return config.interval_steps()


class PeriodicCheckpoint(keras.callbacks.Callback):
  """Writes a checkpoint every `checkpoint_every_steps` worker steps or `checkpoint_every_secs`.

  The checkpoint is numbered by the global step it holds (the optimizer's iterations, with GBA's
  tokens and row tags in the same checkpoint). Each write is atomic: TF writes the files under
  temporary names, renames them, and only then points the `checkpoint` state file at them (itself
  replaced by a rename), so a process killed mid-write leaves the previous checkpoint the newest
  one listed. The time interval is checked at the end of each epoch (see `epoch_steps`).

  A checkpoint waits for every step scheduled, a stalled worker's too: a progress line does not
  wait for a worker that does not answer (`_Job.read_workers`), but the checkpoint after it
  does, so that no fault loses more than one checkpoint interval; past --stall_timeout_s the
  job restarts from the last one (`shared_input.SharedInput.watch`), and so does a save held by
  a stalled link past its limit (`save_watch`).
  """

  def __init__(self, job: "_Job"):
    super().__init__()
    self._job = job
    self._schedule = recovery.CheckpointSchedule(job.config.checkpoint_every_steps,
                                                 job.config.checkpoint_every_secs)
    self.saved = []

  def on_epoch_end(self, epoch, logs=None):
    steps = (epoch + 1) * epoch_steps(self._job.config)
    if steps >= self._job.total_steps:
      return  # the run's last checkpoint follows
    if self._schedule.due(steps):
      began = time.time()
      if self._job.pipeline is not None:
        # The steps still running first: the stall watchdog watches those; the save's own
        # calls after them, `save_watch`.
        self._job.pipeline.settle()
      with save_watch.watched(self._job.config.model_dir, self._job.config.stall_timeout_s):
        self.saved.append(self._job.save_checkpoint(periodic=True))
      self._job.checkpoint_seconds += time.time() - began
      self._schedule.written(steps)


class StopOnSignal(keras.callbacks.Callback):
  """Ends `fit` at the end of the interval running when SIGINT or SIGTERM arrived
  (tf_gba.common.interrupt): the steps scheduled finish, and the run writes its checkpoint."""

  def on_epoch_end(self, epoch, logs=None):
    if interrupt.requested() is not None:
      self.model.stop_training = True


class _Job:
  """Everything built for one run, so callbacks and evaluation can reach it."""

  def __init__(self, config: TrainConfig, strategy: GBAStrategy):
    self.config = config
    self.strategy = strategy
    self.phase_unix = {}  # when the run reached its phases (run_parameter_server)
    self.data_kwargs = config.data_kwargs()
    self.info = data_lib.data_info(config.data, **self.data_kwargs)
    with strategy.scope():
      self.model = models_lib.build_model(config.model, self.info,
                                          embedding_dim=config.embedding_dim, seed=config.seed,
                                          embedding=config.embedding,
                                          hash_options=config.hash_options())
      if config.mode == config_lib.ASYNC_TUNED:
        inner = keras.optimizers.Adagrad(config.async_tuned_learning_rate)
      else:
        inner = keras.optimizers.Adam(config.learning_rate)
      if config.mode == "async" and not config.async_staleness_stats:
        self.optimizer = inner
      else:
        self.optimizer = GBA(inner, num_aggregate=config.num_aggregate,
                             staleness_threshold=config.staleness_threshold,
                             sparse_normalize=config.sparse_normalize)
      # k worker steps per scheduled function (--steps_per_execution): the coordinator's cost
      # is per function.
      self.model.compile(self.optimizer, loss=keras.losses.BinaryCrossentropy(),
                         steps_per_execution=config.scheduled_steps)
      # Slots before restoring (a deferred restore of sharded slots cannot run on the PS), and
      # under the scope, so optimizers that read state before each step can register with it.
      self.optimizer.build(self.model.trainable_variables)
    self.checkpoint = tf.train.Checkpoint(model=self.model)
    self.manager = tf.train.CheckpointManager(self.checkpoint, config.model_dir,
                                              max_to_keep=config.keep_checkpoints)
    # --full_checkpoint_every=K > 1: the hash tables write deltas between full checkpoints
    # (tf_gba.training.delta_checkpoints); periodic checkpoints since the last full one.
    self.delta_tables = (delta_checkpoints.tables(self.model)
                         if config.full_checkpoint_every > 1 else [])
    for table in self.delta_tables:
      table.enable_incremental_checkpoints()
    self.latest_full = None
    self.latest_delta = None
    self._since_full = 0
    # Whatever mode and shard count wrote it (sync: every variable whole; another number of
    # parameter servers): parameters, slots, iterations, GBA tokens and row tags carry over. A
    # truncated newest checkpoint is passed over for the one before it.
    try:
      self.restored_from, self.skipped_checkpoints = preflight.restore_latest_usable(
          config.model_dir, lambda path: self._restore(strategy, path), _log)
      if self.restored_from:
        # The full checkpoint, then every delta after it: the newest state written (also when
        # this run writes full checkpoints only: a previous one may have written deltas).
        self.latest_full = self.restored_from
        self.latest_delta = delta_checkpoints.restore_deltas(
            config.model_dir, self.restored_from, lambda path: self._restore(strategy, path),
            preflight.UNREADABLE, _log)
        self.restored_from = self.latest_delta or self.restored_from
        for table in self.delta_tables:
          table.checkpoint_restored()
    except resharding.CheckpointMismatchError as e:
      raise preflight.InputError(preflight.restore_mismatch_message(config, e)) from None
    self.straggler_position = self._track_straggler_position(strategy)
    self.writer = scalars_lib.ScalarWriter(os.path.join(config.model_dir, "tensorboard"))
    self._eval_model = None
    self._eval_data = None
    self.shared_input = None  # the shared data list (--input=shared), set up by run()
    self.pipeline = None  # while fit runs: its epochs' ends do not wait (`pipelining`)
    # A progress line reads the workers' counters waiting for each only so long: a worker whose
    # link stalled is worked around, not waited for (`read_workers`).
    self._calls = bounded_calls.BoundedCalls(slow_interval.NO_ANSWER_S)
    # Seconds spent writing periodic checkpoints since the last progress line (a slow interval's
    # line says when one held the coordinator).
    self.checkpoint_seconds = 0.0

  def read_workers(self) -> List[dict]:
    """The workers' step counters, each waited for up to `slow_interval.NO_ANSWER_S`: one that
    did not answer by then is marked `no_answer` (and `unreachable`), its read left running."""
    return self.strategy.worker_step_stats(self._calls)

  @property
  def total_steps(self):
    return self.shared_input.total_steps if self.shared_input else self.config.steps

  def _restore(self, strategy, path):
    try:
      resharding.restore_training_state(path, self.model, self.optimizer)
    except resharding.CheckpointMismatchError:
      if self.config.mode != config_lib.ASYNC_TUNED:
        raise
      # Inherited from another mode's Adam: async_tuned keeps the parameters and starts its
      # own optimizer (Adagrad) afresh, as the paper's separately tuned Async does.
      self._restore_weights_only(strategy, path)

  def _restore_weights_only(self, strategy, path):
    """Model weights from a checkpoint written with Adam, whatever its shard layout."""
    with strategy.scope():
      donor = keras.optimizers.Adam()
      donor.build(self.model.trainable_variables)
    resharding.restore_training_state(path, self.model, donor)

  def _track_straggler_position(self, strategy):
    """Each worker's straggler position in the checkpoint; restored onto the workers.

    Transient draws hash (seed, worker, step) with a per-process step count, and a trace runs on
    a per-process clock: without this a resumed run would replay each worker's sequence from its
    start. In the checkpoint, as the data position (see track_data_position).
    """
    n = strategy.num_workers
    position = tf.Module(name="straggler_position")
    position.steps = tf.Variable(tf.zeros([n], tf.int64), trainable=False, name="steps")
    position.elapsed_ns = tf.Variable(tf.zeros([n], tf.int64), trainable=False,
                                      name="elapsed_ns")
    self.checkpoint.straggler_position = position
    saved = resharding.saved_module(self.restored_from, "straggler_position",
                                    ("steps", "elapsed_ns"))
    if saved and all(v.shape == (n,) for v in saved.values()):
      stragglers_lib.set_positions(saved["steps"], saved["elapsed_ns"])
      position.steps.assign(saved["steps"])
      position.elapsed_ns.assign(saved["elapsed_ns"])
    # Another worker count: worker i of this run is not worker i of that one; start afresh.
    return position

  def track_data_position(self, shared) -> None:
    """Puts the shared list's data position in the checkpoint, next to the model.

    In the checkpoint itself rather than in a file beside it: the position is then written in the
    same atomic write as the parameters it belongs to, numbered with them, and the checkpoint
    chosen on restore (the newest readable one) brings its own position. Variables of this
    process (the coordinator), outside the strategy: the parameter servers never see them.
    """
    position = tf.Module(name="data_position")
    position.seen = tf.Variable(tf.zeros([shared.num_batches], tf.int64), trainable=False,
                                name="seen")
    position.day = tf.Variable(-1 if self.config.day is None else int(self.config.day),
                               dtype=tf.int64, trainable=False, name="day")
    self.data_position = position
    self.checkpoint.data_position = position

  def restored_data_position(self, shared) -> Optional[np.ndarray]:
    """Per-batch trainings stored in the checkpoint restored, or None (none, or another list)."""
    saved = resharding.saved_module(self.restored_from, "data_position", ("seen", "day"))
    if saved is None:
      return None
    seen, day = saved["seen"], int(saved["day"])
    if seen.shape != (shared.num_batches,) or day != (-1 if self.config.day is None
                                                      else self.config.day):
      _log(f"tf_gba: the data position in {self.restored_from} is of another list (day {day}, "
           f"{seen.shape[0]} batches); this run's list starts from its beginning")
      return None
    return seen.astype(np.int64)

  def save_checkpoint(self, periodic: bool = False) -> str:
    """Writes a checkpoint numbered by global step (atomic: see PeriodicCheckpoint), once every
    step scheduled has finished. With hash-table deltas (--full_checkpoint_every=K), a periodic
    one is a delta unless it is the K-th since the last full one (or there is none yet); the
    run's last one is full."""
    if self.pipeline is not None:
      self.pipeline.settle()
    # A periodic checkpoint reads the workers' counters as a progress line does, waiting for each
    # only so long: a worker whose link stalled (its functions done, so nothing above waited
    # for it) is worked around, its position of the last checkpoint kept; read without a bound,
    # the coordinator waited out the stall, and no worker trained meanwhile. The run's last
    # checkpoint waits for every worker's counts.
    positions = self.read_workers() if periodic else self.strategy.worker_step_stats()
    answered = not any(w.get("no_answer") for w in positions)
    seen = None
    if (self.shared_input is not None and getattr(self, "data_position", None) is not None
        and answered):
      seen = self.shared_input.seen_total()
      # Unreadable while a worker restarts (or not answering, above): the position saved last
      # stays, behind the model, so a resumption trains some batches again rather than skipping
      # any.
      if seen is not None:
        self.data_position.seen.assign(seen)
    if all(w["position_step"] is not None for w in positions):
      self.straggler_position.steps.assign([w["position_step"] for w in positions])
      self.straggler_position.elapsed_ns.assign([w["position_elapsed_ns"] for w in positions])
    # (A worker restarted mid-run is unreachable here: the position saved last is kept.)
    step = int(self.optimizer.iterations.numpy())
    if seen is not None:
      # What the run has trained at least, as at a progress line: a checkpoint can come after
      # the last line (and a kill right after it), and the record must not be behind the
      # position a resumption restores.
      recovery.record_seen(self.config.model_dir, seen, step)
    latest = self.manager.latest_checkpoint
    if latest and latest.endswith(f"-{step}"):
      return latest  # nothing new since the last one
    if not self.delta_tables:
      # Numbered by global step: a resumed run adds a checkpoint instead of overwriting ckpt-1
      # (the save counter starts at 0 in every process).
      return self.manager.save(checkpoint_number=step)
    if (periodic and self.latest_full is not None
        and self._since_full + 1 < self.config.full_checkpoint_every):
      if self.latest_delta and self.latest_delta.endswith(f"-{step}"):
        return self.latest_delta
      self.latest_delta = delta_checkpoints.write_delta(
          self.checkpoint, self.delta_tables, self.config.model_dir, self.latest_full, step)
      self._since_full += 1
      return self.latest_delta
    self.latest_full = delta_checkpoints.save_full(self.manager, self.delta_tables,
                                                   self.config.model_dir, step)
    self.latest_delta = None
    self._since_full = 0
    return self.latest_full

  def dataset_fn(self, ctx: Optional[tf.distribute.InputContext]):
    """Worker i of N reads shard i of N of the training rows, as in synchronous training.

    ParameterServerStrategy traces this once for every worker and hands each the same
    InputContext (one input pipeline, id 0), so the worker's index is read where the pipeline
    runs, by the op that tells a worker its task index. Without it every worker would read the
    whole day in the same order and the workers' gradients of one step would be of the same
    batches.
    """
    cfg = self.config
    num_shards, shard_index = 1, 0
    if ctx is not None and ctx.num_input_pipelines > 1:
      num_shards, shard_index = ctx.num_input_pipelines, ctx.input_pipeline_id
    elif self.strategy.num_workers > 1:
      num_shards, shard_index = self.strategy.num_workers, worker_clock.worker_index()
    return data_pipeline.on_a_worker(data_lib.make_dataset(
        cfg.data, split="train", batch_size=cfg.local_batch_size, num_shards=num_shards,
        shard_index=shard_index, day=cfg.day, repeat=True, shuffle_seed=cfg.seed,
        strict=cfg.strict_data, **self.data_kwargs))

  def evaluate(self, checkpoint: Optional[str] = None) -> dict:
    """AUC and logloss on the eval split, with the current parameters copied to this process
    (through a snapshot), or with those of `checkpoint`, a checkpoint of this job's."""
    path = checkpoint or self.checkpoint.write(
        os.path.join(self.config.model_dir, "eval_snapshot", "ckpt"))
    model = self.model_at(path)
    if self._eval_data is None:
      feats, labels = [], []
      for x, y in eval_dataset(self.config, self.data_kwargs):
        feats.append(x)
        labels.append(y.numpy())
      self._eval_data = (feats, np.concatenate(labels) if labels else np.zeros(0))
    feats, labels = self._eval_data
    probs = np.concatenate([model(x, training=False).numpy().ravel() for x in feats])
    return {"auc": metrics.auc(labels, probs), "logloss": metrics.logloss(labels, probs),
            "examples": int(len(labels))}

  def model_at(self, checkpoint: str):
    """The model in this process, outside the strategy (unsharded: a checkpoint of the sharded
    one restores into it, TF saves sharded variables whole), with `checkpoint`'s parameters."""
    cfg = self.config
    if self._eval_model is None:
      self._eval_model = models_lib.build_model(cfg.model, self.info,
                                                embedding_dim=cfg.embedding_dim, seed=cfg.seed,
                                                embedding=cfg.embedding,
                                                hash_options=cfg.hash_options())
    tf.train.Checkpoint(model=self._eval_model).read(checkpoint).expect_partial()
    return self._eval_model


_NOT_EVALUATED = {"auc": float("nan"), "logloss": float("nan"), "examples": 0}


def _dispatcher_address(config: TrainConfig, cluster) -> str:
  return cluster.tfdata_dispatcher if cluster is not None else config.tfdata_dispatcher


def run(config: TrainConfig) -> dict:
  """Trains as `config` says and returns the summary (the mode's job: training/mode_registry)."""
  # Flags, data and model_dir, before any server starts: a fault is one line, not a traceback
  # from a worker a minute later.
  data_report = preflight.check(config)
  # TensorFlow's own INFO lines (cluster specs, closures) would bury the progress lines.
  tf.get_logger().setLevel("WARNING")
  absl_logging.set_verbosity(absl_logging.WARNING)
  os.makedirs(config.model_dir, exist_ok=True)
  mode = mode_registry.get(config.mode)
  if mode.kind != mode_registry.PARAMETER_SERVER:
    # The parameter-server job writes it after its restore, which may refuse the model_dir.
    preflight.write_metadata(config)
  result = mode.run(config)
  # The data scan's counts, added to the summary the job wrote and printed.
  result.update(summary_lib.data_fields(data_report))
  summary_lib.write(config.model_dir, result)
  return result


@contextlib.contextmanager
def _restart_if_lost(cluster, model_dir: str):
  """A parameter server lost (or unreachable) in the block is the job's loss (exit 75, the
  supervisor restarts the job) rather than an error that ends the command: around training, and
  around building the job, where (measured by the chaos drill) a parameter server killed while a
  restarted job created its variables ended the command with exit 1 (UnavailableError from
  `add_weight`). The workers and tf.data workers the local cluster restarted in place so far, or
  lost, go to the run's record first, for the resumed run's summary."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    _record_server_restarts(cluster, model_dir)
    recovery.raise_if_lost(e, cluster, jobs=("ps",))
    raise


# The servers a local cluster starts again in place when they die (a parameter server's death
# restarts the job instead); the summary counts them over the run's restarts.
_RESTARTED_IN_PLACE = ("worker", "tfdata_worker")


def _record_server_restarts(cluster, model_dir: str) -> None:
  """The workers and tf.data workers the local cluster restarted in place, or lost, in this run,
  to the run's record as the run ends before its target: the resumed run's summary counts them."""
  if cluster is not None:
    # A worker dead and not yet restarted (its failure reached the job first) is started again
    # with the job.
    recovery.record_server_restarts(model_dir, {
        job: cluster.restarts[job] + len(cluster.dead(job)) for job in _RESTARTED_IN_PLACE})


# How often the run's end asks again for a worker it cannot read (`_wait_for_unreadable_workers`).
_READ_AGAIN_S = 0.5


def _wait_for_unreadable_workers(job: "_Job", limit_s: float) -> List[dict]:
  """At the run's end, before its last reads: waits up to `limit_s` for every worker's counters;
  returns the workers' step counters read last (`GBAStrategy.worker_step_stats`).

  The final checkpoint's data position and the summary's per-worker counts are read from the
  workers. A worker that cannot be read then (its link stalled, its process being started again)
  reads as nothing: the checkpoint keeps the position saved before it, and the summary credits
  the worker with no batch. Measured by the short chaos drill: a worker's port dropped for 8 s
  that the run outlasted by less than a second; every batch that worker had trained (54) went
  uncounted. Such a worker comes back: the coordinator's worker thread finds it reachable again
  and creates its counters afresh, which `DayCounters.read_counts` carries over.
  """
  def read():  # (the step counters, the workers that cannot be read)
    stats = job.strategy.worker_step_stats()
    unreadable = [w["worker"] for w in stats if w.get("unreachable")]
    if not unreadable and job.shared_input is not None and job.shared_input.seen_total() is None:
      unreadable = [-1]  # a worker's data counters not yet created again
    return stats, unreadable

  stats, waiting = read()
  if not waiting:
    return stats
  named = ", ".join(f"worker:{w}" for w in waiting if w >= 0) or "a worker"
  _log(f"tf_gba: waiting up to {limit_s:.0f} s (--stall_timeout_s) for {named}, which cannot be "
       "read, before the final checkpoint")
  deadline = time.time() + limit_s
  while waiting and time.time() < deadline:
    time.sleep(_READ_AGAIN_S)
    stats, waiting = read()
  if waiting:
    _log(f"tf_gba: {named} still cannot be read: the final checkpoint keeps the data position "
         "saved last, and the summary lists it in data_list.unreadable_workers")
  return stats


class _Start(NamedTuple):
  """Where a parameter-server run starts (`_set_up`)."""
  job: "_Job"  # its config is that of what is left to train
  resume: recovery.Progress
  start_step: int  # the global step restored
  epochs: int  # to train; 0 for a run resumed at its target
  batches_reread: Optional[int]  # over the run's resumptions, where the data list counts them


def _set_up(config: TrainConfig, strategy, cluster, cluster_up_unix: float) -> _Start:
  """The parameter-server run's job: built and restored, its data list (if any) taken up at the
  checkpoint's position, and its place in the run (`recovery.begin`): a resumed run goes on to
  the target of the run it resumes."""
  job = _Job(config, strategy)
  # When the servers were up and when the model was built and restored, and (below) when the
  # final checkpoint began and was written: --mode=auto's account of a switch.
  job.phase_unix = {"started": cluster_up_unix, "restored": time.time()}
  # After the restore: a checkpoint of unknown origin that did not fit has raised by now.
  preflight.write_metadata(config)
  shared = None
  if config.uses_data_list:
    from tf_gba.training import shared_input  # pylint: disable=g-import-not-at-top
    shared = shared_input.SharedInput(config, strategy, _dispatcher_address(config, cluster),
                                      job.data_kwargs)
    shared.install_train_function(job.model)
    job.shared_input = shared
    job.track_data_position(shared)
  start_step = int(job.optimizer.iterations.numpy())
  _log(f"tf_gba: mode={config.mode} model={config.model} data={config.data} "
       f"ps={strategy.num_ps} workers={strategy.num_workers} M={config.num_aggregate} "
       f"local batch={config.local_batch_size} global batch={config.global_batch} "
       f"stragglers={config.stragglers}"
       + (f" (delay {config.straggler_delay})" if config.stragglers != "none" else "")
       + f" input={config.input}"
       + (f" ({shared.num_batches} batches in the list, "
          + ("one pass)" if shared.day_mode else f"{shared.list.passes} pass(es))")
          if shared else "")
       + (f" restored from {job.restored_from} (global step {start_step})"
          if job.restored_from else ""))
  # Where the run ends, in global steps; a rerun after a failure goes on to the same target.
  m = config.num_aggregate
  day_mode = shared is not None and shared.day_mode
  if day_mode:
    # One pass over the day: as many global steps as the list has batches, over M.
    resume = recovery.begin(config.model_dir, config.mode, None, start_step,
                            target_if_new=start_step + math.ceil(shared.num_batches / m))
    if resume.resumed:
      # The checkpoint's data position: the day goes on with the batches it had not trained.
      position = job.restored_data_position(shared)
      last = recovery.read_seen(config.model_dir)
      shared.resume(position if position is not None
                    else np.zeros([shared.num_batches], np.int64),
                    last_recorded=last if last is not None and
                    last.shape == (shared.num_batches,) else None)
      _log(f"tf_gba: resuming an interrupted day (restart {resume.restarts}) from global step "
           f"{start_step}: {len(shared.list.batch_order)} of the day's {shared.num_batches} "
           f"batches left to train ({shared.batches_reread} trained after the checkpoint are "
           "trained again)")
    epochs = math.ceil(shared.max_steps / epoch_steps(config))
  else:
    run_steps = math.ceil(config.steps / epoch_steps(config)) * epoch_steps(config)
    resume = recovery.begin(config.model_dir, config.mode, config.steps, start_step,
                            target_if_new=start_step + run_steps // m)
    if resume.resumed:
      left = max(0, resume.target_global_step - start_step) * m
      _log(f"tf_gba: resuming an interrupted run (restart {resume.restarts}): global step "
           f"{start_step} of {resume.target_global_step}, {left} worker steps left, "
           f"{resume.steps_redone} global steps redone so far")
      job.config = config = dataclasses.replace(config, steps=max(left, 1))
      if shared is not None:
        shared.config = config
        # The list taken up at the pass and position of the checkpoint (see
        # DataList.skip_trained), with passes added if the steps left need them.
        position = job.restored_data_position(shared)
        if position is not None:
          last = recovery.read_seen(config.model_dir)
          shared.resume(position, last_recorded=last if last is not None and
                        last.shape == position.shape else None,
                        min_entries=shared.entries_for(left))
    epochs = math.ceil(config.steps / epoch_steps(config)) if not (
        resume.resumed and resume.target_global_step <= start_step) else 0
  if shared is not None and not epochs:
    # Resumed at its target (the job died after its last checkpoint, before the run was
    # recorded finished): nothing is left to train, and the data list's per-worker counters,
    # which the first step creates, do not exist. The evaluation is what is left.
    _log("tf_gba: the run had trained to its target global step; evaluating it")
    job.shared_input = shared = None
  batches_reread = None
  if shared is not None and shared.batches_reread is not None:
    # Recorded now: a resumption that fails in turn still counts what it re-read.
    batches_reread = recovery.add_batches_reread(config.model_dir, shared.batches_reread)
  return _Start(job, resume, start_step, epochs, batches_reread)


def run_parameter_server(config: TrainConfig, callbacks=()) -> dict:
  """A parameter-server mode's run: GBAStrategy, model.fit; writes and prints the summary.

  `callbacks`: more Keras callbacks for `fit` (called after the progress line of each interval,
  each with `.job`, this run's `_Job`, set before training); one that sets `model.stop_training`
  ends the run there, checkpointed and summarized as a full one (--mode=auto's stays).
  """
  config = config.resolved()
  with _cluster(config) as (resolver, cluster):
    cluster_up_unix = time.time()
    strategy = make_strategy(config, resolver)
    recovery.quiet_executors_of_a_lost_server()  # after a lost parameter server
    # A parameter server killed while the job builds, restores and takes up its data list is the
    # job's loss too (the chaos drill: ps:0 killed while a restarted job created the rerun
    # ledger's variable ended the command with exit 1, UnavailableError).
    with _restart_if_lost(cluster, config.model_dir):
      job, resume, start_step, epochs, batches_reread = _set_up(config, strategy, cluster,
                                                                cluster_up_unix)
    config, shared, m = job.config, job.shared_input, config.num_aggregate
    progress = _Progress(job)
    extra_callbacks, callbacks = list(callbacks), [progress]
    periodic = None
    if config.checkpoint_every_steps or config.checkpoint_every_secs:
      periodic = PeriodicCheckpoint(job)
      callbacks.append(periodic)
    for extra in extra_callbacks:
      extra.job = job
      callbacks.append(extra)
    callbacks.append(StopOnSignal())
    t0 = time.time()
    history = keras.callbacks.History()
    history.history = {}
    with _restart_if_lost(cluster, config.model_dir):
      if shared is not None:
        history = fit_shared(job.model, job.optimizer, shared, epochs, callbacks,
                             epoch_steps(config), job=job)
        epochs = max(1, len(history.history.get("loss", [])))
      elif epochs:
        history = _fit(job.model, strategy,
                       keras.utils.experimental.DatasetCreator(job.dataset_fn), epochs,
                       epoch_steps(config), callbacks, job=job)
        # Fewer when a callback stopped the run early.
        epochs = max(1, len(history.history.get("loss", [])))
    if interrupt.requested() is not None:
      _record_server_restarts(cluster, config.model_dir)
      _stop_on_signal(job)
    t1 = time.time()
    worker_stats = _wait_for_unreadable_workers(job, config.stall_timeout_s)
    # Throughput over the steady state: the first interval pays for tracing and start-up.
    if epochs > 1 and progress.warm is not None:
      warm_time, warm_steps, warm_workers = progress.warm
      wall, steps_measured = t1 - warm_time, epochs * epoch_steps(config) - warm_steps
      for w, w0 in zip(worker_stats, warm_workers):
        w["measured_steps"] = w["steps"] - w0["steps"]
        w["measured_in_step_seconds"] = (stragglers_lib.in_step_seconds(w)
                                          - stragglers_lib.in_step_seconds(w0))
        if w0.get("unreachable") or (w0["first_step_unix"] and
                                     w["first_step_unix"] != w0["first_step_unix"]):
          w["restarted"] = True  # another process than at the warm read (its first step differs)
    else:
      wall, steps_measured = t1 - t0, epochs * epoch_steps(config)
      for w in worker_stats:
        w["measured_steps"] = w["steps"]
        w["measured_in_step_seconds"] = stragglers_lib.in_step_seconds(w)
    for w in worker_stats:
      if cluster is not None and f"worker:{w['worker']}" in cluster.restarted_tasks:
        w["restarted"] = True  # the local cluster started it again (the counters may not say)
      if w.get("unreachable") or w.get("restarted"):
        # A worker restarted during the run: its new process counts from zero, and one that
        # could not be read reads as zeros, so its rate over the window is unknown (not the
        # difference of two unrelated counts).
        w["measured_steps"] = w["measured_in_step_seconds"] = None
    stats = _optimizer_stats(job.optimizer)
    stats["hop_bs"] = strategy.hop_bs_stats()
    stats["hop_bw"] = strategy.hop_bw_stats()
    # The trained model is saved before anything that can still fail (the evaluation, its
    # snapshot, the summary): a failure there loses no step.
    job.phase_unix["checkpoint_begin"] = time.time()
    saved = job.save_checkpoint()
    job.phase_unix["saved"] = time.time()
    # After the save, which evicts first: the tables as the checkpoint holds them.
    tables = _tables_after_training(job, cluster)
    recovery.report(config.model_dir, stats["global_step"], finished=True)
    # A callback that ended the run to hand over to another job (--mode=auto) skips the
    # evaluation and the export: the job that continues makes them.
    handing_over = any(getattr(c, "skip_evaluation", False) for c in extra_callbacks)
    if not handing_over:
      final_export(job, config, stats["global_step"], saved)
    evaluation = _NOT_EVALUATED if handing_over else final_evaluation(job.evaluate, saved, cluster)
    if shared is not None:
      # Only steps that trained a batch run the strategy's step and count on their worker;
      # the no-op reads at the end of the list do not.
      if all(w["measured_steps"] is not None for w in worker_stats):
        steps_measured = sum(w["measured_steps"] for w in worker_stats)
    summary = _summary(config, strategy, history, stats, worker_stats, evaluation, wall,
                       steps_measured, t1 - t0, start_step, saved, progress.last_loss)
    if shared is not None:
      _add_data_list(summary, shared.report(), config,
                     (cluster.restarts["worker"] + len(cluster.dead("worker"))
                      if cluster is not None else None))
    summary["embedding"] = config.embedding
    summary["steps_per_execution"] = config.scheduled_steps
    if tables:
      summary["hash_tables"] = tables
    summary["skipped_checkpoints"] = job.skipped_checkpoints
    summary["periodic_checkpoints"] = len(periodic.saved) if periodic else 0
    summary.update(summary_lib.log_fields(config))
    summary.update({
        "target_global_step": resume.target_global_step, "restarts": resume.restarts,
        "restart_causes": resume.restart_causes,
        "steps_redone": resume.steps_redone,
        # Worker batches computed again: with the shared list counted from the batch ids (since
        # the last progress line of the failed run, as steps_redone); otherwise those of the
        # global steps redone.
        "batches_reread": (batches_reread if batches_reread is not None
                           else resume.steps_redone * m),
        # Those of the failed runs before this one too (their local clusters').
        **{f"{job}_restarts": resume.server_restarts.get(job, 0) + (
            cluster.restarts[job] if cluster is not None else 0)
           for job in _RESTARTED_IN_PLACE}})
    job.writer.write(epochs * epoch_steps(config),
                     {"eval/auc": evaluation["auc"], "eval/logloss": evaluation["logloss"]},
                     flush=True)
    summary_lib.write(config.model_dir, summary)
    summary_lib.print_summary(summary)
    return summary


def _stop_on_signal(job: "_Job") -> None:
  """After `fit` ended at a signal: writes the checkpoint of the steps trained (every step
  scheduled has finished), records it as the run's progress, so that a rerun resumes from it
  with nothing trained again, and raises interrupt.Interrupted."""
  saved = job.save_checkpoint()
  step = int(job.optimizer.iterations.numpy())
  if job.shared_input is not None:
    seen = job.shared_input.seen_total()
    if seen is not None:
      recovery.record_seen(job.config.model_dir, seen, step)
  recovery.report(job.config.model_dir, step)
  job.writer.flush()
  raise interrupt.Interrupted(interrupt.requested(), saved, step)


def final_export(job: "_Job", config: TrainConfig, global_step: int, saved: str) -> None:
  """The serving SavedModel (`--export_dir`) of the run's last checkpoint `saved`, read into this
  process: the export needs no server of the job, so a parameter server lost after that
  checkpoint costs it nothing. A failure (a full disk, an unwritable directory) is one line that
  says the model is safe."""
  if export_lib.export_dir(config.model_dir, config.export_dir) is None:
    return
  try:
    export_lib.export_after_run(job.model_at(saved), config, global_step)
  except (OSError, ValueError, tf.errors.OpError) as e:
    raise recovery.AfterTrainingError(
        f"training finished and its checkpoint {saved} was written, but the serving export "
        f"failed: {preflight.first_line(e)[:300]}. Fix that (or pass --export_dir= for none) and "
        "export the checkpoint.") from e


def _lost_after_training(error: Exception, cluster) -> Optional[str]:
  """The parameter servers `error` says are gone (a dead local server, or an unreachable one
  named in it), as "ps:0, ..."; None where it is another failure."""
  try:
    recovery.raise_if_lost(error, cluster, jobs=("ps",))
  except recovery.ParameterServerLost:
    dead = ", ".join(cluster.dead("ps")) if cluster is not None else ""
    return dead or "a parameter server"
  except recovery.JobLost:
    pass  # another server's trouble
  return None


def _tables_after_training(job: "_Job", cluster) -> dict:
  """The hash tables' sizes for the summary (`hash_tables.report`), read from the servers; {}
  with one line where a parameter server died after the run's last checkpoint."""
  try:
    return hash_tables.report(job.model, job.optimizer)
  except tf.errors.OpError as e:
    dead = _lost_after_training(e, cluster)
    if dead is None:
      raise
    _log(f"tf_gba: {dead} died after the run's last checkpoint; the summary has no hash table "
         "sizes (the checkpoint holds the tables).")
    return {}


def final_evaluation(evaluate, saved: str, cluster=None) -> dict:
  """`evaluate()`, after the run's last checkpoint `saved` was written: a failure (a full disk
  under the eval snapshot, an unreadable eval file) is one line that says the model is safe.

  A parameter server lost by then (the chaos drill killed one while the last checkpoint was
  written: the command ended with exit 1 and a line asking to evaluate by hand) takes nothing
  the evaluation needs: `saved` holds the model, and is evaluated instead, with one line."""
  try:
    try:
      return evaluate()
    except tf.errors.OpError as e:
      dead = _lost_after_training(e, cluster)
      if dead is None:
        raise  # the evaluation failed, as any other failure
      _log(f"tf_gba: {dead} died after the run's last checkpoint; the final evaluation reads "
           f"that checkpoint ({saved}) instead.")
      return evaluate(checkpoint=saved)
  except (OSError, ValueError, tf.errors.OpError) as e:
    raise recovery.AfterTrainingError(
        f"training finished and its checkpoint {saved} was written, but the final evaluation "
        f"failed: {preflight.first_line(e)[:300]}. Fix that and evaluate the checkpoint (a "
        "rerun of the same command finds the run finished and trains --steps more).") from e


def _fit(model, strategy, data, epochs: int, steps_per_epoch: int, callbacks=(), job=None):
  """`model.fit` whose epochs' ends let the workers run on (`pipelining`); returns once every
  step it scheduled has finished. `job`: the run's `_Job`, whose checkpoints wait for the steps
  running (`_Job.save_checkpoint`)."""
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  with pipelining.Pipeline(model, coordinator, spare=strategy.num_workers) as pipeline:
    if job is not None:
      job.pipeline = pipeline
    try:
      with data_pipeline.device_iterators_on_a_worker():
        history = model.fit(data, epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0,
                            callbacks=list(callbacks))
      pipeline.settle()
    finally:
      if job is not None:
        job.pipeline = None
  return history


def fit_shared(model, optimizer, shared, epochs: int, callbacks=(), steps_per_epoch=None,
               job=None):
  """model.fit on the shared data list (`shared_input.SharedInput`): ends at the end of the
  list (then completes a partial GBA step), after `epochs` epochs, or at a stall."""
  shared.watch()
  try:
    history = _fit(model, shared.strategy,
                   shared.dataset_creator(), epochs,
                   steps_per_epoch or shared.config.log_every, [*callbacks, shared.callback()],
                   job=job)
  except Exception as e:  # pylint: disable=broad-except
    if shared.stalled is None:
      raise
    if not shared.day_mode:
      # A run of --steps has a target to reach: a stall (a server that stopped answering, a
      # stalled link) restarts the job from its last checkpoint instead of ending it short.
      raise recovery.Stalled(f"{shared.stalled}; restarting the job from its last "
                             "checkpoint") from e
    _log(f"tf_gba: the day ended early: {shared.stalled} ({type(e).__name__})")
    history = model.history
  finally:
    shared.stop_watching()
  if shared.day_mode and shared.stalled is None and interrupt.requested() is None:
    flushed = shared.flush_partial_step(model, optimizer)
    if flushed:
      _log(f"tf_gba: end of the day: the last global step completed with {flushed} zero "
           "gradient(s) (what was buffered, divided by M)")
  return history


def _add_data_list(summary: dict, report: dict, config: TrainConfig,
                   workers_restarted: Optional[int] = None) -> None:
  """The shared list's counts in the summary; its steps and examples are what trained (the
  steps of a fixed count that found the list empty trained nothing). `workers_restarted`: the
  workers this run's local cluster restarted in place or lost (None: not known, a real
  cluster)."""
  summary["input"] = "shared"
  summary["data_list"] = report
  for w in summary["per_worker"]:
    w["batches"] = report["per_worker_batches"][w["worker"]]
    w["examples"] = report["per_worker_examples"][w["worker"]]
  summary["steps"] = report["batches"]
  summary["examples"] = report["examples"]
  summary["duplicates"] = report["duplicates"]
  summary["missed"] = report["missed"]
  if config.mode in ("gba", "async") and report.get("restored_batches"):
    # There every push takes a token and M tokens make a global step, so the checkpoint resumed
    # from was written after start_global_step x M trained batches. Those its data position does
    # not count (a worker restarted in place trained them after the coordinator's last read of
    # its counts) were listed again and trained twice: re-reads the summary reports here.
    report["uncounted_batches"] = max(
        0, summary["start_global_step"] * summary["num_aggregate"] - report["restored_batches"])
  if config.mode in ("gba", "async") and not report.get("flushed_zero_gradients"):
    # This run's pushes (one per trained batch) against the batches its workers' counts hold:
    # a worker restarted in place lost, with its process, the count of what it trained after
    # the coordinator's last read of it (a progress line), at most that line's interval and
    # the function it was running. Anything else is a miscount, reported as it is.
    pushes = (summary["global_step"] - summary["start_global_step"]) * summary["num_aggregate"]
    report["workers_restarted_in_run"] = workers_restarted
    report["uncounted_by_restarted_workers"] = pushes - report["batches"]


def _optimizer_stats(optimizer) -> dict:
  if isinstance(optimizer, GBA):
    return optimizer.stats()
  # The bare optimizer (plain async): no buffers, so no staleness or drop counters.
  return {"global_step": int(optimizer.iterations.numpy()), "dense": None,
          "dense_all_variables": None, "sparse": None}


def _summary(config, strategy, history, stats, worker_stats, evaluation, wall, steps_measured,
             total_wall, start_step, saved, last_loss=None) -> dict:
  steps_run = epoch_steps(config) * len(history.history.get("loss", []))
  dense = stats["dense"] or {}
  dense_all = stats["dense_all_variables"] or {}
  sparse = stats["sparse"] or {}
  per_worker = [{"worker": w["worker"], "steps": w["steps"],
                 "qps": (None if w["measured_steps"] is None
                         else w["measured_steps"] * config.local_batch_size / wall),
                 # The rest of the measured wall time the worker was between steps: the step's
                 # dispatch and result, its input read, a barrier's wait (Hop-BS, Hop-BW), and the
                 # wait at each checkpoint.
                 "in_step_fraction": (None if w.get("measured_in_step_seconds") is None
                                      else round(w["measured_in_step_seconds"] / wall, 4)),
                 "injected_delay_seconds": round(w["delay_seconds"], 3),
                 # The worker process's longest timed step (a restarted one's since then).
                 "max_step_seconds": round(w["max_step_seconds"], 4)}
                for w in worker_stats]
  hop_bs = stats.get("hop_bs")
  if hop_bs:
    for w in per_worker:
      w["blocked_seconds"] = round(hop_bs["blocked_seconds"][w["worker"]], 3)
      w["barrier_timeouts"] = int(hop_bs["timeouts"][w["worker"]])
  hop_bw = stats.get("hop_bw")
  if hop_bw:
    for w in per_worker:
      i = w["worker"]
      w["blocked_seconds"] = round(hop_bw["blocked_seconds"][i], 3)
      # Gradients pushed, and steps released at the end of a fit that pushed nothing.
      w["gradients"] = hop_bw["gradients"][i]
      w["released_steps"] = hop_bw["released"][i]
      w["repeated_versions"] = hop_bw["duplicates"][i]
  return summary_lib.new(
      config,
      num_ps=strategy.num_ps, num_workers=strategy.num_workers,
      num_aggregate=config.num_aggregate, local_batch_size=config.local_batch_size,
      global_batch_size=config.global_batch, stragglers=config.stragglers,
      straggler_delay=config.straggler_delay, sparse_normalize=config.sparse_normalize,
      steps=steps_run, examples=steps_run * config.local_batch_size,
      wall_seconds=total_wall,
      global_qps=steps_measured * config.local_batch_size / wall,
      qps_measured_over_steps=steps_measured,
      per_worker=per_worker,
      global_step=stats["global_step"], start_global_step=start_step,
      pushes=dense.get("pushes", steps_run),
      mean_staleness=dense.get("mean_staleness", 0.0),
      max_staleness=dense.get("staleness_max", 0),
      staleness_histogram=dense.get("histogram", []),
      dropped_batches=dense.get("dropped", 0),
      dropped_gradients=dense_all.get("dropped", 0),
      dropped_embedding_rows=sparse.get("dropped", 0),
      nonfinite_gradients=dense_all.get("nonfinite", 0) + sparse.get("nonfinite", 0),
      duplicate_pushes=dense.get("duplicates", 0),
      # Hop-BW: gradients of an older version, ignored without taking a place in a step.
      ignored_gradients=dense.get("dropped", 0) if config.mode == "hop_bw" else 0,
      # Hop-BS: time workers spent blocked at the bounded-staleness barrier.
      blocked_seconds=(round(sum(hop_bs["blocked_seconds"]), 3) if hop_bs else
                       round(sum(hop_bw["blocked_seconds"]), 3) if hop_bw else 0.0),
      max_lead=hop_bs["max_lead"] if hop_bs else None,
      # The progress lines' loss (that of the last epoch that trained); Keras's last epoch may
      # be one of the shared list's no-op reads, whose loss is its reset metric.
      final_train_loss=(last_loss if last_loss is not None else
                        history.history["loss"][-1] if history.history.get("loss") else None),
      eval_auc=evaluation["auc"], eval_logloss=evaluation["logloss"],
      eval_examples=evaluation["examples"], checkpoint=saved,
  )


# Kept under its old name for callers of the runner.
print_summary = summary_lib.print_summary
