"""Python wrappers of the GBA core ops: token generator, dense and sparse gradient buffers.

Each resource is a `TrackableResource`, created eagerly on the device it is given (a parameter
server, for distributed training) so that a `tf.function` closing over it runs its ops there, and
checkpointed through `_serialize_to_tensors` / `_restore_from_tensors`.

What is checkpointed, and what is not: the global step of every buffer, the row tags of sparse
buffers and the token count are saved. Gradients pushed but not yet aggregated (fewer than M in
the current global batch) are not: on restore they are discarded, exactly like tokens of workers
that died (the paper's "a token that never comes back is simply lost").
"""

import dataclasses
import itertools
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_gba.common import autograph
from tf_gba.ops import loader

DECAYS = ("threshold", "exponential")
NORMALIZATIONS = ("num_aggregate", "kept")
# Embedding rows: divide by M (an all-reduce Sync's mean) or by c(id) (the paper's rule).
SPARSE_NORMALIZATIONS = ("num_aggregate", "per_id")
NONFINITE_POLICIES = ("drop", "error")
# A threshold large enough that no gradient is ever too stale (async, BSP).
NEVER_STALE = 2**62

_uid = itertools.count()

# None of the GBA core ops has a gradient: they hand out tokens, keep gradients that were already
# computed, and report statistics; what they output is applied, never differentiated.
loader.no_gradient(
    "GBA>TokenGeneratorCreate", "GBA>TokenGeneratorFetch", "GBA>TokenGeneratorCount",
    "GBA>TokenGeneratorReset", "GBA>DenseBufferCreate", "GBA>DenseBufferPush",
    "GBA>DenseBufferStats", "GBA>DenseBufferSetStep", "GBA>SparseBufferCreate",
    "GBA>SparseBufferPush", "GBA>SparseBufferStats", "GBA>SparseBufferExport",
    "GBA>SparseBufferImport", "GBA>StepBegin", "GBA>StepEnd", "GBA>StepCount",
    "GBA>SetStepPosition", "GBA>WorkerStepStats", "GBA>StragglerFactors")


@autograph.framework_function
def _ops():
  return loader.load_op_library("gba")


def _unique_name(prefix: str) -> str:
  # Handles are found by shared_name in the PS's resource manager; a name reused by two buffers
  # would silently share one buffer between two variables.
  return f"tf_gba/{prefix}/{next(_uid)}_{id(object())}"


def _destroy(handle) -> None:
  tf.raw_ops.DestroyResourceOp(resource=handle, ignore_lookup_error=True)


