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

from typing import Any, Callable, Dict, Optional

import tensorflow as tf

from tf_gba.distribute import step_context
from tf_gba.distribute import stragglers as stragglers_lib
from tf_gba.ops import gba_ops

# mode -> what it means for the optimizer buffers (see `GBAStrategy.buffer_config`).
MODES = ("gba", "async")
PS0_DEVICE = "/job:ps/replica:0/task:0/device:CPU:0"


class GBAStrategy(tf.distribute.experimental.ParameterServerStrategy):
  """A ParameterServerStrategy whose workers push (token, gradient) to buffers on the PS.

  Args:
    cluster_resolver: resolves a cluster with "chief" (this process), "worker" and "ps" jobs;
      `LocalCluster.resolver()` or `TFConfigClusterResolver()`.
    variable_partitioner: as for ParameterServerStrategy; shards large variables (embeddings)
      across parameter servers. Each shard gets its own buffer.
    mode: "gba" (aggregate M gradients per global step with staleness decay) or "async" (apply
      each gradient on arrival; staleness is still measured).
    num_aggregate: M for "gba". Default: taken from the GBA optimizer created under this
      strategy's scope, else the number of workers (SPEC: N_async = M).
    stragglers: a straggler profile (see `tf_gba.distribute.stragglers`), applied as real delays
      inside each worker's step; "none" by default.
    straggler_seed: seed of the transient slowdowns.
  """

  def __init__(self, cluster_resolver, variable_partitioner=None, mode: str = "gba",
               num_aggregate: Optional[int] = None, stragglers: str = "none",
               straggler_seed: int = 0):
    if mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    if num_aggregate is not None and num_aggregate < 1:
      raise ValueError(f"num_aggregate must be >= 1, got {num_aggregate}.")
    self._gba_stragglers = stragglers_lib.parse(stragglers)
    self._gba_straggler_seed = int(straggler_seed)
    super().__init__(cluster_resolver, variable_partitioner)
    spec = cluster_resolver.cluster_spec()
    self._gba_mode = mode
    self._gba_num_workers = len(spec.job_tasks("worker"))
    self._gba_num_ps = len(spec.job_tasks("ps"))
    self._gba_num_aggregate = num_aggregate
    self._gba_token_generator: Optional[gba_ops.TokenGenerator] = None
    self._gba_pre_step_readers: Dict[str, Callable[[], Any]] = {}
    self._gba_uses_tokens = False

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
    if self._gba_mode == "async":
      return 1
    return self._gba_num_aggregate or self._gba_num_workers

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
    if self._gba_mode == "async":
      # One gradient per step, never too stale: each push is applied on arrival.
      return gba_ops.BufferConfig(num_aggregate=1, staleness_threshold=gba_ops.NEVER_STALE,
                                  nonfinite=config.nonfinite,
                                  histogram_bins=config.histogram_bins)
    return config

  @property
  def token_generator(self) -> gba_ops.TokenGenerator:
    """The job's token generator on PS 0, created on first use."""
    if self._gba_token_generator is None:
      with tf.init_scope():
        self._gba_token_generator = gba_ops.TokenGenerator(
            self.num_aggregate, device=PS0_DEVICE, name="job_tokens")
    return self._gba_token_generator

  def register_pre_step_reader(self, name: str, fn: Callable[[], Any]) -> None:
    """Runs `fn()` at the start of every step, before the forward pass.

    Its result is available during the step as `step_context.current().reads[name]`.
    """
    self._gba_pre_step_readers[name] = fn

  def _begin_step(self) -> step_context.StepInfo:
    token = ticket = None
    if self._gba_uses_tokens:
      token, ticket = self.token_generator.fetch()
    reads = {name: fn() for name, fn in self._gba_pre_step_readers.items()}
    return step_context.StepInfo(token=token, ticket=ticket, reads=reads)

  def worker_step_stats(self):
    """Per worker: steps run, seconds busy and seconds of injected delay (read eagerly)."""
    return stragglers_lib.worker_step_stats(self._gba_num_workers)

  def run(self, fn, args=(), kwargs=None, options=None):
    """Like `ParameterServerStrategy.run`, with the token taken before `fn` reads parameters.

    The step is also timed on its worker, which counts it and, under a straggler profile,
    stretches it by the profile's factor before it returns.
    """

    def step_fn(*a, **kw):
      start = stragglers_lib.step_begin()
      with tf.control_dependencies([start]):
        info = self._begin_step()
      deps = [t for t in tf.nest.flatten([info.token, info.reads]) if t is not None] + [start]
      with step_context.scope(info), tf.control_dependencies(deps):
        outputs = fn(*a, **kw)
      done = [t for t in tf.nest.flatten(outputs) if isinstance(t, tf.Tensor)]
      with tf.control_dependencies(done):
        delay = stragglers_lib.step_end(start, self._gba_stragglers, self._gba_straggler_seed)
      with tf.control_dependencies([delay]):
        return tf.nest.map_structure(
            lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, outputs)

    return super().run(step_fn, args=args, kwargs=kwargs, options=options)
