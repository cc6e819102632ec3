"""GBAStrategy: ParameterServerStrategy that runs GBA (and the baselines around it).

The strategy owns what is really job-wide: the training mode, the token generator on parameter
server 0, the per-step token fetch (before the forward pass, together with the parameter pull) and
any other pre-step reads optimizers ask for. Optimizer wrappers (`tf_gba.optimizers.GBA`) own the
per-variable gradient buffers, like slots.

Example:

  with tf_gba.distribute.LocalCluster(num_ps=2, num_workers=4) as cluster:
    strategy = tf_gba.distribute.GBAStrategy(cluster.resolver(), mode="gba")
    with strategy.scope():
      model = build_model()
      model.compile(tf_gba.optimizers.GBA(tf_keras.optimizers.Adam(1e-3), num_aggregate=4),
                    loss="binary_crossentropy")
    model.fit(dataset_fn, steps_per_epoch=100)
"""

import threading
from typing import Any, Callable, Dict, Optional

import tensorflow as tf

from tf_gba.common import arguments
from tf_gba.common import autograph
from tf_gba.common import keras_apply
from tf_gba.distribute import coordinator_exit
from tf_gba.distribute import function_times as function_times_lib
from tf_gba.distribute import modes as modes_lib
from tf_gba.distribute import packed_reads
from tf_gba.distribute import step_context
from tf_gba.distribute import steps_per_execution as steps_per_execution_lib
from tf_gba.distribute import stragglers as stragglers_lib
from tf_gba.ops import gba_ops
from tf_gba.ops import loader

# The modes and what each means for the buffers: `tf_gba.distribute.modes`.
MODES = modes_lib.MODES
PS0_DEVICE = "/job:ps/replica:0/task:0/device:CPU:0"


# Keras refuses a loss with the default reduction when the model itself calls it (not compile),
# e.g. a TensorFlow Recommenders task, under any strategy; its own message is buried in a long
# traceback and does not say what the reduction means here.
LOSS_REDUCTION_HINT = (
    "A Keras loss that the model calls itself (not one given to compile(), e.g. the loss of a "
    "tfrs.tasks.Ranking) needs an explicit reduction under a distribution strategy: construct "
    "it with reduction=tf.keras.losses.Reduction.SUM (each GBAStrategy worker is one replica, so "
    "that sums over its local batch; use a learning rate for summed, not averaged, gradients).")


def _refuse_optimizers_that_bypass_the_buffers(optimizer, grads_and_vars) -> None:
  """At the entry of a tf_keras optimizer's `apply_gradients` (not GBA's, which pushes to the
  buffers): refuses it, in one line, under a GBAStrategy whose mode aggregates in buffers.

  Such an optimizer would apply every gradient on arrival, which is mode="async", while the job
  believes it runs the mode it asked for. tf_gba's asynchronous optimizers (AdaptiveRevision,
  `keras_apply.ASYNCHRONOUS`) apply on arrival by design and are left alone.
  """
  del grads_and_vars
  strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
  if not isinstance(strategy, GBAStrategy) or not modes_lib.uses_buffers(strategy.mode):
    return
  if getattr(optimizer, keras_apply.ASYNCHRONOUS, False):
    return
  name = type(optimizer).__name__
  raise keras_apply.one_line(ValueError(
      f"GBAStrategy(mode={strategy.mode!r}) aggregates gradients in buffers on the parameter "
      f"servers, but {name} would apply every gradient on arrival (plain async): wrap it, "
      f"tf_gba.optimizers.GBA({name}(...)), or use mode=\"async\"."))