@dataclasses.dataclass(frozen=True)
class BufferConfig:
  """How a buffer aggregates: M, the staleness decay and the policies (SPEC section 1).

  Attributes:
    num_aggregate: M, gradients per global step.
    staleness_threshold: iota; a gradient with staleness s <= iota has weight 1.
    decay: "threshold" (f = 1 if s <= iota else 0) or "exponential" (f = alpha**max(0, s - iota)).
    decay_alpha: alpha of the exponential decay, in (0, 1].
    normalize: "num_aggregate" divides the weighted sum by M; "kept" divides by the number of
      gradients with a non-zero weight (for embedding rows: of the entries counted by
      `sparse_normalize`, those whose weight for the row was not 0).
    sparse_normalize: embedding rows only. "num_aggregate" (default) divides a row's weighted sum
      by M, entries without the row counting as zero rows: what the all-reduce Sync mode applies,
      so that GBA without staleness equals Sync (SPEC "Zero-staleness equivalence"). "per_id"
      divides by c(id), the number of entries whose batch contained the row (the paper's rule).
    count_dropped: whether a dropped gradient still takes one of the M places.
    per_id_staleness: embedding buffers only: True judges each id by its own row's staleness
      (GBA); False judges every id of a push by the push's dense staleness, so a stale push is
      dropped whole (Hop-BW's backup workers; with count_dropped=False it leaves no trace).
    nonfinite: "drop" (weight 0, counted) or "error" for gradients with NaN/Inf.
    histogram_bins: size of the staleness histogram; the last bin collects s >= bins - 1.
  """
  num_aggregate: int
  staleness_threshold: int = 3
  decay: str = "threshold"
  decay_alpha: float = 0.5
  normalize: str = "num_aggregate"
  count_dropped: bool = True
  per_id_staleness: bool = True
  nonfinite: str = "drop"
  histogram_bins: int = 16
  sparse_normalize: str = "num_aggregate"

  def __post_init__(self):
    if not isinstance(self.num_aggregate, (int, np.integer)) or self.num_aggregate < 1:
      raise ValueError(f"num_aggregate (M) must be an integer >= 1, got {self.num_aggregate!r}.")
    if self.staleness_threshold < 0:
      raise ValueError(f"staleness_threshold must be >= 0, got {self.staleness_threshold}.")
    if self.decay not in DECAYS:
      raise ValueError(f"decay must be one of {DECAYS}, got {self.decay!r}.")
    if not 0.0 < self.decay_alpha <= 1.0:
      raise ValueError(f"decay_alpha must be in (0, 1], got {self.decay_alpha}.")
    if self.normalize not in NORMALIZATIONS:
      raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {self.normalize!r}.")
    if self.sparse_normalize not in SPARSE_NORMALIZATIONS:
      raise ValueError(f"sparse_normalize must be one of {SPARSE_NORMALIZATIONS}, got "
                       f"{self.sparse_normalize!r}.")
    if self.nonfinite not in NONFINITE_POLICIES:
      raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {self.nonfinite!r}.")
    if self.histogram_bins < 1:
      raise ValueError(f"histogram_bins must be >= 1, got {self.histogram_bins}.")

  def attrs(self) -> dict:
    """Attributes every buffer-creating op takes (sparse buffers add `sparse_normalize`)."""
    return dict(num_aggregate=int(self.num_aggregate),
                staleness_threshold=int(self.staleness_threshold), decay=self.decay,
                decay_alpha=float(self.decay_alpha), normalize=self.normalize,
                count_dropped=bool(self.count_dropped),
                per_id_staleness=bool(self.per_id_staleness), nonfinite=self.nonfinite,
                histogram_bins=int(self.histogram_bins))


@dataclasses.dataclass
class BufferStats:
  """Counters of one buffer (or the sum over several, see `merge`)."""
  global_step: int
  pending: int                 # entries in the current, unfinished global batch
  pushes: int
  aggregations: int
  dropped: int                 # dense: gradients; sparse: (push, id) pairs
  duplicates: int
  nonfinite: int
  staleness_sum: int
  staleness_max: int
  histogram: np.ndarray

  @property
  def mean_staleness(self) -> float:
    return self.staleness_sum / max(1, int(self.histogram.sum()))

  @staticmethod
  def from_outputs(step, entries, counters, hist) -> "BufferStats":
    c = [int(x) for x in np.asarray(counters)]
    return BufferStats(int(step), int(entries), *c, histogram=np.asarray(hist, np.int64))

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["histogram"] = [int(x) for x in self.histogram]
    d["mean_staleness"] = self.mean_staleness
    return d


