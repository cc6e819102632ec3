"""The training modes: one record per mode, read by everything that lists, checks or runs modes.

The binary's `--mode` enum and help (examples/train.py), `TrainConfig` validation and its M rule
(training/config.py), the runner's dispatch (training/runner.py `run`), the benchmarks'
(benchmarks/mode_qps.py, benchmarks/switching.py, benchmarks/replay.py) and the replay's
(training/replay.py) mode lists and the flags each mode accepts all come from here. Two lists
of modes live elsewhere, as they must below this layer: the parameter servers' buffer rules
(tf_gba/distribute/modes.py) and the cluster simulator's (tf_gba/simulate/cluster.py);
tests/test_mode_lists.py keeps it to those. A mode is:

  register(Mode(
      name="gba",                                  # the --mode value
      help="...",                                  # one line, shown in --help
      kind=PARAMETER_SERVER,                       # or COLLECTIVE: which job family runs it
      run=lazy("tf_gba.training.runner:run_parameter_server"),  # (TrainConfig) -> summary dict
      flags=PS_FLAGS | {"staleness_threshold"},    # mode-specific flags it reads
      num_aggregate=_m_global_over_local,          # M: local batches per global step
      summary_fields=(),                           # summary keys it adds (training/summary.py)
      hash_embedding=True,                         # it can train --embedding=hash
      replayed=True,                               # tf_gba.training.replay reproduces it
  ))

Adding a mode is one `register(Mode(...))` call here, the module its `run` names, and its test.

Flags: a flag that some mode lists in `flags` is a mode-specific flag; the binary rejects one set
explicitly for a mode that does not list it (`unused_flags`), e.g. `--mode=async --bsp_aggregate=3`.
Flags no mode lists (model, data, steps, ...) are read by every mode.

This module imports neither TensorFlow nor the modules that run modes (`lazy` imports them when a
mode runs): the binary reads it for its flags before TensorFlow is loaded.
"""

import dataclasses
import importlib
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple

# "TrainConfig" below is tf_gba.training.config.TrainConfig, not imported: config reads this module.

# Job families: parameter-server modes run under GBAStrategy with model.fit (training/runner.py),
# collective ones run one process per worker on an all-reduce strategy.
PARAMETER_SERVER = "parameter_server"
COLLECTIVE = "collective"


@dataclasses.dataclass(frozen=True)
class Mode:
  """One training mode; see the module docstring for what reads each field."""
  name: str
  help: str
  kind: str
  run: Callable[["TrainConfig"], dict]
  num_aggregate: Callable[["TrainConfig"], int]
  flags: FrozenSet[str] = frozenset()
  summary_fields: Tuple[str, ...] = ()
  # The GBAStrategy mode of a parameter-server mode (its buffer rule: tf_gba.distribute.modes).
  strategy_mode: Optional[str] = None
  # Checks of the mode's own flags beyond their types: raises ValueError naming the flag.
  validate: Optional[Callable[["TrainConfig"], None]] = None
  # The mode's own hyper-parameter (a TrainConfig field) that benchmarks sweep.
  parameter: Optional[str] = None
  # Run by default where the benchmarks compare modes (the paper's comparison).
  compared: bool = False
  # Examples per global step, when not --global_batch_size (default local batch x workers).
  global_batch: Optional[Callable[["TrainConfig"], int]] = None
  # Whether the mode can train --embedding=hash: its embeddings live on the parameter servers
  # of a GBAStrategy and are updated through tf_gba.optimizers.GBA, whose keyed buffers feed the
  # hash table's fused update (tf_gba/layers/hash_embedding.py), or, in sync, every worker holds
  # the whole table and applies the all-gathered rows (tf_gba.optimizers.hash_rows
  # .apply_replicated). DTS's, ShadowSync's and ASGD's own jobs cannot host the table.
  hash_embedding: bool = False
  # Whether tf_gba.training.replay (and benchmarks.replay) can reproduce the mode from a simulated
  # timeline: the simulator models it (tf_gba/simulate/cluster.py) and its rule at the push is
  # sync's mean or a buffer of tf_gba.distribute.modes. Auto, DTS and the shadow modes are not.
  replayed: bool = False


_REGISTRY: Dict[str, Mode] = {}


