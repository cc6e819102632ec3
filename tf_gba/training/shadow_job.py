"""`--mode=shadow_easgd|shadow_ma|shadow_bmuf|asgd_nodelay`: dense replicas per worker.

ShadowSync (SPEC section 4) and ASGD without gradient delay (SPEC section 5) on a real
parameter-server cluster (tf_gba.distribute.shadow_runtime says how the replicas are held):

- Embeddings (the models' `FieldEmbedding` tables) live on the parameter servers and every step
  applies its embedding gradient there at once with the job's optimizer (Adam, slots on the
  PS), asynchronously, as async mode does. ASGD without gradient delay treats a dense model; for
  a CTR model the natural reading, the one taken here, is the same as ShadowSync's: only the
  dense parameters follow Algorithm 1, the embeddings stay asynchronous on the PS.
- Every other variable (the dense part) is replicated: worker i trains its replica locally with
  its own Adam (slots on the worker).
- shadow_*: background synchroniser threads. S-EASGD: one per worker, exchanging with the
  "sync PS" copy (the PS-hosted dense variables of the checkpoint model); S-MA and S-BMUF: one
  thread running rounds over all workers (a PS-hosted average: every replica is read, averaged
  on parameter server 0, and every worker pulls towards it). A sync starts as soon as the
  previous one is done and its worker (for a round: every worker) has stepped since its last
  sync; no rate is set. Each sync is recorded per worker.
- asgd_nodelay: a master thread merges when every worker has at least one local gradient; a
  worker rebases onto a new PS model and hands in its update between two of its own steps, and
  waits only when its staleness reaches tau. Algorithm 2 (cycles of tau / 2) is the option
  `asgd_algorithm=2`.

The final model is the average of the replicas: after training, a last sync sets the PS-hosted
dense variables and every replica to it (their Adam slots are averaged too), and that model is
evaluated and checkpointed. The checkpoint model is the same tf_keras model compiled with Adam as
in the other modes (same object graph: model -> layers -> variables, model -> optimizer ->
slots), so a checkpoint of sync, gba or async restores into it and its checkpoint restores there.
"""

import os
import threading
import time
from typing import Dict, List

import numpy as np
import tensorflow as tf
import tf_keras as keras

from tf_gba import data as data_lib
from tf_gba.common import interrupt
from tf_gba.common import metrics
from tf_gba import models as models_lib
from tf_gba.distribute import LocalCluster
from tf_gba.distribute import shadow_runtime as rt
from tf_gba.distribute import stragglers as stragglers_lib
from tf_gba.optimizers import asgd_nodelay
from tf_gba.optimizers import shadow_sync
from tf_gba.training import preflight
from tf_gba.training import recovery
from tf_gba.training import resharding
from tf_gba.training import summary as summary_lib
from tf_gba.training.evaluation import eval_dataset
from tf_gba.training.shard_position import ShardPosition

SHADOW_MODES = ("shadow_easgd", "shadow_ma", "shadow_bmuf")
MODES = SHADOW_MODES + ("asgd_nodelay",)


def validate(config) -> None:
  """Raises ValueError (one line, naming the flag) for settings these modes cannot run."""
  if config.mode not in MODES:
    return
  if not 0.0 < config.shadow_alpha <= 1.0:
    raise ValueError(f"--shadow_alpha must be in (0, 1], got {config.shadow_alpha}.")
  if config.mode == "shadow_bmuf":
    shadow_sync.check_bmuf(config.shadow_bmuf_eta, config.shadow_bmuf_momentum)
  if config.mode == "asgd_nodelay":
    asgd_nodelay.check_tau(config.asgd_tau, config.asgd_algorithm)
  if config.shadow_sync_delay_ms < 0:
    raise ValueError(f"--shadow_sync_delay_ms must be >= 0, got {config.shadow_sync_delay_ms}.")


def _log(msg: str) -> None:
  print(msg, flush=True)


