"""What one training run is asked to do, validated before anything starts."""

import dataclasses
import math
from typing import Optional

from tf_gba.distribute import modes as modes_lib
from tf_gba.distribute import stragglers as stragglers_lib
from tf_gba.ops import gba_ops
from tf_gba.training import mode_registry

# Parameter-server modes (GBAStrategy), then the all-reduce ones (one process per worker): the
# registry's (training/mode_registry.py).
PS_MODES = mode_registry.names(mode_registry.PARAMETER_SERVER)
# The paper's Async row (Table 5.1): async on the parameter servers with hyper-parameters of its
# own (Adagrad, its own learning rate and local batch), not Sync's as plain "async" keeps them.
ASYNC_TUNED = "async_tuned"
MODES = mode_registry.names()
# --mode=auto: starts in Sync, switches between Sync and GBA from measured step times.
AUTO = "auto"
MODEL_NAMES = ("deepfm", "dcn", "youtube_dnn")
# --embedding: the categorical fields' table over fixed vocabularies (ids folded modulo each
# vocabulary), or an expandable hash table over the raw ids (tf_gba.layers.HashEmbedding).
EMBEDDINGS = ("vocab", "hash")
# --embedding=hash's admission and eviction flags (SPEC section 6), 0 meaning off.
HASH_OPTION_FLAGS = ("hash_min_frequency", "hash_ttl_steps", "hash_max_rows",
                     "hash_admission_filter_cells")
INPUTS = ("shared", "sharded")
# Worker steps of a run that reads static shards and sets no --steps (the original default).
DEFAULT_STEPS = 2000
# --steps_per_execution's default with the shared data list: the coordinator's CPU per worker step
# falls with the steps per function and the steps per progress line (DeepFM on 4 workers,
# docs/step_cost.md: about 5.9 ms at 1 step per function; 0.46 at 20 with a line every 100 steps,
# 0.20 at 50 with a line every 200). A line costs the coordinator about 22 ms (its reads of every
# server's counters, Keras' epoch), so it is paid once per 200 steps by default.
MAX_DEFAULT_SCHEDULED_STEPS = 50