def register(mode: Mode) -> Mode:
  if mode.name in _REGISTRY:
    raise ValueError(f"mode {mode.name!r} is registered twice.")
  if mode.kind not in (PARAMETER_SERVER, COLLECTIVE):
    raise ValueError(f"mode {mode.name!r}: kind must be {PARAMETER_SERVER!r} or "
                     f"{COLLECTIVE!r}, got {mode.kind!r}.")
  _REGISTRY[mode.name] = mode
  return mode


def get(name: str) -> Mode:
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(f"--mode must be one of {names()}, got {name!r}.") from None


def reads_input(name: str) -> bool:
  """Whether mode `name` reads `--input` (shared data list or static shards): the binary refuses
  the flag for the others."""
  return "input" in get(name).flags


def names(kind: Optional[str] = None, compared: Optional[bool] = None) -> Tuple[str, ...]:
  """Registered mode names in registration order, optionally of one kind / compared ones."""
  return tuple(m.name for m in _REGISTRY.values()
               if (kind is None or m.kind == kind) and
               (compared is None or m.compared == compared))


def all_modes() -> List[Mode]:
  return list(_REGISTRY.values())


def mode_flags() -> FrozenSet[str]:
  """Every mode-specific flag: those that at least one mode lists."""
  return frozenset().union(*(m.flags for m in _REGISTRY.values()))


def unused_flags(mode: str, flags_set: Iterable[str]) -> List[str]:
  """Of the flags set explicitly, the mode-specific ones `mode` does not read (sorted)."""
  own = get(mode).flags
  return sorted(f for f in set(flags_set) & mode_flags() if f not in own)


def unused_flags_message(mode: str, unused: List[str]) -> str:
  users = {f: [m.name for m in _REGISTRY.values() if f in m.flags] for f in unused}
  return ("--mode={} does not use {}; drop {}".format(
      mode, ", ".join(f"--{f} (used by {', '.join(users[f])})" for f in unused),
      "it" if len(unused) == 1 else "them"))


def hash_embedding_modes() -> Tuple[str, ...]:
  """The modes that can train --embedding=hash."""
  return tuple(m.name for m in _REGISTRY.values() if m.hash_embedding)


def replayed_modes() -> Tuple[str, ...]:
  """The modes that tf_gba.training.replay reproduces, in registration order."""
  return tuple(m.name for m in _REGISTRY.values() if m.replayed)


def help_text() -> str:
  """The binary's --mode help: one line per mode."""
  return "Training mode. " + "; ".join(f"{m.name}: {m.help}" for m in _REGISTRY.values()) + "."


def lazy(target: str) -> Callable[["TrainConfig"], dict]:
  """`run` that imports "package.module:function" when it is called (keeps this module light)."""
  module_name, _, attr = target.partition(":")

  def call(config):
    return getattr(importlib.import_module(module_name), attr)(config)
  call.__qualname__ = call.__name__ = f"lazy({target})"
  call.target = target
  return call


# ------------------------------------------------------------------------------------------------
# M rules. The baselines' defaults (b2, b3) live with their buffer rules in tf_gba.distribute.modes.

def _modes_lib():
  from tf_gba.distribute import modes  # pylint: disable=g-import-not-at-top
  return modes


def _m_one(config) -> int:
  """Every push is a global step."""
  del config
  return 1


def _m_global_over_local(config) -> int:
  """The synchronous global batch kept: M = global batch / local batch (default N)."""
  return (config.global_batch_size or config.local_batch_size * config.num_workers
          ) // config.local_batch_size


def _m_baseline(config) -> int:
  return _modes_lib().num_aggregate_for(config.mode, config.num_workers,
                                        bsp_aggregate=config.bsp_aggregate,
                                        hop_bw_backup=config.hop_bw_backup)


def _baseline_global_batch(config) -> int:
  # The baselines' global step aggregates M local batches, whatever --global_batch_size says.
  return _m_baseline(config) * config.local_batch_size


# Flags of every mode but DTS (whose job has none of these): stragglers, periodic checkpoints and
# the next-day evaluation. PS_FLAGS adds the parameter-server modes' own: the shared data list, the
# buffers' embedding divisor, the coordinator's restarts, where a straggler sleeps (before or
# after its push) and the hash tables' delta checkpoints.
_COMMON = frozenset({"stragglers", "straggler_seed", "checkpoint_every_steps",
                     "checkpoint_every_secs", "keep_checkpoints", "eval_day"})
