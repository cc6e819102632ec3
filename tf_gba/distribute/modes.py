"""The parameter-server training modes: GBA and the baselines it is compared with.

SPEC section 1, "Baselines". Every mode runs on the same machinery (token per step, a gradient
buffer per variable on its parameter server); a mode is only a rule for the buffers, plus, for
Hop-BS, a barrier before each step (`tf_gba.ops.worker_clock`, applied by `GBAStrategy.run`):

  gba     M gradients per global step; a gradient whose token is more than iota steps old gets
          weight 0 (embedding rows: by each row's own staleness); the sum is divided by M.
  async   every gradient is applied on arrival (M = 1), whatever its staleness.
  bsp     b2 gradients per step, whatever version they were computed on; default
          b2 = max(1, round(N / 5)), the paper's ratio (20 of 100 workers): with b2 = N BSP would
          be GBA without decay.
  hop_bs  N gradients per step, as BSP, and bounded staleness: a worker blocks before a step
          while it has finished more than b1 steps beyond the slowest worker (no time limit
          unless one is given). **Settled:** the paper does not say how Hop-BS aggregates on a
          parameter server; N gradients per step keeps the synchronous global batch, like every
          other mode here.
  hop_bw  the first N - b3 gradients computed on version k make step k (default
          b3 = max(1, round(N / 5))); each worker computes at most one gradient per version:
          after pushing for version k it waits for version k + 1 (`tf_gba.ops.version_barrier`).
          A step's token is the version the barrier let it compute on, and a gradient with
          staleness > 0 (computed on k, arriving after step k was aggregated) is dropped whole
          (embedding rows too) without taking a place in the step, as backup workers' late
          gradients are.
"""

from typing import Optional

from tf_gba.ops import gba_ops

MODES = ("gba", "async", "bsp", "hop_bs", "hop_bw")
DEFAULT_HOP_BS_BOUND = 2      # b1, the paper's default
# Modes whose workers block at a barrier until other workers' steps let them go: they run one
# step per scheduled function. A function of several steps holds the steps it has not run yet;
# where every function is taken by a worker that waits, a slow worker has none to run and the
# barrier never opens (a 3-worker Hop-BS run of 60 steps in functions of 20 and 10 hung so).
BARRIER_MODES = ("hop_bs", "hop_bw")


def check_steps_per_execution(mode: str, steps_per_execution: int, what: str) -> None:
  """Refuses several steps per scheduled function in a barrier mode (BARRIER_MODES), naming
  `what` set them."""
  if mode in BARRIER_MODES and steps_per_execution != 1:
    raise ValueError(
        f"{what}={steps_per_execution} runs several worker steps per scheduled function, which "
        f"mode {mode!r} cannot: its barrier would wait on steps held in a function no worker "
        "can run. Use 1 (the default in this mode).")


def uses_buffers(mode: str) -> bool:
  """Whether `mode` aggregates gradients in the buffers (every mode but async): its optimizer
  must be tf_gba.optimizers.GBA, which pushes to them."""
  return mode != "async"


def default_bsp_aggregate(num_workers: int) -> int:
  """BSP's b2 when none is given: N / 5, the paper's 20 of 100 workers."""
  return max(1, round(num_workers / 5))


def default_hop_bw_backup(num_workers: int) -> int:
  """Hop-BW's b3 when none is given: N / 5 (paper: 20 of 100), leaving at least one gradient."""
  return min(max(1, round(num_workers / 5)), max(0, num_workers - 1))


def check_parameters(mode: str, num_workers: int, bsp_aggregate: Optional[int],
                     hop_bs_bound: int, hop_bs_timeout_s: Optional[float],
                     hop_bw_backup: Optional[int],
                     prefix: str = "") -> None:
  """Raises ValueError naming the parameter (`prefix` + its name, e.g. "--" for flags)."""
  if bsp_aggregate is not None and bsp_aggregate < 1:
    raise ValueError(f"{prefix}bsp_aggregate (b2) must be >= 1, got {bsp_aggregate}.")
  if hop_bs_bound < 0:
    raise ValueError(f"{prefix}hop_bs_bound (b1) must be >= 0, got {hop_bs_bound}.")
  if hop_bs_timeout_s is not None and not hop_bs_timeout_s > 0:
    raise ValueError(f"{prefix}hop_bs_timeout_s must be > 0 (unset: no time limit), got "
                     f"{hop_bs_timeout_s}.")
  if hop_bw_backup is None:
    hop_bw_backup = default_hop_bw_backup(num_workers)
  if mode == "hop_bw" and not 0 <= hop_bw_backup < num_workers:
    raise ValueError(f"{prefix}hop_bw_backup (b3) must be in [0, num_workers - 1] = "
                     f"[0, {num_workers - 1}]: each step takes num_workers - b3 >= 1 "
                     f"gradients; got {hop_bw_backup}.")


def num_aggregate_for(mode: str, num_workers: int, gba_num_aggregate: Optional[int] = None,
                      bsp_aggregate: Optional[int] = None,
                      hop_bw_backup: Optional[int] = None) -> int:
  """Gradients aggregated per global step in `mode`."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
  if mode == "async":
    return 1
  if mode == "bsp":
    return bsp_aggregate or default_bsp_aggregate(num_workers)
  if mode == "hop_bs":
    return num_workers
  if mode == "hop_bw":
    if hop_bw_backup is None:
      hop_bw_backup = default_hop_bw_backup(num_workers)
    return num_workers - hop_bw_backup
  return gba_num_aggregate or num_workers


def buffer_config_for(mode: str, config: gba_ops.BufferConfig,
                      num_aggregate: int) -> gba_ops.BufferConfig:
  """The buffers' configuration in `mode`, from the GBA optimizer's own `config`.

  GBA keeps the user's configuration; the baselines keep only its non-finite policy, histogram
  size and embedding divisor.
  """
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
  if mode == "gba":
    return config
  common = dict(num_aggregate=num_aggregate, nonfinite=config.nonfinite,
                histogram_bins=config.histogram_bins, sparse_normalize=config.sparse_normalize)
  if mode == "hop_bw":
    return gba_ops.BufferConfig(staleness_threshold=0, count_dropped=False,
                                per_id_staleness=False, **common)
  # async (M = 1), bsp and hop_bs: M gradients per step whatever their version.
  return gba_ops.BufferConfig(staleness_threshold=gba_ops.NEVER_STALE, **common)