class ReplicatedModel:
  """The checkpoint model (embeddings and dense on the PS) and one dense replica per worker."""

  def __init__(self, config, info, num_workers: int, num_ps: int):
    cfg = config
    self.num_workers = num_workers
    created: List[tf.Variable] = []

    def master_creator(next_creator, **kwargs):
      # Round-robin over the parameter servers, in creation order.
      with tf.device(rt.ps_device(len(created) % num_ps)):
        v = next_creator(**kwargs)
      created.append(v)
      return v

    with tf.variable_creator_scope(master_creator):
      self.master = models_lib.build_model(cfg.model, info, embedding_dim=cfg.embedding_dim,
                                           seed=cfg.seed)
    shared = {id(w) for layer in self.master.layers
              if isinstance(layer, models_lib.FieldEmbedding) for w in layer.weights}
    self.embeddings = [v for v in self.master.trainable_variables if id(v) in shared]
    self.dense = [v for v in self.master.trainable_variables if id(v) not in shared]
    self.replicas, self.replica_dense = [], []
    for i in range(num_workers):
      position = [0]

      def replica_creator(next_creator, i=i, position=position, **kwargs):
        k = position[0]
        position[0] += 1
        if k < len(created) and id(created[k]) in shared:
          return created[k]  # the one table on the PS, shared by every replica
        with tf.device(rt.worker_device(i)):
          return next_creator(**kwargs)

      with tf.variable_creator_scope(replica_creator):
        replica = models_lib.build_model(cfg.model, info, embedding_dim=cfg.embedding_dim,
                                         seed=cfg.seed)
      dense = [v for v in replica.trainable_variables if id(v) not in shared]
      if [v.shape for v in dense] != [v.shape for v in self.dense]:
        raise RuntimeError("a replica's dense variables differ from the model's.")
      self.replicas.append(replica)
      self.replica_dense.append(dense)
    # The job's optimizer: the checkpoint's (model -> optimizer), and the one that updates the
    # embeddings on the PS (its slots are colocated with them).
    # Its own variables (step, learning rate) on parameter server 0, where the embedding updates
    # run; slots go with their variables. No XLA: the updates run on remote CPU devices.
    with tf.device(rt.ps_device(0)):
      self.optimizer = keras.optimizers.Adam(cfg.learning_rate, jit_compile=False)
      self.master.compile(self.optimizer, loss=keras.losses.BinaryCrossentropy())
      self.optimizer.build(self.master.trainable_variables)
    self.local_optimizers = []
    for i in range(num_workers):
      with tf.device(rt.worker_device(i)):
        opt = keras.optimizers.Adam(cfg.learning_rate, jit_compile=False)
        opt.build(self.replica_dense[i])
      self.local_optimizers.append(opt)
    self._build_saved_model(cfg, info, created, shared)

  def _build_saved_model(self, cfg, info, created, shared) -> None:
    """The model every checkpoint is written from, periodic and final.

    It has the checkpoint model's object graph (so sync, gba and async restore it) and shares
    its embedding tables and their Adam slots, but holds a dense part of its own, which
    `snapshot` fills with the replicas' average. The checkpoint model's own dense variables are
    the synchronisers' (S-EASGD's sync PS copy, S-BMUF's global model, ASGD's PS model): a
    checkpoint written while the workers train must not overwrite them.
    """
    position = [0]

    def saved_creator(next_creator, **kwargs):
      k = position[0]
      position[0] += 1
      if id(created[k]) in shared:
        return created[k]
      with tf.device(created[k].device):
        return next_creator(**kwargs)

    with tf.variable_creator_scope(saved_creator):
      self.saved = models_lib.build_model(cfg.model, info, embedding_dim=cfg.embedding_dim,
                                          seed=cfg.seed)
    self.saved_dense = [v for v in self.saved.trainable_variables if id(v) not in shared]
    embedding_slots = {}
    for e in self.embeddings:
      for name, slot in zip(("m", "v"), self._slots(self.optimizer, e)):
        embedding_slots[(id(e), name)] = slot
    with tf.device(rt.ps_device(0)):
      self.saved_optimizer = _adam_sharing_slots(cfg.learning_rate, embedding_slots)
      self.saved.compile(self.saved_optimizer, loss=keras.losses.BinaryCrossentropy())
      self.saved_optimizer.build(self.saved.trainable_variables)
    self._snapshot = rt.completed_function(self._snapshot_fn)

  def _snapshot_fn(self) -> None:
    n = float(self.num_workers)
    self.saved_optimizer.iterations.assign(self.optimizer.iterations.read_value())
    for k, sv in enumerate(self.saved_dense):
      with tf.device(sv.device):
        sv.assign(tf.add_n([r[k].read_value() for r in self.replica_dense]) / n)
        for j, slot in enumerate(self._slots(self.saved_optimizer, sv)):
          slot.assign(tf.add_n([self._slots(o, r[k])[j].read_value()
                                for o, r in zip(self.local_optimizers, self.replica_dense)]) / n)

  def snapshot(self) -> None:
    """The saved model's dense part (and its Adam slots) := the replicas' average, read while
    they train; its step := the job's. Embeddings are shared, nothing to copy."""
    self._snapshot()

  # Adam's slots of a variable, in a fixed order (m, v).
  @staticmethod
  def _slots(opt, var) -> List[tf.Variable]:
    k = opt._index_dict[opt._var_key(var)]  # pylint: disable=protected-access
    return [opt._momentums[k], opt._velocities[k]]  # pylint: disable=protected-access

  def broadcast(self) -> None:
    """Every replica (and its Adam) starts from the checkpoint model's dense part."""
    step = self.optimizer.iterations.read_value()
    for i in range(self.num_workers):
      opt = self.local_optimizers[i]
      opt.iterations.assign(step)
      for mv, rv in zip(self.dense, self.replica_dense[i]):
        rv.assign(mv.read_value())
        for ms, rs in zip(self._slots(self.optimizer, mv), self._slots(opt, rv)):
          rs.assign(ms.read_value())

  def average_into_master(self) -> None:
    """The final model: the dense part (and its Adam slots) is the average of the replicas,
    written to the checkpoint model and to every replica."""
    n = float(self.num_workers)
    for k, mv in enumerate(self.dense):
      with tf.device(mv.device):
        mean = tf.add_n([r[k].read_value() for r in self.replica_dense]) / n
        slot_means = [tf.add_n([self._slots(o, r[k])[j].read_value()
                                for o, r in zip(self.local_optimizers, self.replica_dense)]) / n
                      for j in range(2)]
      mv.assign(mean)
      for ms, sm in zip(self._slots(self.optimizer, mv), slot_means):
        ms.assign(sm)
      for r in self.replica_dense:
        r[k].assign(mean)

  def spread(self) -> float:
    """Mean over workers of ||w_i - mean_j w_j|| (all dense variables as one vector)."""
    flat = [np.concatenate([v.numpy().ravel() for v in r]) for r in self.replica_dense]
    mean = np.mean(flat, axis=0)
    return float(np.mean([np.linalg.norm(f - mean) for f in flat]))