class GBAStrategy(tf.distribute.experimental.ParameterServerStrategy):
  """A ParameterServerStrategy whose workers push (token, gradient) to buffers on the PS.

  Args:
    cluster_resolver: resolves a cluster with "chief" (this process), "worker" and "ps" jobs;
      `LocalCluster.resolver()` or `TFConfigClusterResolver()`.
    variable_partitioner: as for ParameterServerStrategy; shards large variables (embeddings)
      across parameter servers. Each shard gets its own buffer.
    mode: "gba" (aggregate M gradients per global step with staleness decay) or "async" (apply
      each gradient on arrival; staleness is still measured), or a baseline ("bsp", "hop_bs",
      "hop_bw"). Every mode but "async" aggregates in buffers and takes tf_gba.optimizers.GBA:
      a plain tf_keras optimizer, which would apply each gradient on arrival, is refused in one
      line when the first step is traced. "async" also takes a plain optimizer (plain async).
    num_aggregate: M for "gba". Default: taken from the GBA optimizer created under this
      strategy's scope, else the number of workers (SPEC: N_async = M).
    stragglers: a straggler profile (see `tf_gba.distribute.stragglers`), applied as real delays
      inside each worker's step; "none" by default.
    straggler_seed: seed of the transient slowdowns.
    straggler_delay: where a step sleeps its slowdown: "after_push" (default: at its end) or
      "before_push" (between the gradient and its push: a slow machine's gradient is stale);
      see `tf_gba.distribute.stragglers`.
    bsp_aggregate: b2, gradients per step in "bsp" mode; default max(1, round(N / 5)).
    hop_bs_bound: b1 of "hop_bs": how many steps a worker may be ahead of the slowest one.
    hop_bs_timeout_s: "hop_bs": None (default) blocks without a time limit; else a worker
      blocked this long goes on anyway (counted).
    hop_bw_backup: b3 of "hop_bw": backup workers, i.e. each step takes the first N - b3
      gradients of the current version; default max(1, round(N / 5)).
    steps_per_execution: worker steps of one function that `model.fit` schedules, where
      `compile()` was given no `steps_per_execution` (default 20; 1 in "hop_bs" and "hop_bw",
      whose barriers would wait on steps held in a function, and which refuse more): the
      coordinator's cost is per function (see `tf_gba.distribute.steps_per_execution`). Each step
      reads its own batch, takes its own token and pushes its own gradient; a worker that fails
      re-runs its whole function, so up to that many steps are trained again.
    pack_reads: a step's dense reads of one parameter server's variables travel to the worker as
      one tensor, where each would be a transfer of its own (default True; the values and
      gradients are the same: see `tf_gba.distribute.packed_reads`). False: one per variable.

  The barriers of "hop_bs" and "hop_bw" block workers; at each `join()` of the coordinator (the
  end of `fit`, a checkpoint; a plain `fit` joins at every epoch's end) the workers still blocked
  while nothing else runs are released, since no step is left that could let them go.
  """

  def __init__(self, cluster_resolver, variable_partitioner=None, mode: str = "gba",
               num_aggregate: Optional[int] = None, stragglers: str = "none",
               straggler_seed: int = 0, bsp_aggregate: Optional[int] = None,
               hop_bs_bound: int = modes_lib.DEFAULT_HOP_BS_BOUND,
               hop_bs_timeout_s: Optional[float] = None,
               hop_bw_backup: Optional[int] = None,
               straggler_delay: str = stragglers_lib.AFTER_PUSH,
               steps_per_execution: Optional[int] = None, pack_reads: bool = True):
    if not callable(getattr(cluster_resolver, "cluster_spec", None)):
      raise TypeError(f"GBAStrategy needs a cluster resolver (e.g. LocalCluster(...).resolver() "
                      f"or tf.distribute.cluster_resolver.TFConfigClusterResolver()), got "
                      f"{type(cluster_resolver).__name__} {cluster_resolver!r}.")
    if mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    if num_aggregate is not None:
      num_aggregate = arguments.integer("num_aggregate", num_aggregate, minimum=1,
                                        owner="GBAStrategy")
    straggler_seed = arguments.integer("straggler_seed", straggler_seed, owner="GBAStrategy")
    if steps_per_execution is not None:
      steps_per_execution = arguments.integer("steps_per_execution", steps_per_execution,
                                              minimum=1, owner="GBAStrategy")
      modes_lib.check_steps_per_execution(mode, steps_per_execution,
                                          "GBAStrategy(steps_per_execution)")
    hop_bs_bound = arguments.integer("hop_bs_bound", hop_bs_bound, minimum=0, owner="GBAStrategy")
    if hop_bs_timeout_s is not None:
      arguments.number("hop_bs_timeout_s", hop_bs_timeout_s, minimum=0.0, inclusive=False,
                       owner="GBAStrategy")
    spec = cluster_resolver.cluster_spec()
    num_workers = len(spec.job_tasks("worker"))
    if not num_workers or not spec.job_tasks("ps"):
      raise ValueError(f"GBAStrategy needs at least one 'ps' and one 'worker' task; the cluster "
                       f"has {spec.as_dict()}.")
    missing = [w for w in stragglers_lib.named_workers(stragglers) if not 0 <= w < num_workers]
    if missing:
      raise ValueError(f"GBAStrategy: stragglers={stragglers!r} names worker(s) {missing}, which "
                       f"the cluster does not have (workers 0 to {num_workers - 1}).")
    if hop_bw_backup is None:
      hop_bw_backup = modes_lib.default_hop_bw_backup(num_workers)
    modes_lib.check_parameters(mode, num_workers, bsp_aggregate, hop_bs_bound, hop_bs_timeout_s,
                               hop_bw_backup)
    self._gba_stragglers = stragglers_lib.parse(stragglers)
    self._gba_straggler_seed = int(straggler_seed)
    self._gba_straggler_delay = stragglers_lib.check_placement(straggler_delay)
    # The op libraries now, before the cluster connects and the coordinator's threads run ops.
    # Loaded on first use, mid-run, a library's kernels register while its ops wait for the end
    # of the load; an op lookup on another thread in that moment checks every kernel against the
    # ops registered so far and warns once per kernel of "OpKernel ... for unknown op" (18 lines
    # in a user's script once).
    loader.load_all()
    super().__init__(cluster_resolver, variable_partitioner)
    # Keras' steps-per-execution counter: here, not on a parameter server, with this default
    # (1 in the barrier modes, which refuse more).
    if steps_per_execution is None:
      steps_per_execution = (1 if mode in modes_lib.BARRIER_MODES
                             else steps_per_execution_lib.DEFAULT)
    self.extended._create_variable = steps_per_execution_lib.counter_creator(  # pylint: disable=protected-access
        self.extended._create_variable, steps_per_execution,  # pylint: disable=protected-access
        lambda value: modes_lib.check_steps_per_execution(
            mode, value, "compile(steps_per_execution)"))
    self._gba_steps_per_execution = steps_per_execution
    if not isinstance(pack_reads, bool):
      raise TypeError(f"GBAStrategy(pack_reads) must be True or False, got {pack_reads!r}.")
    self._gba_reads = packed_reads.Registry() if pack_reads else None
    if pack_reads:
      self.extended._create_var_creator = packed_reads.packing_creator(  # pylint: disable=protected-access
          self.extended._create_var_creator, self._gba_reads)  # pylint: disable=protected-access
    self._gba_mode = mode
    self._gba_num_workers = num_workers
    self._gba_num_ps = len(spec.job_tasks("ps"))
    self._gba_num_aggregate = num_aggregate
    self._gba_bsp_aggregate = bsp_aggregate
    self._gba_hop_bs_bound = int(hop_bs_bound)
    self._gba_hop_bs_timeout_ms = int(hop_bs_timeout_s * 1000) if hop_bs_timeout_s else 0
    self._gba_hop_bw_backup = int(hop_bw_backup)
    self._gba_token_generator: Optional[gba_ops.TokenGenerator] = None
    self._gba_worker_clock = None
    self._gba_version_barrier = None
    # Hop-BS statistics of the clock before each release (a release zeroes the clock's own).
    self._gba_hop_bs_totals = None
    self._gba_version_reader: Optional[Callable[[], Any]] = None
    self._gba_pre_step_readers: Dict[str, Callable[[], Any]] = {}
    self._gba_uses_tokens = False
    keras_apply.add_check("gba_strategy", 0, _refuse_optimizers_that_bypass_the_buffers)
    # An optimizer's update ends the step's packed reads: a read after it reads the variable.
    keras_apply.add_check("packed_reads", -1, lambda optimizer, pairs: packed_reads.close())

  # ParameterServerStrategy keeps its ClusterCoordinator here; ClusterCoordinator(strategy)
  # stores itself on first use. Its join() is wrapped as it arrives so that blocked workers are
  # released at the end of every join (see `_join_releasing_blocked_workers`), and its workers'
  # functions are timed (`function_seconds`).
  @property
  def _cluster_coordinator(self):
    return self.__dict__.get("_gba_coordinator")

  @_cluster_coordinator.setter
  def _cluster_coordinator(self, coordinator):
    if coordinator is not None and not getattr(coordinator, "_gba_join_wrapped", False):
      original = coordinator.join
      coordinator.join = lambda: self._join_releasing_blocked_workers(coordinator, original)
      coordinator._gba_join_wrapped = True  # pylint: disable=protected-access
      self._time_functions_from_the_first_schedule(coordinator)
      coordinator_exit.stop_at_exit(coordinator)
    self.__dict__["_gba_coordinator"] = coordinator

  def _time_functions_from_the_first_schedule(self, coordinator) -> None:
    # The coordinator arrives here before its worker threads exist (ClusterCoordinator.__new__
    # stores it, __init__ starts them), and every function passes through `schedule`: the first
    # call puts the timers on the threads and gives `schedule` back.
    # `schedule` also traces a function the first time it is given it: a refusal raised there
    # reaches the user as the one line it is (`keras_apply.raised_in_loop_staging`).
    original = coordinator.schedule

    def schedule(*args, **kwargs):
      try:
        return original(*args, **kwargs)
      except (ValueError, TypeError) as e:
        own = keras_apply.raised_in_loop_staging(e)
        if own is None:
          raise
        raise own from None

    def first_schedule(*args, **kwargs):
      coordinator.schedule = schedule
      try:
        self.__dict__["_gba_function_times"] = function_times_lib.FunctionTimes(coordinator)
      except AttributeError:
        pass  # a coordinator without these internals: no times, the counts decide
      return schedule(*args, **kwargs)

    coordinator.schedule = first_schedule

  def function_seconds(self) -> Optional[list]:
    """Per worker, the longest function the coordinator ran on it since the last call (seconds,
    from taking it to its result; `function_times`); None before the coordinator exists."""
    times = self.__dict__.get("_gba_function_times")
    return None if times is None else times.longest_since_last_read()

  def running_seconds(self) -> Optional[list]:
    """Per worker, how long the function it runs now has run (0 for none; `function_times`);
    None before the coordinator exists."""
    times = self.__dict__.get("_gba_function_times")
    return None if times is None else times.running_seconds()

  def _join_releasing_blocked_workers(self, coordinator, join):
    """Runs `join()`; meanwhile releases barrier waits that nothing can release any more.

    During a join nothing new is scheduled. When every closure still running is a wait blocked
    at the Hop-BS or Hop-BW barrier (and no step finished between two looks), the workers that
    would let them go have no step left, and the join would never return.
    """
    if self._gba_mode not in ("hop_bs", "hop_bw"):
      return join()
    stop = threading.Event()

    def watch():
      queue = coordinator._cluster.closure_queue  # pylint: disable=protected-access
      previous = None
      while not stop.wait(0.2):
        with queue._queue_lock:  # pylint: disable=protected-access
          inflight = queue._inflight_closure_count  # pylint: disable=protected-access
          pending = not queue._queue.empty()  # pylint: disable=protected-access
        if pending or inflight == 0:
          previous = None
          continue
        state = self._barrier_state()
        if state is None:
          continue
        blocked, progress = int(sum(state[0])), state[1]
        if blocked == inflight and previous == (blocked, progress):
          self.release_blocked_workers()
          previous = None
        else:
          previous = (blocked, progress)

    watcher = threading.Thread(target=watch, daemon=True, name="gba_barrier_release")
    watcher.start()
    try:
      return join()
    finally:
      stop.set()
      watcher.join()

  def blocked_workers(self) -> Optional[list]:
    """Per worker, whether it is blocked at the Hop-BS or Hop-BW barrier right now (read
    eagerly); None in the other modes, or before the barrier exists."""
    state = self._barrier_state()
    return None if state is None else [bool(n) for n in state[0]]

  def _barrier_state(self):
    """(waits blocked now per worker, a value that changes whenever a step completes), or
    None."""
    if self._gba_mode == "hop_bs" and self._gba_worker_clock is not None:
      raw = self._gba_worker_clock.stats()
      return self._gba_worker_clock.waiting(), tuple(raw["completed"].tolist())
    if self._gba_mode == "hop_bw" and self._gba_version_barrier is not None:
      raw = self._gba_version_barrier.stats()
      return raw["waiting"], (raw["version"], tuple(raw["gradients"].tolist()))
    return None

  @property
  def mode(self) -> str:
    return self._gba_mode

  @property
  def num_workers(self) -> int:
    return self._gba_num_workers

  @property
  def num_ps(self) -> int:
    return self._gba_num_ps

  @property
  def num_aggregate(self) -> int:
    """Gradients per global step in this mode (1 in async mode)."""
    return modes_lib.num_aggregate_for(self._gba_mode, self._gba_num_workers,
                                       self._gba_num_aggregate, self._gba_bsp_aggregate,
                                       self._gba_hop_bw_backup)

  @property
  def hop_bs_bound(self) -> int:
    return self._gba_hop_bs_bound

  @property
  def hop_bw_backup(self) -> int:
    return self._gba_hop_bw_backup

  def register_num_aggregate(self, num_aggregate: Optional[int]) -> int:
    """Called by GBA optimizers: agrees on M, or says clearly why it cannot."""
    self._gba_uses_tokens = True
    if num_aggregate is None:
      return self.num_aggregate
    if self._gba_num_aggregate is None and self._gba_token_generator is None:
      self._gba_num_aggregate = int(num_aggregate)
    elif self._gba_mode == "gba" and int(num_aggregate) != self.num_aggregate:
      raise ValueError(
          f"The GBA optimizer aggregates M={num_aggregate} gradients per step but this "
          f"GBAStrategy already uses M={self.num_aggregate}. Pass the same num_aggregate to "
          "both (or to only one of them).")
    return self.num_aggregate

  def buffer_config(self, config: gba_ops.BufferConfig) -> gba_ops.BufferConfig:
    """The optimizer's buffer configuration as this mode runs it."""
    return modes_lib.buffer_config_for(self._gba_mode, config, self.num_aggregate)

  @property
  def token_generator(self) -> gba_ops.TokenGenerator:
    """The job's token generator on PS 0, created on first use."""
    if self._gba_token_generator is None:
      with tf.init_scope():
        self._gba_token_generator = gba_ops.TokenGenerator(
            self.num_aggregate, device=PS0_DEVICE, name="job_tokens")
    return self._gba_token_generator

  @property
  def worker_clock(self):
    """Hop-BS's per-worker step counters on PS 0 (a `tf_gba.ops.worker_clock.WorkerClock`)."""
    if self._gba_worker_clock is None:
      from tf_gba.ops import worker_clock  # pylint: disable=g-import-not-at-top
      with tf.init_scope():
        self._gba_worker_clock = worker_clock.WorkerClock(
            self._gba_num_workers, device=PS0_DEVICE, name="hop_bs_clock")
    return self._gba_worker_clock

  @property
  def version_barrier(self):
    """Hop-BW's per-version barrier on PS 0 (a `tf_gba.ops.version_barrier.VersionBarrier`)."""
    if self._gba_version_barrier is None:
      if self._gba_version_reader is None:
        raise ValueError("mode='hop_bw' needs the GBA optimizer (tf_gba.optimizers.GBA) built "
                         "under this strategy's scope before training: it provides the model "
                         "version the barrier starts from.")
      from tf_gba.ops import version_barrier  # pylint: disable=g-import-not-at-top
      with tf.init_scope():
        self._gba_version_barrier = version_barrier.VersionBarrier(
            self._gba_num_workers, device=PS0_DEVICE,
            initial_version=int(self._gba_version_reader().numpy()), name="hop_bw_barrier")
    return self._gba_version_barrier

  def hop_bw_stats(self) -> Optional[dict]:
    """Hop-BW: the version and per worker gradients pushed, repeats, released waits, blocking."""
    if self._gba_mode != "hop_bw" or self._gba_version_barrier is None:
      return None
    raw = self._gba_version_barrier.stats()
    return {"version": raw["version"],
            "gradients": [int(x) for x in raw["gradients"]],
            "duplicates": [int(x) for x in raw["duplicates"]],
            "released": [int(x) for x in raw["released"]],
            "blocked_seconds": [float(ns) / 1e9 for ns in raw["blocked_ns"]]}

  def register_version_reader(self, fn: Callable[[], Any]) -> None:
    """Called by GBA optimizers: `fn()` reads the model version (the global step, int64).

    In "hop_bw" mode a step's token is that version, read with the parameters, so a gradient
    is on the current version exactly when its staleness is 0.
    """
    self._gba_version_reader = fn

  def register_pre_step_reader(self, name: str, fn: Callable[[], Any]) -> None:
    """Runs `fn()` at the start of every step, before the forward pass.

    Its result is available during the step as `step_context.current().reads[name]`.
    """
    self._gba_pre_step_readers[name] = fn

  @autograph.framework_function
  def _begin_step(self, version=None, skip=None) -> step_context.StepInfo:
    token = ticket = None
    if self._gba_uses_tokens:
      token, ticket = self.token_generator.fetch()
      if version is not None:
        # Hop-BW: the token is the version the barrier let this step compute on.
        token = version
    reads = {name: fn() for name, fn in self._gba_pre_step_readers.items()}
    return step_context.StepInfo(token=token, ticket=ticket, reads=reads, skip=skip)

  def _delay_before_push(self, start, grads, delayed: list) -> tf.Tensor:
    """The step's straggler delay once `grads` are computed (`StepInfo.delay_before_push`)."""
    if delayed:
      return delayed[0]  # one delay per step, whichever call made it
    computed = [t for g in grads if g is not None
                for t in ([g.values, g.indices] if isinstance(g, tf.IndexedSlices) else [g])]
    with tf.control_dependencies(computed):
      delayed.append(stragglers_lib.timed_step_end(start, self._gba_stragglers,
                                                   self._gba_straggler_seed))
    return delayed[0]

  def hop_bs_stats(self) -> Optional[dict]:
    """Hop-BS: per worker blocked seconds, waits and timeouts, and the largest lead seen."""
    if self._gba_mode != "hop_bs" or self._gba_worker_clock is None:
      return None
    raw = self._gba_worker_clock.stats()
    if self._gba_hop_bs_totals is not None:
      raw = self._add_hop_bs_stats(self._gba_hop_bs_totals, raw)
    # Plain Python values: they go into summary.json and TensorBoard as they are.
    return {"completed": [int(c) for c in raw["completed"]],
            "blocked_seconds": [float(ns) / 1e9 for ns in raw["blocked_ns"]],
            "waits": [int(w) for w in raw["waits"]],
            "timeouts": [int(t) for t in raw["timeouts"]],
            "max_lead": int(raw["max_lead"])}

  @staticmethod
  def _add_hop_bs_stats(a, b):
    out = {k: a[k] + b[k] for k in ("completed", "blocked_ns", "waits", "timeouts")}
    out["max_lead"] = max(a["max_lead"], b["max_lead"])
    return out

  def release_blocked_workers(self) -> None:
    """Lets every worker blocked at the Hop-BS or Hop-BW barrier go on (end of training).

    Hop-BS: the clock restarts level (its statistics so far are kept here). Hop-BW: the released
    steps push nothing.
    """
    if self._gba_worker_clock is not None:
      # Waits that end between these two lines are missing from the statistics; nothing else is.
      raw = self._gba_worker_clock.stats()
      self._gba_hop_bs_totals = (raw if self._gba_hop_bs_totals is None else
                                 self._add_hop_bs_stats(self._gba_hop_bs_totals, raw))
      self._gba_worker_clock.reset()
    if self._gba_version_barrier is not None:
      self._gba_version_barrier.release()

  def worker_step_stats(self, calls=None):
    """Per worker: steps run, seconds busy and seconds of injected delay (read eagerly);
    `calls` (`BoundedCalls`): wait for each worker only up to its deadline."""
    return stragglers_lib.worker_step_stats(self._gba_num_workers, calls)

  @autograph.framework_function
  def run(self, fn, args=(), kwargs=None, options=None):
    """Like `ParameterServerStrategy.run`, with the token taken before `fn` reads parameters.

    The step is also timed on its worker, which counts it and, under a straggler profile,
    stretches it by the profile's factor: before it returns, or with `straggler_delay=
    "before_push"` between its gradients and their push (the GBA optimizer calls the delay).
    """

    hop_bs = self._gba_mode == "hop_bs"
    hop_bw = self._gba_mode == "hop_bw" and self._gba_uses_tokens
    from tf_gba.ops import worker_clock  # pylint: disable=g-import-not-at-top
    if hop_bs:
      clock = self.worker_clock
    if hop_bw:
      version_barrier = self.version_barrier

    @autograph.framework_function
    def step_fn(*a, **kw):
      barrier = []
      version = skip = None
      if hop_bs or hop_bw:
        worker = worker_clock.worker_index()
      if hop_bs:
        # The barrier comes first: a blocked worker has neither read parameters nor taken a
        # token, and its blocked time is not part of the step's measured (stretched) time.
        waited, _ = clock.wait(worker, self._gba_hop_bs_bound, self._gba_hop_bs_timeout_ms)
        barrier = [waited]
      if hop_bw:
        # Likewise: a worker that pushed for the current version waits for the next one.
        version, skip, waited = version_barrier.wait(worker)
        barrier = [waited]
      # Timed only under a straggler profile: without one the step carries a step count only.
      with tf.control_dependencies(barrier):
        start = stragglers_lib.timed_step_start(self._gba_stragglers)
      started = barrier if start is None else [start]
      with tf.control_dependencies(started):
        info = self._begin_step(version, skip)
      delayed = []
      if start is not None and self._gba_straggler_delay == stragglers_lib.BEFORE_PUSH:
        info.delay_before_push = lambda grads: self._delay_before_push(start, grads, delayed)
      deps = [t for t in tf.nest.flatten([info.token, info.reads]) if t is not None] + started
      with step_context.scope(info), packed_reads.step_scope(self._gba_reads), \
          tf.control_dependencies(deps):
        try:
          outputs = autograph.call_user_function(fn, *a, **kw)
        except ValueError as e:
          if "tf.keras.losses.Reduction.SUM" not in str(e):
            raise
          raise ValueError(LOSS_REDUCTION_HINT) from None
      if info.delay_before_push is not None and not delayed:
        # Delaying at the end instead would make the slow machine's gradients fresh again.
        raise ValueError(
            "straggler_delay='before_push' needs the GBA optimizer (tf_gba.optimizers.GBA) to "
            "push the step's gradients: it sleeps the straggler delay before the push. Use "
            "straggler_delay='after_push' with another optimizer.")
      done = [t for t in tf.nest.flatten(outputs) if isinstance(t, tf.Tensor)]
      with tf.control_dependencies(done):
        if delayed:
          delay = tf.identity(delayed[0])
        else:
          delay = stragglers_lib.timed_step_end(start, self._gba_stragglers,
                                                self._gba_straggler_seed)
      if hop_bs:
        # Finished (straggler delay included): the slowest worker's count moves the barrier.
        with tf.control_dependencies([delay]):
          delay = clock.tick(worker)
      if hop_bw:
        if info.completed is None:
          raise ValueError("mode='hop_bw' needs the GBA optimizer (tf_gba.optimizers.GBA) to "
                           "apply the step's gradients: it reports which buffers completed.")
        # After the pushes and the updates they completed (the step's outputs and the delay).
        with tf.control_dependencies([delay, info.completed]):
          delay = version_barrier.report(worker, version, tf.logical_not(skip), info.completed,
                                         info.num_buffers)
      with tf.control_dependencies([delay]):
        return tf.nest.map_structure(
            lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, outputs)

    return super().run(step_fn, args=args, kwargs=kwargs, options=options)