class TokenGenerator(tf.saved_model.experimental.TrackableResource):
  """Hands out tokens: the i-th fetch returns (floor(i / M), i). One per job, on PS 0."""

  def __init__(self, num_aggregate: int, device: str = "", initial_count: int = 0,
               name: str = "token_generator"):
    if num_aggregate < 1:
      raise ValueError(f"num_aggregate (M) must be >= 1, got {num_aggregate}.")
    super().__init__(device=device)
    self._num_aggregate = int(num_aggregate)
    self._initial_count = int(initial_count)
    self._shared_name = _unique_name(name)
    with tf.init_scope():
      _ = self.resource_handle  # create now, eagerly, on `device`

  @property
  def num_aggregate(self) -> int:
    return self._num_aggregate

  def _create_resource(self):
    return _ops().gba_token_generator_create(
        num_aggregate=self._num_aggregate, initial_count=self._initial_count,
        shared_name=self._shared_name)

  def _destroy_resource(self):
    _destroy(self.resource_handle)

  @autograph.framework_function
  def fetch(self) -> Tuple[tf.Tensor, tf.Tensor]:
    """Returns (token, ticket) as int64 scalars."""
    with tf.device(self._resource_device):
      return _ops().gba_token_generator_fetch(self.resource_handle)

  def count(self) -> tf.Tensor:
    with tf.device(self._resource_device):
      return _ops().gba_token_generator_count(self.resource_handle)[0]

  def reset(self, count) -> tf.Operation:
    with tf.device(self._resource_device):
      return _ops().gba_token_generator_reset(self.resource_handle,
                                              tf.cast(count, tf.int64))

  def _serialize_to_tensors(self):
    return {"count": self.count()}

  def _restore_from_tensors(self, restored_tensors):
    return self.reset(restored_tensors["count"])


class _Buffer(tf.saved_model.experimental.TrackableResource):
  """What dense and sparse buffers share: creation on a device, config, statistics, cleanup."""

  def __init__(self, dtype, config: BufferConfig, device: str, initial_step: int, name: str):
    super().__init__(device=device)
    self._dtype = tf.as_dtype(dtype)
    self._config = config
    self._initial_step = int(initial_step)
    self._shared_name = _unique_name(name)

  def _create_now(self):
    with tf.init_scope():
      _ = self.resource_handle  # create now, eagerly, on the buffer's device

  @property
  def config(self) -> BufferConfig:
    return self._config

  @property
  def dtype(self):
    return self._dtype

  def _destroy_resource(self):
    _destroy(self.resource_handle)

  def _stats_op(self, handle):
    raise NotImplementedError

  def stats_tensors(self):
    with tf.device(self._resource_device):
      return self._stats_op(self.resource_handle)

  def stats(self) -> BufferStats:
    return BufferStats.from_outputs(*[t.numpy() for t in self.stats_tensors()])

  def global_step(self) -> tf.Tensor:
    return self.stats_tensors()[0]


class DenseBuffer(_Buffer):
  """Gradient buffer of one dense variable (or shard), on that variable's device."""

  def __init__(self, shape, dtype, config: BufferConfig, device: str = "",
               initial_step: int = 0, name: str = "dense_buffer"):
    super().__init__(dtype, config, device, initial_step, name)
    self._shape = tf.TensorShape(shape)
    if not self._shape.is_fully_defined():
      raise ValueError(f"A dense buffer needs a fully defined shape, got {self._shape}.")
    self._create_now()

  @property
  def shape(self):
    return self._shape

  def _stats_op(self, handle):
    return _ops().gba_dense_buffer_stats(handle)

  def _create_resource(self):
    return _ops().gba_dense_buffer_create(
        dtype=self._dtype, shape=self._shape, initial_step=self._initial_step,
        shared_name=self._shared_name, **self._config.attrs())

  def push(self, token, ticket, gradient):
    """Pushes one gradient; returns (ready, aggregate, global_step). See `GBA>DenseBufferPush`."""
    with tf.device(self._resource_device):
      return _ops().gba_dense_buffer_push(
          self.resource_handle, tf.cast(token, tf.int64), tf.cast(ticket, tf.int64), gradient)

  def set_step(self, step) -> tf.Operation:
    with tf.device(self._resource_device):
      return _ops().gba_dense_buffer_set_step(self.resource_handle, tf.cast(step, tf.int64))

  def _serialize_to_tensors(self):
    return {"global_step": self.global_step()}

  def _restore_from_tensors(self, restored_tensors):
    return self.set_step(restored_tensors["global_step"])