def _adam_sharing_slots(learning_rate: float, shared_slots: Dict) -> keras.optimizers.Adam:
  """An Adam whose slots of the variables in `shared_slots` ({(id(var), "m" or "v"): slot}) are
  those slots, not new ones: the saved model's optimizer, holding the embedding tables' Adam
  state once (on the parameter servers) in the same checkpoint layout."""

  class SharingAdam(keras.optimizers.Adam):

    def add_variable_from_reference(self, model_variable, variable_name, shape=None,
                                    initial_value=None):
      slot = shared_slots.get((id(model_variable), variable_name))
      if slot is None:
        return super().add_variable_from_reference(model_variable, variable_name, shape,
                                                   initial_value)
      self._variables.append(slot)  # where the base class keeps what it creates
      return slot

  return SharingAdam(learning_rate, jit_compile=False)


def _step_function(rm: ReplicatedModel, i: int, profile: str, seed: int):
  replica, dense = rm.replicas[i], rm.replica_dense[i]
  local_opt, emb_opt = rm.local_optimizers[i], rm.optimizer
  loss_fn = keras.losses.BinaryCrossentropy()
  n_emb = len(rm.embeddings)

  @tf.function
  def step(features, labels):
    start = stragglers_lib.step_begin()
    with tf.control_dependencies([start]):
      with tf.GradientTape() as tape:
        probs = replica(features, training=True)
        loss = loss_fn(labels, probs)
    grads = tape.gradient(loss, rm.embeddings + dense)
    # Embeddings: applied on the PS at once (asynchronous); dense: this worker's replica.
    emb_opt.apply_gradients(zip(grads[:n_emb], rm.embeddings))
    local_opt.apply_gradients(zip(grads[n_emb:], dense))
    with tf.control_dependencies([local_opt.iterations.read_value(),
                                  emb_opt.iterations.read_value()]):
      delay = stragglers_lib.step_end(start, profile, seed)
    with tf.control_dependencies([delay]):
      return tf.identity(loss)

  return step


class _Sleep:
  """The injected sync delay, interruptible by the end of training."""

  def __init__(self, ms: float, stop: threading.Event):
    self.s, self.stop = ms / 1000.0, stop

  def __call__(self):
    if self.s:
      self.stop.wait(self.s)


def _snapshots(rm: ReplicatedModel) -> List[List[tf.Variable]]:
  """Per worker, variables beside its replica that hold what the synchroniser read."""
  out = []
  for i, dense in enumerate(rm.replica_dense):
    with tf.device(rt.worker_device(i)):
      out.append([tf.Variable(tf.zeros_like(v), trainable=False, name=f"shadow_snapshot_{k}")
                  for k, v in enumerate(dense)])
  return out