@dataclasses.dataclass
class TrainConfig:
  """Flags of the training binary; see examples/train.py for each one's meaning."""
  mode: str = "gba"
  model: str = "deepfm"
  data: str = "synthetic"
  num_ps: int = 1
  num_workers: int = 4
  global_batch_size: Optional[int] = None
  local_batch_size: int = 256
  staleness_threshold: int = 3
  # Divisor of an embedding row's aggregate in the parameter-server modes: M (what the all-reduce
  # Sync mode applies) or c(id), the number of entries containing the row (the paper's rule).
  sparse_normalize: str = "num_aggregate"
  stragglers: str = "none"
  straggler_seed: int = 0
  # Where a straggler sleeps in the parameter-server modes' step: after its push (its gradient
  # arrives on time) or before it (a slow machine: late, stale gradients).
  straggler_delay: str = "after_push"
  # Worker steps (local batches over all workers). None: one pass over the day's train rows with
  # the shared data list; DEFAULT_STEPS with static shards and in the all-reduce modes.
  steps: Optional[int] = None
  model_dir: str = "/tmp/tf_gba_train"
  eval_every: int = 0
  log_every: int = 200  # examples/train.py's flag says the same
  # Parameter-server modes: worker steps per scheduled function (None: the mode's default,
  # `scheduled_steps`).
  steps_per_execution: Optional[int] = None
  # Parameter-server modes: a step's dense reads of one server's variables in one transfer.
  pack_reads: bool = True
  learning_rate: float = 0.001
  embedding_dim: int = 8
  # "vocab" or "hash" (EMBEDDINGS): see examples/train.py --embedding.
  embedding: str = "vocab"
  # --embedding=hash's admission and eviction (0: off): see examples/train.py --hash_*.
  hash_min_frequency: int = 0
  hash_ttl_steps: int = 0
  hash_max_rows: int = 0
  hash_admission_filter_cells: int = 0
  eval_examples: int = 20000
  day: Optional[int] = None
  # Evaluate on every example of this day (train rows, then eval rows) instead of on the eval
  # split of `day`: the paper's protocol trains on one day and tests on the next.
  eval_day: Optional[int] = None
  seed: int = 0
  strict_data: bool = False
  # Where the local cluster's servers write their logs (None: a temporary directory, deleted with
  # the cluster), and whether the binary keeps them after the run.
  log_dir: Optional[str] = None
  keep_logs: bool = False
  # Periodic checkpoints during training (0: off; a checkpoint is always written at the end), in
  # worker steps as --steps, and in seconds; how many checkpoints model_dir keeps.
  checkpoint_every_steps: int = 0
  checkpoint_every_secs: float = 0.0
  keep_checkpoints: int = 3
  # --embedding=hash: every K-th periodic checkpoint (and the last) is full, the others hold only
  # the table rows changed since the checkpoint before (tf_gba.training.delta_checkpoints).
  full_checkpoint_every: int = 1
  # The serving SavedModel written at the end of a run (`tf_gba.training.export`): None
  # `<model_dir>/export`, "" none.
  export_dir: Optional[str] = None
  data_options: str = ""
  # Async mode keeps the GBA wrapper with M = 1 (every push applied at once) to measure staleness;
  # False runs the bare inner optimizer, ParameterServerStrategy's own asynchronous training.
  async_staleness_stats: bool = True
  # Baselines (SPEC section 1): BSP's b2 (None: max(1, round(N / 5))), Hop-BS's b1 and the time
  # a worker waits at its barrier before going on anyway (None: no limit), Hop-BW's b3 (None:
  # max(1, round(N / 5))).
  bsp_aggregate: Optional[int] = None
  hop_bs_bound: int = modes_lib.DEFAULT_HOP_BS_BOUND
  hop_bs_timeout_s: Optional[float] = None
  hop_bw_backup: Optional[int] = None
  # --mode=async_tuned: Adagrad's learning rate, and the local batch (None: --local_batch_size).
  async_tuned_learning_rate: float = 0.007
  async_tuned_local_batch_size: Optional[int] = None
  # --mode=dts: synchronous workers with a delayed (t) and temporally sparse (p) all-reduce.
  dts_delay: int = 4
  dts_period: int = 4
  dts_latency_ms: float = 0.0
  dts_inner: str = "momentum"
  dts_momentum: float = 0.9
  # Parameter-server modes' input: "shared" (one data list that every worker pulls its next batch
  # from, tf.data service with dynamic sharding; tf_gba.data.data_list) or "sharded" (each worker
  # repeats a static shard of the rows).
  input: str = "shared"
  # The shared list's tf.data service: workers the local cluster starts, or on a real cluster
  # (TF_CONFIG) the host:port of a dispatcher already running.
  tfdata_workers: int = 2
  tfdata_dispatcher: str = ""
  # A day whose steps make no progress this long ends, reporting the batches not trained on.
  stall_timeout_s: float = 120.0
  # On a real cluster (TF_CONFIG): how long the chief waits for its parameter servers and workers
  # to accept connections before it gives up (saying which it waited for).
  cluster_wait_s: float = 600.0
  # --mode=auto (tf_gba.training.auto_policy.PolicyConfig): to GBA at a predicted gain
  # >= 1 + margin, back to Sync below 1 + margin - hysteresis, after dwell_s seconds in a mode and
  # confirm consecutive observations.
  auto_margin: float = 0.3
  auto_hysteresis: float = 0.15
  auto_dwell_s: float = 20.0
  auto_confirm: int = 2
  # Each mode's measured / model QPS before its first stay (after it, unless
  # auto_learn_efficiency is off, the mode is predicted by its stay's measured step overhead); a switch's cost before one is measured; the time over
  # which a switch must pay for itself (at least auto_dwell_s).
  auto_sync_efficiency: float = 1.0
  auto_gba_efficiency: float = 1.0
  auto_learn_efficiency: bool = True
  auto_switch_cost_s: float = 15.0
  auto_horizon_s: float = 60.0
  # Seconds of a probe stay in each mode at the start (0: none): both modes' efficiencies are
  # measured before the first decision on them.
  auto_probe_s: float = 0.0
  # Training seconds before a mode's first stay (entered on the efficiency assumed for it, or
  # after the probe) may be left on its measured efficiency, instead of auto_dwell_s.
  auto_measure_s: float = 5.0
  # ShadowSync's elastic alpha (every rule); S-BMUF's step size eta, block momentum and Nesterov;
  # ASGD without gradient delay's maximal staleness tau and algorithm (1, or 2: cycles of tau/2);
  # a delay injected into every sync or merge (tests and benchmarks of background syncing).
  shadow_alpha: float = 0.5
  shadow_bmuf_eta: float = 1.0
  shadow_bmuf_momentum: float = 0.0
  shadow_bmuf_nesterov: bool = False
  asgd_tau: int = 4
  asgd_algorithm: int = 1
  shadow_sync_delay_ms: float = 0.0

  def __post_init__(self):
    if self.steps is None and not self.day_mode_possible:
      self.steps = DEFAULT_STEPS

  @property
  def day_mode_possible(self) -> bool:
    return self.uses_data_list

  @property
  def uses_data_list(self) -> bool:
    # (An unknown mode is not one: validate() names it.)
    return (self.mode in mode_registry.names(mode_registry.PARAMETER_SERVER) and
            self.input == "shared")

  def data_kwargs(self) -> dict:
    """`--data_options` ("key=value,...") as keyword arguments of the data source.

    The synthetic source defaults to 200,000 examples per day here (its library default is small,
    for tests), so the default run does not cycle over a few thousand examples and overfit.
    """
    out = {}
    for item in filter(None, (x.strip() for x in self.data_options.split(","))):
      key, sep, value = item.partition("=")
      if not sep or not key:
        raise ValueError(f"--data_options: expected key=value pairs separated by commas, got "
                         f"{item!r}.")
      for cast in (int, float):
        try:
          value = cast(value)
          break
        except ValueError:
          continue
      out[key.strip()] = value
    if self.data.strip().lower() == "synthetic":
      out.setdefault("num_examples", 200_000)
    if self.data.strip().lower().startswith("criteo"):
      if "ids" in out:
        raise ValueError("--data_options: 'ids' is set by --embedding (vocab: ids modulo "
                         "vocab_size; hash: 64-bit fingerprints); drop it.")
      # A HashEmbedding takes each value's fingerprint, without vocabulary or modulo. MovieLens'
      # and the synthetic source's ids are their own (raw, as generated) either way.
      out["ids"] = "fingerprint" if self.embedding == "hash" else "vocab"
    return out

  def validate(self) -> None:
    mode = mode_registry.get(self.mode)  # raises on an unknown mode
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      # inf and nan pass every range check (`inf > 0`) and train a model of NaNs.
      if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"--{field.name} must be a finite number, got {value}.")
    if mode.validate is not None:
      mode.validate(self)
    if self.embedding not in EMBEDDINGS:
      raise ValueError(f"--embedding must be one of {EMBEDDINGS}, got {self.embedding!r}.")
    if self.embedding == "hash":
      self._check_hash_embedding(mode)
    for name in HASH_OPTION_FLAGS:
      value = getattr(self, name)
      if value < 0:
        raise ValueError(f"--{name} must be >= 0 (0: off), got {value}.")
      if value and self.embedding != "hash":
        raise ValueError(f"--{name}={value} applies to --embedding=hash only: drop it, or add "
                         "--embedding=hash.")
    if self.hash_admission_filter_cells and self.hash_min_frequency < 2:
      raise ValueError(f"--hash_admission_filter_cells={self.hash_admission_filter_cells} holds "
                       "admission counts, but admission is off: add --hash_min_frequency=2 (or "
                       "more), or drop --hash_admission_filter_cells.")
    if 0 < self.hash_max_rows < self.num_ps and mode.kind == mode_registry.PARAMETER_SERVER:
      raise ValueError(f"--hash_max_rows={self.hash_max_rows} is below --num_ps={self.num_ps}: "
                       "each parameter server keeps hash_max_rows / num_ps rows; raise it.")
    if self.model not in MODEL_NAMES:
      raise ValueError(f"--model must be one of {MODEL_NAMES}, got {self.model!r}.")
    if self.input not in INPUTS:
      raise ValueError(f"--input must be one of {INPUTS}, got {self.input!r}.")
    if self.steps is None and not self.day_mode_possible:
      raise ValueError("--steps must be set unless a parameter-server mode reads the shared "
                       "data list (--input=shared), whose run ends when the day is consumed.")
    if self.uses_data_list and self.tfdata_workers < 1:
      raise ValueError(f"--tfdata_workers must be >= 1 with --input=shared, got "
                       f"{self.tfdata_workers}.")
    if not self.stall_timeout_s > 0:
      raise ValueError(f"--stall_timeout_s must be > 0, got {self.stall_timeout_s}.")
    if not self.cluster_wait_s > 0:
      raise ValueError(f"--cluster_wait_s must be > 0, got {self.cluster_wait_s}.")
    for name in ("num_ps", "num_workers", "local_batch_size", "steps", "log_every",
                 "embedding_dim", "steps_per_execution"):
      if getattr(self, name) is not None and getattr(self, name) < 1:
        raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}.")
    if self.eval_every < 0:
      raise ValueError(f"--eval_every must be >= 0 (0: only at the end), got {self.eval_every}.")
    if self.eval_day is not None and self.eval_day < 0:
      raise ValueError(f"--eval_day must be >= 0 (unset: the eval split of --day), got "
                       f"{self.eval_day}.")
    if self.sparse_normalize not in gba_ops.SPARSE_NORMALIZATIONS:
      raise ValueError(f"--sparse_normalize must be one of {gba_ops.SPARSE_NORMALIZATIONS}, got "
                       f"{self.sparse_normalize!r}.")
    if self.staleness_threshold < 0:
      raise ValueError(f"--staleness_threshold must be >= 0, got {self.staleness_threshold}.")
    if not self.async_tuned_learning_rate > 0:
      raise ValueError(f"--async_tuned_learning_rate must be > 0, got "
                       f"{self.async_tuned_learning_rate}.")
    if self.async_tuned_local_batch_size is not None and self.async_tuned_local_batch_size < 1:
      raise ValueError(f"--async_tuned_local_batch_size must be >= 1, got "
                       f"{self.async_tuned_local_batch_size}.")
    if not self.learning_rate > 0:
      raise ValueError(f"--learning_rate must be > 0, got {self.learning_rate}.")
    if self.checkpoint_every_steps < 0 or self.checkpoint_every_secs < 0:
      raise ValueError("--checkpoint_every_steps and --checkpoint_every_secs must be >= 0 (0: "
                       f"off), got {self.checkpoint_every_steps} and "
                       f"{self.checkpoint_every_secs}.")
    if self.keep_checkpoints < 1:
      raise ValueError(f"--keep_checkpoints must be >= 1, got {self.keep_checkpoints}.")
    if self.full_checkpoint_every < 1:
      raise ValueError(f"--full_checkpoint_every must be >= 1 (1: every checkpoint full), got "
                       f"{self.full_checkpoint_every}.")
    if self.full_checkpoint_every > 1 and self.embedding != "hash":
      raise ValueError(f"--full_checkpoint_every={self.full_checkpoint_every} writes hash-table "
                       "deltas between full checkpoints: it needs --embedding=hash (with "
                       f"--embedding={self.embedding} every checkpoint is full; drop the flag).")
    if (self.full_checkpoint_every > 1 and not self.checkpoint_every_steps
        and not self.checkpoint_every_secs):
      raise ValueError(f"--full_checkpoint_every={self.full_checkpoint_every} counts periodic "
                       "checkpoints: set --checkpoint_every_steps or --checkpoint_every_secs.")
    if self.eval_examples < 1:
      raise ValueError(f"--eval_examples must be >= 1, got {self.eval_examples}.")
    if self.day is not None and self.day < 0:
      raise ValueError(f"--day must be >= 0 (unset: every day), got {self.day}.")
    if self.global_batch_size is not None:
      if self.global_batch_size < 1:
        raise ValueError(f"--global_batch_size must be >= 1 (unset: local x workers), got "
                         f"{self.global_batch_size}.")
      if self.global_batch_size % self.local_batch_size:
        raise ValueError(
            f"--global_batch_size={self.global_batch_size} is not a multiple of "
            f"--local_batch_size={self.local_batch_size}: GBA aggregates a whole number "
            "M = global / local of local batches per step. Pick sizes that divide.")
    modes_lib.check_parameters(self.mode, self.num_workers, self.bsp_aggregate, self.hop_bs_bound,
                               self.hop_bs_timeout_s, self.hop_bw_backup, prefix="--")
    if self.steps_per_execution is not None:
      modes_lib.check_steps_per_execution(self.mode, self.steps_per_execution,
                                          "--steps_per_execution")
    stragglers_lib.parse(self.stragglers)  # raises with a message on a bad profile
    missing = sorted(w for w in stragglers_lib.named_workers(self.stragglers)
                     if w < 0 or w >= self.num_workers)
    if missing:
      raise ValueError(f"--stragglers={self.stragglers} names worker "
                       f"{', '.join(map(str, missing))}, which does not exist: the workers are "
                       f"0 to {self.num_workers - 1} (--num_workers={self.num_workers}).")
    stragglers_lib.check_placement(self.straggler_delay)
    if (self.straggler_delay == stragglers_lib.BEFORE_PUSH and self.mode == "async"
        and not self.async_staleness_stats):
      raise ValueError("--straggler_delay=before_push sleeps between the gradient and the GBA "
                       "buffer's push, which --noasync_staleness_stats (the bare optimizer) does "
                       "not have: drop one of the two.")
    self.data_kwargs()

  def hash_options(self) -> Optional[dict]:
    """The HashEmbedding's admission and eviction arguments (None with --embedding=vocab)."""
    if self.embedding != "hash":
      return None
    return {"min_frequency": self.hash_min_frequency, "ttl_steps": self.hash_ttl_steps,
            "max_rows": self.hash_max_rows,
            "admission_filter_cells": self.hash_admission_filter_cells}

  def _check_hash_embedding(self, mode) -> None:
    """--embedding=hash needs its table on the parameter servers, updated through GBA, or on
    every sync worker, updated with the all-gathered rows."""
    if not mode.hash_embedding:
      raise ValueError(
          f"--embedding=hash cannot run in --mode={self.mode}: the hash table lives on the "
          "parameter servers, updated through the GBA optimizer, or whole on every worker of "
          f"--mode=sync; only {', '.join(mode_registry.hash_embedding_modes())} host it; use one "
          "of them, or --embedding=vocab.")
    if self.mode == "async" and not self.async_staleness_stats:
      raise ValueError("--embedding=hash in --mode=async needs the GBA buffers (M=1) that "
                       "--noasync_staleness_stats turns off: the bare optimizer cannot update "
                       "hash rows; drop one of the two.")

  def interval_steps(self) -> int:
    """Worker steps of one `fit` epoch of the parameter-server modes: each progress line and each
    periodic checkpoint ends one (tf_gba.training.runner.epoch_steps). A run shorter than one
    interval is a single interval of its own length."""
    steps = math.gcd(self.log_every, self.checkpoint_every_steps or self.log_every)
    if self.steps is not None and 0 < self.steps < steps:
      return self.steps
    return steps

  def steps_trained(self) -> Optional[int]:
    """The worker steps a run of `--steps` trains (None: --steps unset, or --mode=auto, whose
    stays each train their own share)."""
    if self.steps is None or self.mode == AUTO:
      return None
    kind = mode_registry.get(self.mode).kind
    if kind == mode_registry.COLLECTIVE:
      # One global step is one local batch on every worker.
      return max(1, self.steps // self.num_workers) * self.num_workers
    if self.mode.startswith("shadow_") or self.mode == "asgd_nodelay":
      return self.steps  # one budget of worker steps
    interval = self.interval_steps()
    return math.ceil(self.steps / interval) * interval

  def steps_note(self) -> Optional[str]:
    """One line when --steps cannot be trained exactly: what is trained instead, and why."""
    trained = self.steps_trained()
    if trained is None or trained == self.steps:
      return None
    if mode_registry.get(self.mode).kind == mode_registry.COLLECTIVE:
      why = (f"--mode={self.mode} trains whole global steps of one batch on each of the "
             f"{self.num_workers} workers; pass a multiple of {self.num_workers} to train "
             "exactly that")
    else:
      interval = self.interval_steps()
      why = (f"the parameter-server modes train whole intervals of {interval} worker steps "
             f"(--log_every={self.log_every}"
             + (f", --checkpoint_every_steps={self.checkpoint_every_steps}"
                if self.checkpoint_every_steps else "")
             + f"); pass a multiple of {interval} to train exactly that")
    return f"--steps={self.steps} trains {trained} worker steps: {why}."

  @property
  def scheduled_steps(self) -> int:
    """Worker steps per function the coordinator schedules (--steps_per_execution): the flag, else
    the mode's default. With the shared data list, whose functions skip on a re-run the steps a
    failed worker had finished (tf_gba.training.rerun_ledger), up to MAX_DEFAULT_SCHEDULED_STEPS,
    fewer where an interval would otherwise hold fewer functions than workers (each worker takes
    whole functions); one in the barrier modes, which refuse more, and with static shards (Keras'
    own function, which a re-run trains again whole)."""
    if self.steps_per_execution is not None:
      return self.steps_per_execution
    if (self.input != "shared" or self.mode in modes_lib.BARRIER_MODES
        or mode_registry.get(self.mode).kind != mode_registry.PARAMETER_SERVER):
      return 1
    return max(1, min(MAX_DEFAULT_SCHEDULED_STEPS, self.interval_steps() // self.num_workers))

  @property
  def strategy_mode(self) -> str:
    """The GBAStrategy mode that runs this one (async_tuned is async with its own optimizer)."""
    return mode_registry.get(self.mode).strategy_mode or self.mode

  def resolved(self) -> "TrainConfig":
    """This config with mode-specific settings applied (async_tuned's own local batch)."""
    if self.mode == ASYNC_TUNED and self.async_tuned_local_batch_size:
      return dataclasses.replace(self, local_batch_size=self.async_tuned_local_batch_size,
                                 global_batch_size=None)
    return self

  @property
  def global_batch(self) -> int:
    """Examples per global step: GBA keeps the synchronous one (default local x workers)."""
    rule = mode_registry.get(self.mode).global_batch
    if rule is not None:
      return rule(self)
    return self.global_batch_size or self.local_batch_size * self.num_workers

  @property
  def num_aggregate(self) -> int:
    """M: local batches per global step (1 in async mode, where every push is a step)."""
    return mode_registry.get(self.mode).num_aggregate(self)
