"""The parameter-server training modes: GBA and the baselines it is compared with.

SPEC section 1, "Baselines". Every mode runs on the same machinery (token per step, a gradient
buffer per variable on its parameter server); a mode is only a rule for the buffers, plus, for
Hop-BS, a barrier before each step (`tf_gba.ops.worker_clock`, applied by `GBAStrategy.run`):

  gba     M gradients per global step; a gradient whose token is more than iota steps old gets
          weight 0 (embedding rows: by each row's own staleness); the sum is divided by M.
  async   every gradient is applied on arrival (M = 1), whatever its staleness.
  bsp     b2 gradients per step (default N), whatever version they were computed on.
  hop_bs  N gradients per step, as BSP, and bounded staleness: a worker blocks before a step
          while it has finished more than b1 steps beyond the slowest worker. **Settled:** the
          paper does not say how Hop-BS aggregates on a parameter server; N gradients per step
          keeps the synchronous global batch, like every other mode here.
  hop_bw  N - b3 gradients per step, only those computed on the current version: a step's token
          is the global step read with the parameters, and a gradient with staleness > 0 is
          ignored whole (embedding rows too) without taking a place in the step, as the late
          gradients of backup workers are.
"""

from typing import Optional

from tf_gba.ops import gba_ops

MODES = ("gba", "async", "bsp", "hop_bs", "hop_bw")
DEFAULT_HOP_BS_BOUND = 2      # b1, the paper's default
DEFAULT_HOP_BW_BACKUP = 1     # b3
DEFAULT_HOP_BS_TIMEOUT_S = 30.0


def check_parameters(mode: str, num_workers: int, bsp_aggregate: Optional[int],
                     hop_bs_bound: int, hop_bs_timeout_s: float, hop_bw_backup: int,
                     prefix: str = "") -> None:
  """Raises ValueError naming the parameter (`prefix` + its name, e.g. "--" for flags)."""
  if bsp_aggregate is not None and bsp_aggregate < 1:
    raise ValueError(f"{prefix}bsp_aggregate (b2) must be >= 1, got {bsp_aggregate}.")
  if hop_bs_bound < 0:
    raise ValueError(f"{prefix}hop_bs_bound (b1) must be >= 0, got {hop_bs_bound}.")
  if not hop_bs_timeout_s > 0:
    raise ValueError(f"{prefix}hop_bs_timeout_s must be > 0, got {hop_bs_timeout_s}.")
  if mode == "hop_bw" and not 0 <= hop_bw_backup < num_workers:
    raise ValueError(f"{prefix}hop_bw_backup (b3) must be in [0, num_workers - 1] = "
                     f"[0, {num_workers - 1}]: each step takes num_workers - b3 >= 1 "
                     f"gradients; got {hop_bw_backup}.")


def num_aggregate_for(mode: str, num_workers: int, gba_num_aggregate: Optional[int] = None,
                      bsp_aggregate: Optional[int] = None,
                      hop_bw_backup: int = DEFAULT_HOP_BW_BACKUP) -> int:
  """Gradients aggregated per global step in `mode`."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
  if mode == "async":
    return 1
  if mode == "bsp":
    return bsp_aggregate or num_workers
  if mode == "hop_bs":
    return num_workers
  if mode == "hop_bw":
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