def _shadow_syncers(config, rm: ReplicatedModel, counters, log: rt.SyncLog,
                    stop: threading.Event):
  """The background sync loop bodies of a ShadowSync mode.

  A sync is two function calls: one reads the replica(s) into snapshot variables, the other
  does the rest in one multi-device function (the PS side, then the workers' pulls, in program
  order). Values pass through variables, never as tensor handles from one remote call to the
  next. The injected delay (tests, benchmarks) sits between the two, holding the sync in flight.
  """
  alpha, n = config.shadow_alpha, rm.num_workers
  sleep = _Sleep(config.shadow_sync_delay_ms, stop)
  snaps = _snapshots(rm)

  def reader(workers):
    @rt.completed_function
    def read():
      for i in workers:
        for s, w in zip(snaps[i], rm.replica_dense[i]):
          s.assign(w.read_value())
    return read

  if config.mode == "shadow_easgd":
    def make(i):
      read = reader([i])

      @rt.completed_function
      def exchange():
        with tf.device(rt.ps_device(0)):
          new_ps = shadow_sync.apply_easgd_ps(rm.dense, snaps[i], alpha)
        with tf.device(rt.worker_device(i)):
          shadow_sync.pull(rm.replica_dense[i], new_ps, snaps[i], alpha)

      last = [0]

      def body():
        # Nothing new from this worker since its last sync: wait for its next step.
        if not counters.wait_past(i, last[0], stop):
          return
        t0, s0 = time.perf_counter(), counters[i]
        last[0] = s0
        with tf.device(rt.worker_device(i)):
          read()
        sleep()
        exchange()
        log.record(i, s0, counters[i])
        log.record_seconds(time.perf_counter() - t0)
      return body
    return [make(i) for i in range(n)]

  bmuf = config.mode == "shadow_bmuf"
  if bmuf:
    with tf.device(rt.ps_device(0)):
      momentum = [tf.Variable(tf.zeros_like(v), trainable=False, name=f"bmuf_momentum_{k}")
                  for k, v in enumerate(rm.dense)]
  read_all = reader(range(n))

  @rt.completed_function
  def average_and_pull():
    with tf.device(rt.ps_device(0)):
      w_c = shadow_sync.mean_values(snaps)
      if bmuf:
        target = shadow_sync.apply_bmuf_global(
            rm.dense, momentum, w_c, config.shadow_bmuf_eta, config.shadow_bmuf_momentum,
            config.shadow_bmuf_nesterov)
      else:
        target = w_c
    for i in range(n):
      with tf.device(rt.worker_device(i)):
        shadow_sync.pull(rm.replica_dense[i], target, snaps[i], alpha)

  last = [[0] * n]

  def round_body():
    # A round when every worker has stepped since the last one (each brings something new).
    for i in range(n):
      if not counters.wait_past(i, last[0][i], stop):
        return
    t0 = time.perf_counter()
    starts = [counters[i] for i in range(n)]
    last[0] = list(starts)
    read_all()
    sleep()
    average_and_pull()
    for i in range(n):
      log.record(i, starts[i], counters[i])
    log.record_seconds(time.perf_counter() - t0)
  return [round_body]


class _AsgdCoordinationBase:
  """What both algorithms' coordinations hold: the workers' ASGD state, the master, the lock the
  threads hand off under, and the per-step staleness and blocking they report."""

  def __init__(self, config, rm: ReplicatedModel, counters, log: rt.SyncLog,
               stop: threading.Event, worker_cls, name: str):
    n = rm.num_workers
    self.n, self.rm, self.counters, self.log, self.stop = n, rm, counters, log, stop
    self.tau = config.asgd_tau
    self.workers = [worker_cls(rm.replica_dense[i], self.tau, name=f"{name}{i}")
                    for i in range(n)]
    self.master = asgd_nodelay.AsgdMaster(rm.dense)
    self.cond = threading.Condition()
    self.version = 0
    # Sized past tau so that a step beyond the bound would be counted where a test sees it.
    self.staleness_counts = [np.zeros(2 * self.tau + 2, np.int64) for _ in range(n)]
    self.blocked_seconds = [0.0] * n
    self.sleep = _Sleep(config.shadow_sync_delay_ms, stop)
    self.budget_spent = lambda: False  # set by train(): a worker waiting at the end stops

  def summary(self) -> Dict:
    total = np.sum(self.staleness_counts, axis=0)
    steps = max(1, int(total.sum()))
    return {"asgd_tau": self.tau, "merges": self.master.version,
            "staleness_histogram_per_worker": [c.tolist() for c in self.staleness_counts],
            "max_step_staleness": int(np.max(np.nonzero(total)[0])) if total.any() else 0,
            "mean_step_staleness": float(np.dot(np.arange(len(total)), total) / steps),
            "blocked_seconds_per_worker": [round(s, 3) for s in self.blocked_seconds]}