PS_FLAGS = _COMMON | {"input", "tfdata_workers", "tfdata_dispatcher", "stall_timeout_s",
                      "sparse_normalize", "max_restarts", "straggler_delay",
                      "full_checkpoint_every", "steps_per_execution"}
_HOP_SUMMARY = ("blocked_seconds", "max_lead", "ignored_gradients")
_PS_RUN = lazy("tf_gba.training.runner:run_parameter_server")


def _validate_dts(config) -> None:
  if config.dts_delay < 1 or config.dts_period < 1:
    raise ValueError("--dts_delay and --dts_period must be >= 1 (1 and 1: plain sync).")
  if config.dts_inner not in ("sgd", "momentum"):
    raise ValueError(f"--dts_inner must be 'sgd' or 'momentum', got {config.dts_inner!r}.")
  if config.eval_day is not None:
    raise ValueError("--eval_day is not supported with --mode=dts (it evaluates on the eval "
                     "split of --day); leave --eval_day unset.")


register(Mode(
    name="sync", kind=COLLECTIVE, compared=True, replayed=True,
    help="synchronous workers, gradients all-reduced every step (MultiWorkerMirroredStrategy)",
    run=lazy("tf_gba.training.sync_job:run_sync"), num_aggregate=_m_global_over_local,
    flags=_COMMON | {"global_batch_size"}, hash_embedding=True))
register(Mode(
    name="gba", kind=PARAMETER_SERVER, strategy_mode="gba", compared=True, replayed=True,
    hash_embedding=True,
    help="global batch gradients aggregation on parameter servers (M = global / local batch, "
         "gradients staler than --staleness_threshold dropped)",
    run=_PS_RUN, num_aggregate=_m_global_over_local,
    flags=PS_FLAGS | {"global_batch_size", "staleness_threshold"}))
register(Mode(
    name="async", kind=PARAMETER_SERVER, strategy_mode="async", compared=True, replayed=True,
    hash_embedding=True,
    help="every gradient applied on arrival (M = 1)",
    run=_PS_RUN, num_aggregate=_m_one, flags=PS_FLAGS | {"async_staleness_stats"}))
register(Mode(
    name="bsp", kind=PARAMETER_SERVER, strategy_mode="bsp", compared=True, replayed=True,
    hash_embedding=True,
    parameter="bsp_aggregate", global_batch=_baseline_global_batch,
    help="b2 = --bsp_aggregate gradients per step, whatever their version",
    run=_PS_RUN, num_aggregate=_m_baseline, flags=PS_FLAGS | {"bsp_aggregate"}))
register(Mode(
    name="hop_bs", kind=PARAMETER_SERVER, strategy_mode="hop_bs", compared=True, replayed=True,
    hash_embedding=True,
    parameter="hop_bs_bound", global_batch=_baseline_global_batch, summary_fields=_HOP_SUMMARY,
    help="N gradients per step; a worker more than b1 = --hop_bs_bound steps ahead of the "
         "slowest blocks",
    run=_PS_RUN, num_aggregate=_m_baseline,
    flags=PS_FLAGS | {"hop_bs_bound", "hop_bs_timeout_s"}))
register(Mode(
    name="hop_bw", kind=PARAMETER_SERVER, strategy_mode="hop_bw", compared=True, replayed=True,
    hash_embedding=True,
    parameter="hop_bw_backup", global_batch=_baseline_global_batch, summary_fields=_HOP_SUMMARY,
    help="the first N - b3 gradients of each version make a step (b3 = --hop_bw_backup backup "
         "workers)",
    run=_PS_RUN, num_aggregate=_m_baseline, flags=PS_FLAGS | {"hop_bw_backup"}))
register(Mode(
    name="async_tuned", kind=PARAMETER_SERVER, strategy_mode="async",
    hash_embedding=True,
    help="async with its own Adagrad, learning rate and local batch (the paper's Async row)",
    run=_PS_RUN, num_aggregate=_m_one,
    flags=PS_FLAGS | {"async_tuned_learning_rate", "async_tuned_local_batch_size"}))