class SparseBuffer(_Buffer):
  """Gradient buffer of one embedding table (or shard) with per-row staleness tags.

  keyed=True: the buffer of one hash-table shard (num_rows 0): rows are named by int64 keys, and
  their tags are those in the table's rows (`push_keyed`).
  """

  def __init__(self, num_rows: int, row_shape, dtype, config: BufferConfig, device: str = "",
               initial_step: int = 0, name: str = "sparse_buffer", keyed: bool = False):
    super().__init__(dtype, config, device, initial_step, name)
    if keyed and num_rows:
      raise ValueError(f"A keyed buffer has no row numbers: num_rows must be 0, got {num_rows}.")
    self._keyed = bool(keyed)
    self._num_rows = int(num_rows)
    self._row_shape = tf.TensorShape(row_shape)
    if not self._row_shape.is_fully_defined():
      raise ValueError(f"row_shape must be fully defined, got {self._row_shape}.")
    self._create_now()

  @property
  def num_rows(self) -> int:
    return self._num_rows

  def _stats_op(self, handle):
    return _ops().gba_sparse_buffer_stats(handle)

  def _create_resource(self):
    return _ops().gba_sparse_buffer_create(
        dtype=self._dtype, num_rows=self._num_rows, row_shape=self._row_shape,
        initial_step=self._initial_step, shared_name=self._shared_name,
        sparse_normalize=self._config.sparse_normalize, keyed=self._keyed,
        **self._config.attrs())

  @property
  def keyed(self) -> bool:
    return self._keyed

  def push_keyed(self, token, ticket, keys, values, table_handle):
    """Pushes hash-table rows; returns (ready, keys, rows, global_step). See GBA>HashBufferPush.

    `table_handle`: the resource handle of the table shard on this buffer's device.
    """
    with tf.device(self._resource_device):
      return _ops().gba_hash_buffer_push(
          self.resource_handle, tf.cast(token, tf.int64), tf.cast(ticket, tf.int64),
          tf.cast(keys, tf.int64), values, table_handle)

  def push(self, token, ticket, indices, values):
    """Pushes embedding rows; returns (ready, ids, rows, global_step). See `GBA>SparseBufferPush`."""
    with tf.device(self._resource_device):
      return _ops().gba_sparse_buffer_push(
          self.resource_handle, tf.cast(token, tf.int64), tf.cast(ticket, tf.int64), indices,
          values)

  def export_state(self) -> Tuple[tf.Tensor, tf.Tensor]:
    """Returns (global_step, row_tags)."""
    with tf.device(self._resource_device):
      return _ops().gba_sparse_buffer_export(self.resource_handle)

  def import_state(self, global_step, row_tags) -> tf.Operation:
    with tf.device(self._resource_device):
      return _ops().gba_sparse_buffer_import(
          self.resource_handle, tf.cast(global_step, tf.int64), tf.cast(row_tags, tf.int64))

  def _serialize_to_tensors(self):
    step, tags = self.export_state()
    return {"global_step": step, "row_tags": tags}

  def _restore_from_tensors(self, restored_tensors):
    return self.import_state(restored_tensors["global_step"], restored_tensors["row_tags"])


def merge_stats(stats: Sequence[BufferStats]) -> Optional[BufferStats]:
  """Sums counters over buffers (max for staleness_max; the smallest global step)."""
  if not stats:
    return None
  bins = max(len(s.histogram) for s in stats)
  hist = np.zeros(bins, np.int64)
  for s in stats:
    hist[:len(s.histogram)] += s.histogram
  return BufferStats(
      global_step=min(s.global_step for s in stats), pending=max(s.pending for s in stats),
      pushes=sum(s.pushes for s in stats), aggregations=sum(s.aggregations for s in stats),
      dropped=sum(s.dropped for s in stats), duplicates=sum(s.duplicates for s in stats),
      nonfinite=sum(s.nonfinite for s in stats), staleness_sum=sum(s.staleness_sum for s in stats),
      staleness_max=max(s.staleness_max for s in stats), histogram=hist)