class _AsgdCoordination(_AsgdCoordinationBase):
  """Algorithm 1's hand-offs between the master thread and the workers' driver threads."""

  def __init__(self, config, rm: ReplicatedModel, counters, log: rt.SyncLog,
               stop: threading.Event):
    super().__init__(config, rm, counters, log, stop, asgd_nodelay.AsgdWorker, "asgd_w")
    n = self.n
    # self.version: PS models published.
    self.received = [-1] * n     # version each worker holds
    self.request = 0             # hand-in rounds requested
    self.handed = [0] * n        # rounds each worker handed in
    self.deltas = [None] * n
    self.merge_started = [0] * n
    self.merged = 0              # hand-in rounds merged

  def before_step(self, i: int) -> bool:
    """Between two steps of worker i: rebase, hand in, and wait only at staleness tau."""
    w = self.workers[i]
    t_wait = None
    with self.cond:
      while True:
        if self.received[i] < self.version:
          version = self.version
          self.cond.release()
          try:
            with tf.device(rt.worker_device(i)):
              w.receive(self.master.ps_x)
          finally:
            self.cond.acquire()
          self.received[i] = version
          if version > 1:  # a merged model (version 1 is the initial one)
            self.log.record(i, self.merge_started[i], self.counters[i])
        if self.handed[i] < self.request:
          self.cond.release()
          try:
            with tf.device(rt.worker_device(i)):
              delta = w.take_update()
          finally:
            self.cond.acquire()
          self.deltas[i] = delta
          self.handed[i] = self.request
          self.cond.notify_all()
        if not w.must_wait:
          break
        if self.stop.is_set() or self.budget_spent():
          return False
        if t_wait is None:
          t_wait = time.perf_counter()
        self.cond.wait(0.5)
    if t_wait is not None:
      self.blocked_seconds[i] += time.perf_counter() - t_wait
    return True

  def after_step(self, i: int) -> None:
    w = self.workers[i]
    with self.cond:
      w.note_step()
      self.staleness_counts[i][w.staleness] += 1
      self.cond.notify_all()

  def master_body(self) -> None:
    """One merge: wait for an update of every worker, collect them, merge, publish."""
    with self.cond:
      while not all(w.has_update for w in self.workers) or any(
          r < self.version for r in self.received):
        if self.stop.is_set():
          return
        self.cond.wait(0.5)
      self.merge_started = [self.counters[i] for i in range(self.n)]
      self.request += 1
      self.cond.notify_all()
      while any(h < self.request for h in self.handed):
        if self.stop.is_set():
          return
        self.cond.wait(0.5)
      deltas = list(self.deltas)
      request = self.request
    t0 = time.perf_counter()
    self.sleep()
    with tf.device(rt.ps_device(0)):
      self.master.merge(deltas)
    self.log.record_seconds(time.perf_counter() - t0)
    with self.cond:
      self.version += 1
      self.merged = request
      self.cond.notify_all()

  def _rebase_all(self) -> None:
    for i, w in enumerate(self.workers):
      if self.received[i] < self.version:
        with tf.device(rt.worker_device(i)):
          w.receive(self.master.ps_x)
        self.received[i] = self.version

  def _round(self) -> None:
    for i, w in enumerate(self.workers):
      if self.handed[i] < self.request:
        with tf.device(rt.worker_device(i)):
          self.deltas[i] = w.take_update()
        self.handed[i] = self.request
    self.master.merge(self.deltas)
    self.version += 1
    self.merged = self.request

  def finish(self) -> None:
    """After training (threads joined): a round the master had requested but not merged is
    completed; then every worker rebases onto the newest model and hands in the rest, one last
    merge, and every replica takes the result, which is the average of the replicas."""
    if self.request > self.merged:
      self._round()  # updates already handed in must not be lost
    self._rebase_all()
    # Each replica now holds the newest model plus its own unmerged steps (a worker may have
    # stopped before receiving the last model): the final merge gives their average.
    self.rm.before_final = [[v.numpy() for v in dense] for dense in self.rm.replica_dense]
    self.request += 1
    self._round()
    self._rebase_all()



class _Alg2Coordination(_AsgdCoordinationBase):
  """Algorithm 2: cycles of beta = tau / 2 steps; at a boundary a worker waits for the PS model
  of the previous boundary's merge (pipelined: the merge runs while the workers train)."""

  def __init__(self, config, rm: ReplicatedModel, counters, log: rt.SyncLog,
               stop: threading.Event):
    super().__init__(config, rm, counters, log, stop, asgd_nodelay.Alg2Worker, "asgd2_w")
    # self.version: merges done; model j is available when version >= j.
    self.pending: Dict[int, List] = {}    # boundary -> updates handed in

  def before_step(self, i: int) -> bool:
    w = self.workers[i]
    if not w.at_boundary:
      return True
    j = w.i // w.beta
    t0 = time.perf_counter()
    with self.cond:
      while self.version < j:
        if self.stop.is_set() or self.budget_spent():
          return False
        self.cond.wait(0.5)
    self.blocked_seconds[i] += time.perf_counter() - t0
    start = self.counters[i]
    with tf.device(rt.worker_device(i)):
      delta = w.boundary(self.master.ps_x)
    self.log.record(i, start, self.counters[i])
    with self.cond:
      self.pending.setdefault(j, [None] * self.n)[i] = delta
      self.cond.notify_all()
    return True

  def after_step(self, i: int) -> None:
    w = self.workers[i]
    w.note_step()
    self.staleness_counts[i][w.staleness] += 1

  def master_body(self) -> None:
    with self.cond:
      j = self.version
      while j not in self.pending or any(d is None for d in self.pending[j]):
        if self.stop.is_set():
          return
        self.cond.wait(0.5)
      deltas = self.pending.pop(j)
    t0 = time.perf_counter()
    self.sleep()
    with tf.device(rt.ps_device(0)):
      self.master.merge(deltas)
    self.log.record_seconds(time.perf_counter() - t0)
    with self.cond:
      self.version += 1
      self.cond.notify_all()

  def finish(self) -> None:
    # The checkpoint model: the average of the replicas (the PS model lags a cycle behind).
    self.rm.average_into_master()

  def summary(self) -> Dict:
    return {**super().summary(), "asgd_algorithm": 2}