register(Mode(
    name="dts", kind=COLLECTIVE, validate=_validate_dts,
    help="synchronous workers with a delayed (--dts_delay) and temporally sparse (--dts_period) "
         "all-reduce",
    run=lazy("tf_gba.training.dts_job:run"), num_aggregate=_m_one,
    flags=frozenset({"dts_delay", "dts_period", "dts_latency_ms", "dts_inner"}),
    summary_fields=("dts_delay", "dts_period", "dts_latency_ms", "exchanges",
                    "blocked_seconds")))
register(Mode(
    name="auto", kind=COLLECTIVE, validate=lazy("tf_gba.training.auto_job:validate"),
    help="starts in sync and switches between sync and gba from the measured step times "
         "(--auto_*; tf_gba/training/auto_policy.py)",
    run=lazy("tf_gba.training.auto_job:run"), num_aggregate=_m_global_over_local,
    flags=_COMMON | {"auto_margin", "auto_hysteresis", "auto_dwell_s", "auto_confirm",
                     "auto_sync_efficiency", "auto_gba_efficiency", "auto_learn_efficiency",
                     "auto_switch_cost_s", "auto_horizon_s", "auto_probe_s",
                     "auto_measure_s", "steps_per_execution"},
    summary_fields=("final_mode", "train_seconds", "switches", "num_switches", "stays",
                    "timeline", "policy", "efficiency", "overhead_s", "switch_seconds")))

# ShadowSync and asynchronous SGD without gradient delay: embeddings on the parameter servers
# (updated asynchronously), dense replicas trained on each worker (tf_gba/training/shadow_job.py).
# Periodic checkpoints of the replicas' average, and the restarts that resume from them.
_RECOVERY_FLAGS = frozenset({"checkpoint_every_steps", "checkpoint_every_secs", "keep_checkpoints",
                             "max_restarts", "stall_timeout_s"})
_SHADOW_FLAGS = frozenset({"stragglers", "straggler_seed", "shadow_alpha",
                           "shadow_sync_delay_ms"}) | _RECOVERY_FLAGS
_SHADOW_RUN = lazy("tf_gba.training.shadow_job:run")
_SHADOW_VALIDATE = lazy("tf_gba.training.shadow_job:validate")
_SHADOW_SUMMARY = ("restored_from", "replica_spread_before_final_sync",
                   "replica_spread_after_final_sync", "sync", "shadow_alpha", "asgd",
                   "restored_shard_batches")
register(Mode(
    name="shadow_easgd", kind=PARAMETER_SERVER, validate=_SHADOW_VALIDATE,
    help="ShadowSync S-EASGD: dense replicas per worker, pulled elastically (--shadow_alpha) "
         "toward sync variables on the parameter servers by a background synchroniser",
    run=_SHADOW_RUN, num_aggregate=_m_one, flags=_SHADOW_FLAGS, summary_fields=_SHADOW_SUMMARY))
register(Mode(
    name="shadow_ma", kind=PARAMETER_SERVER, validate=_SHADOW_VALIDATE,
    help="ShadowSync S-MA: dense replicas per worker, averaged in the background",
    run=_SHADOW_RUN, num_aggregate=_m_one, flags=_SHADOW_FLAGS, summary_fields=_SHADOW_SUMMARY))
register(Mode(
    name="shadow_bmuf", kind=PARAMETER_SERVER, validate=_SHADOW_VALIDATE,
    help="ShadowSync S-BMUF: background block model-update filtering (--shadow_bmuf_*)",
    run=_SHADOW_RUN, num_aggregate=_m_one,
    flags=_SHADOW_FLAGS | {"shadow_bmuf_eta", "shadow_bmuf_momentum", "shadow_bmuf_nesterov"},
    summary_fields=_SHADOW_SUMMARY))
register(Mode(
    name="asgd_nodelay", kind=PARAMETER_SERVER, validate=_SHADOW_VALIDATE,
    help="asynchronous SGD without gradient delay: local steps merged as model deltas, a worker "
         "waits at --asgd_tau local steps past the last model it received",
    run=_SHADOW_RUN, num_aggregate=_m_one,
    flags=frozenset({"stragglers", "straggler_seed", "shadow_sync_delay_ms", "asgd_tau",
                     "asgd_algorithm"}) | _RECOVERY_FLAGS,
    summary_fields=_SHADOW_SUMMARY))