class _Monitor:
  """Runs in the coordinator's main thread while the workers train: a progress line (and the
  run's progress record) every `log_every` worker steps, and the periodic checkpoints
  (`checkpoint_every_steps`, `checkpoint_every_secs`) of the replicas' average. Neither stops
  a worker: the checkpoint reads the replicas as they train (a snapshot of a moving model, as
  any asynchronous mode's), and the embeddings are saved from the parameter servers as they are.
  """

  def __init__(self, cfg, rm: ReplicatedModel, budget: rt.StepBudget, counters: rt.StepCounters,
               losses, save):
    self.cfg, self.rm, self.budget, self.losses, self.save = cfg, rm, budget, losses, save
    self.counters = counters
    self.t0 = time.time()
    self.next_log = cfg.log_every
    self.schedule = recovery.CheckpointSchedule(cfg.checkpoint_every_steps,
                                                cfg.checkpoint_every_secs)
    self.checkpoints = 0
    self.wake = threading.Event()  # set by the step that reaches a progress or checkpoint point
    self.last_done, self.last_progress = self._done(), time.time()

  def _done(self) -> int:
    return sum(self.counters[i] for i in range(len(self.losses)))

  def step_done(self) -> None:
    """After a worker step (its driver thread): wakes `tick` at a progress or checkpoint point,
    so that those come within a step of their interval."""
    taken = self.budget.taken
    if (self.cfg.log_every and taken >= self.next_log) or self.schedule.due_by_steps(taken):
      self.wake.set()

  def tick(self) -> None:
    cfg, taken = self.cfg, self.budget.taken
    now = time.time()
    # Counted in steps finished, not claimed: the last steps of the budget are all claimed at
    # once, and a call among them that never returns (a server that stopped answering without
    # closing its socket, or a hang inside TF's runtime) would otherwise hold the job forever.
    # A restart resumes from the last checkpoint.
    done = self._done()
    if done != self.last_done:
      self.last_done, self.last_progress = done, now
    elif now - self.last_progress > cfg.stall_timeout_s:
      raise recovery.Stalled(
          f"no worker finished a step for {cfg.stall_timeout_s:.0f} s (--stall_timeout_s): a "
          "worker or parameter server stopped answering. Rerun the same command to resume from "
          "the last checkpoint in model_dir.")
    if interrupt.requested() is not None:
      self.budget.stop()  # SIGINT or SIGTERM: the steps running finish, then train() saves
    if taken >= self.budget.total:
      return  # the run's last checkpoint and line follow
    if cfg.log_every and taken >= self.next_log:
      self.next_log = (taken // cfg.log_every + 1) * cfg.log_every
      global_step = int(self.rm.optimizer.iterations.numpy())
      recovery.report(cfg.model_dir, global_step)
      last = [ls[-1] for ls in self.losses if ls]
      loss = float(np.mean(last)) if last else float("nan")
      qps = taken * cfg.local_batch_size / max(time.time() - self.t0, 1e-9)
      _log(f"step {taken}/{self.budget.total}  global step {global_step}  loss {loss:.4f}  "
           f"QPS {qps:,.0f}")
    if self.schedule.due(taken):
      self.save()
      self.checkpoints += 1
      self.schedule.written(taken)


def train(config, resolver, num_workers: int, num_ps: int, timeout_s: float = 3600.0,
          return_model: bool = False, cluster=None):
  """Trains on a running cluster (this process: its chief); returns the summary (and, with
  `return_model`, the `ReplicatedModel`, to read the replicas). `cluster`: the LocalCluster
  (None on a real cluster), to name a server that died.

  A dead worker takes its dense replica with it, a dead parameter server its variables: either
  raises recovery.JobLost, and the binary starts the job again, which resumes from the last
  checkpoint toward the same target (tf_gba.training.recovery), as in the other modes."""
  cfg = config
  recovery.quiet_executors_of_a_lost_server()
  rt.connect(resolver)
  data_kwargs = cfg.data_kwargs()
  info = data_lib.data_info(cfg.data, **data_kwargs)
  rm = ReplicatedModel(cfg, info, num_workers, num_ps)
  position = ShardPosition(num_workers, cfg.day, cfg.local_batch_size)
  manager = tf.train.CheckpointManager(
      tf.train.Checkpoint(model=rm.saved, shard_position=position.module), cfg.model_dir,
      max_to_keep=cfg.keep_checkpoints)
  restored_from, _ = preflight.restore_latest_usable(
      cfg.model_dir, lambda path: resharding.restore_training_state(path, rm.master, rm.optimizer),
      _log)
  rm.broadcast()
  rm.snapshot()  # traced here, before the driver threads start
  start_step = int(rm.optimizer.iterations.numpy())
  # Where the run ends, in global steps (one per worker step); a rerun after a failure goes on
  # to the same target.
  os.makedirs(cfg.model_dir, exist_ok=True)
  resume = recovery.begin(cfg.model_dir, cfg.mode, cfg.steps, start_step,
                          target_if_new=start_step + cfg.steps)
  run_steps = max(0, resume.target_global_step - start_step)
  # As the shared list's position in the other modes: only an interrupted run goes on in its
  # data; a new run from a checkpoint (another day, another mode, --steps more) starts afresh.
  position.restore(restored_from if resume.resumed else None, _log)
  if resume.resumed:
    _log(f"tf_gba: resuming an interrupted run (restart {resume.restarts}): global step "
         f"{start_step} of {resume.target_global_step}, {run_steps} worker steps left, "
         f"{resume.steps_redone} global steps redone so far, each worker's input going on "
         f"after the {int(position.start.sum())} batches the checkpoint trained")
  profile = stragglers_lib.parse(cfg.stragglers)
  steps = [_step_function(rm, i, profile, cfg.straggler_seed) for i in range(num_workers)]
  iterators = []
  for i in range(num_workers):
    ds = data_lib.make_dataset(cfg.data, split="train", batch_size=cfg.local_batch_size,
                               num_shards=num_workers, shard_index=i, day=cfg.day, repeat=True,
                               shuffle_seed=cfg.seed, strict=cfg.strict_data, **data_kwargs)
    iterators.append(iter(position.skip(ds, i).prefetch(2)))
  stop = threading.Event()
  errors: List[BaseException] = []
  counters = rt.StepCounters(num_workers)
  log = rt.SyncLog(num_workers)
  losses = [[] for _ in range(num_workers)]
  coordination = None
  if cfg.mode == "asgd_nodelay":
    cls = _AsgdCoordination if cfg.asgd_algorithm == 1 else _Alg2Coordination
    coordination = cls(cfg, rm, counters, log, stop)
    if cfg.asgd_algorithm == 1:
      # The initial PS model (Algorithm 1's master: "provide PS.x to workers").
      coordination.version = 1
      coordination.master.version = 0
  _log(f"tf_gba: mode={cfg.mode} model={cfg.model} data={cfg.data} ps={num_ps} "
       f"workers={num_workers} local batch={cfg.local_batch_size} stragglers={cfg.stragglers}"
       + (f" restored from {restored_from} (global step {start_step})" if restored_from else ""))

  def run_step(i):
    features, labels = next(iterators[i])
    with tf.device(rt.worker_device(i)):
      loss = steps[i](features, labels)
    # Fetched here, in the driver thread: a step counts (budget, ASGD's staleness, sync gaps)
    # once it is done.
    losses[i].append(float(loss.numpy()))
    if coordination is not None:
      coordination.after_step(i)

  # Every step function is traced once, one worker after the other, before the threads start
  # (tracing touches the shared optimizer's Python state).
  budget = rt.StepBudget(run_steps)
  if coordination is not None:
    coordination.budget_spent = lambda: budget.taken >= budget.total
  for i in range(num_workers):
    if coordination is not None:
      coordination.before_step(i)
    if budget.claim():
      run_step(i)
      counters.done(i)
  if cfg.mode in SHADOW_MODES:
    bodies = _shadow_syncers(cfg, rm, counters, log, stop)
  else:
    bodies = [coordination.master_body]
  syncers = rt.run_background(bodies, stop, errors, name="synchroniser")
  warm_steps = budget.taken

  def save() -> str:
    # Counted before the snapshot reads the replicas: every step counted is in them, and a step
    # that finishes in between is trained again by a resumption rather than skipped.
    position.record([counters[i] for i in range(num_workers)])
    rm.snapshot()
    return manager.save(checkpoint_number=int(rm.saved_optimizer.iterations.numpy()))

  monitor = _Monitor(cfg, rm, budget, counters, losses, save)

  def run_step_and_report(i):
    run_step(i)
    monitor.step_done()

  try:
    wall = rt.drive_workers(num_workers, run_step_and_report, budget, counters, stop, errors,
                            before_step=coordination.before_step if coordination else None,
                            timeout_s=timeout_s, on_tick=monitor.tick, wake=monitor.wake)
  except Exception as e:  # pylint: disable=broad-except
    recovery.raise_if_lost(recovery.root_error(errors + [e]), cluster, jobs=("ps", "worker"))
    raise
  finally:
    stop.set()
    deadline = time.time() + 60.0  # for all of them: a stalled one must not hold the restart
    for t in syncers:
      t.join(max(0.0, deadline - time.time()))
  if errors:
    root = recovery.root_error(errors)
    recovery.raise_if_lost(root, cluster, jobs=("ps", "worker"))
    raise root
  if interrupt.requested() is not None:
    # The checkpoint of a periodic save (the replicas' average as they are), recorded as the
    # run's progress: a rerun resumes from it toward the same target, nothing trained again.
    saved = save()
    global_step = int(rm.saved_optimizer.iterations.numpy())
    recovery.report(cfg.model_dir, global_step)
    raise interrupt.Interrupted(interrupt.requested(), saved, global_step)
  spread_before_final = rm.spread()
  # Kept for inspection: the final model must be their average.
  rm.before_final = [[v.numpy() for v in dense] for dense in rm.replica_dense]
  if coordination is not None:
    coordination.finish()
  else:
    rm.average_into_master()
  spread_after_final = rm.spread()
  worker_stats = stragglers_lib.worker_step_stats(num_workers)
  saved = save()  # the replicas are the final model now: their average is that model
  global_step = int(rm.optimizer.iterations.numpy())
  recovery.report(cfg.model_dir, global_step, finished=True)
  evaluation = _evaluate(cfg, info, data_kwargs, saved)
  measured = budget.taken - warm_steps
  tail = [l for ls in losses for l in ls[-20:]]
  final_loss = float(np.mean(tail)) if tail else None  # None: a resumed run with nothing left
  summary = summary_lib.new(
      cfg, num_aggregate=1, num_ps=num_ps, num_workers=num_workers,
      global_batch_size=cfg.local_batch_size * num_workers,
      steps=budget.taken, examples=budget.taken * cfg.local_batch_size,
      wall_seconds=wall, global_qps=measured * cfg.local_batch_size / max(wall, 1e-9),
      qps_measured_over_steps=measured,
      per_worker=[{"worker": w["worker"], "steps": counters[w["worker"]],
                   "qps": counters[w["worker"]] * cfg.local_batch_size / max(wall, 1e-9),
                   "injected_delay_seconds": round(w["delay_seconds"], 3)}
                  for w in worker_stats],
      # The other modes' buffer counters, for the benchmarks' tables: every step applies its
      # embedding gradient at once and nothing is dropped. Dense staleness: asgd_nodelay's
      # per-step staleness (local steps past the last PS model); 0 for ShadowSync, whose dense
      # replicas are trained locally (how far apart they drift is in "sync").
      pushes=budget.taken,
      global_step=global_step, start_global_step=start_step,
      restored_from=restored_from, final_train_loss=final_loss,
      eval_auc=evaluation["auc"], eval_logloss=evaluation["logloss"],
      eval_examples=evaluation["examples"], checkpoint=saved,
      replica_spread_before_final_sync=spread_before_final,
      replica_spread_after_final_sync=spread_after_final,
      sync=log.summary(), periodic_checkpoints=monitor.checkpoints,
      target_global_step=resume.target_global_step, restarts=resume.restarts,
      restart_causes=resume.restart_causes,
      steps_redone=resume.steps_redone, batches_reread=resume.steps_redone,
      worker_restarts=0, restored_shard_batches=[int(b) for b in position.start])
  if cfg.mode in SHADOW_MODES:
    summary["shadow_alpha"] = cfg.shadow_alpha
  if coordination is not None:
    summary["asgd"] = coordination.summary()
    hist = np.sum(summary["asgd"]["staleness_histogram_per_worker"], axis=0)
    summary.update(mean_staleness=summary["asgd"]["mean_step_staleness"],
                   max_staleness=summary["asgd"]["max_step_staleness"],
                   staleness_histogram=[int(x) for x in np.trim_zeros(hist, "b")],
                   blocked_seconds=float(sum(summary["asgd"]["blocked_seconds_per_worker"])))
  return (summary, rm) if return_model else summary


def _evaluate(cfg, info, data_kwargs, checkpoint_path: str) -> Dict:
  model = models_lib.build_model(cfg.model, info, embedding_dim=cfg.embedding_dim, seed=cfg.seed)
  tf.train.Checkpoint(model=model).read(checkpoint_path).expect_partial()
  return metrics.evaluate_binary(model, eval_dataset(cfg, data_kwargs))


def run(config) -> Dict:
  """What the training binary runs for these modes: a local cluster (or TF_CONFIG's), the
  training, the summary (printed, and written to model_dir/summary.json). The flags and data were
  checked before (`tf_gba.training.runner.run`, the registry's `validate`)."""
  preflight.write_metadata(config)
  if os.environ.get("TF_CONFIG"):
    from tf_gba.training import runner  # pylint: disable=g-import-not-at-top
    runner.wait_for_cluster(config)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = resolver.cluster_spec().as_dict()
    summary = train(config, resolver, len(spec["worker"]), len(spec["ps"]))
  else:
    with LocalCluster(num_ps=config.num_ps, num_workers=config.num_workers,
                      log_dir=config.log_dir, keep_logs=config.keep_logs) as cluster:
      summary = train(config, cluster.resolver(), config.num_workers, config.num_ps,
                      cluster=cluster)
  summary.update(summary_lib.log_fields(config))
  summary_lib.write(config.model_dir, summary)
  summary_lib.print_summary(summary)
  return summary

