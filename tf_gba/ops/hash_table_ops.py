"""Python wrappers of the expandable hash embedding table ops (SPEC section 6).

`HashTableShard` is one shard of a table (one resource on one device); `ShardedHashTable` is the
whole table over P shards, key -> shard `mix64(key) mod P` (splitmix64's finaliser), and is what a
checkpoint holds: every row of every shard (keys, values, slots, tags, frequencies, last-seen
steps), gathered on save and re-sharded by key on restore, so a table saved over P parameter
servers restores into any other number of them, or into one process.

Admission and eviction (SPEC section 6, all off by default): `min_frequency=k` gives a key a row
only at its k-th training lookup (the zero row, and gradients counted as `filtered`, before);
`evict()` removes rows not seen for more than `ttl_steps` global steps, then, beyond `max_rows`
(the table's budget, split evenly over the shards), the least frequent, ties to the oldest
`last_seen`, then to the smallest key. A checkpoint save evicts first. With
`admission_filter_cells=C`, admission counts live in a counting Bloom filter of C one-byte cells per
shard instead of one exact count per key: fixed memory, early admissions from false positives.

Incremental checkpoints (`ShardedHashTable.enable_incremental_checkpoints`): a checkpoint holds
either every row or only the rows changed since the checkpoint before and the keys removed since
(a delta, applied on top when restored); tf_gba.training.delta_checkpoints writes and restores
them for the training binary's `--full_checkpoint_every`.

Example:

  table = ShardedHashTable(dim=8, devices=["/job:ps/task:0", "/job:ps/task:1"], seed=1)
  rows = table.lookup(tf.constant([3, 10**12], tf.int64), global_step=0)   # [2, 8]
  table.apply(keys, gradients, "adagrad", learning_rate=0.1, epsilon=1e-7)
"""

import itertools
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_gba.common import autograph
from tf_gba.ops import loader

INITIALIZERS = ("uniform", "normal", "zeros")
OPTIMIZERS = ("sgd", "adagrad", "adam")
# Slots per row of each optimizer (the order of `slots` in an export).
NUM_SLOTS = {"sgd": 0, "adagrad": 1, "adam": 2}
SLOT_NAMES = {"sgd": (), "adagrad": ("accumulator",), "adam": ("m", "v")}

_MASK64 = (1 << 64) - 1
_uid = itertools.count()

# The table's rows reach the optimizer through the layer's own gradient (tf_gba.layers), never
# through these ops' outputs.
loader.no_gradient(
    "GBA>HashTableCreate", "GBA>HashTableLookup", "GBA>HashTableFind", "GBA>HashTableApply",
    "GBA>HashTableSize", "GBA>HashTableExport", "GBA>HashTableImport", "GBA>HashKeyShard",
    "GBA>HashBufferPush", "GBA>HashTableEvict", "GBA>HashTableCounters",
    "GBA>HashTableExportFilter", "GBA>HashTableImportFilter", "GBA>HashTableExportDelta",
    "GBA>HashTableImportDelta", "GBA>HashTableTrackChanges")


@autograph.framework_function
def _ops():
  return loader.load_op_library("gba")


def mix64(key: int) -> int:
  """splitmix64's finaliser of a 64-bit key (Python ints; the ops' `mix64`)."""
  z = key & _MASK64
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
  return z ^ (z >> 31)


def shard_of_keys(keys, num_shards: int) -> tf.Tensor:
  """int32 shard of every int64 key: mix64(key) mod num_shards."""
  return _ops().gba_hash_key_shard(tf.convert_to_tensor(keys, tf.int64),
                                   tf.constant(num_shards, tf.int64))


def string_keys(strings) -> tf.Tensor:
  """int64 keys of strings: Fingerprint64 (tf.fingerprint), the same in every process."""
  strings = tf.convert_to_tensor(strings, tf.string)
  flat = tf.reshape(strings, [-1])
  # tf.fingerprint writes the 64-bit value little-endian: its 8 bytes are one int64.
  keys = tf.bitcast(tf.fingerprint(flat, method="farmhash64"), tf.int64)
  return tf.reshape(keys, tf.shape(strings))


def check_keys(keys, what: str = "ids") -> tf.Tensor:
  """keys as int64, or one line saying what to pass instead."""
  if isinstance(keys, tf.RaggedTensor):
    raise TypeError(f"{what} is a tf.RaggedTensor: pass a dense tensor (ragged.to_tensor() with "
                    "a padding id) or one lookup per row.")
  if isinstance(keys, tf.SparseTensor):
    raise TypeError(f"{what} is a tf.SparseTensor: pass a dense tensor of ids "
                    "(tf.sparse.to_dense with a padding id).")
  keys = tf.convert_to_tensor(keys)
  if keys.dtype == tf.string:
    return string_keys(keys)
  if not keys.dtype.is_integer:
    raise TypeError(f"{what} must be integers (int32/int64) or strings, got {keys.dtype.name}: "
                    "cast float ids with tf.cast(ids, tf.int64) if they hold whole numbers.")
  return tf.cast(keys, tf.int64)


class HashTableShard(tf.saved_model.experimental.TrackableResource):
  """One shard of a hash embedding table, created eagerly on `device`.

  Not checkpointed by itself: `ShardedHashTable` saves and restores the rows of all its shards.
  """

  def __init__(self, dim: int, device: str = "", seed: int = 0, initializer: str = "uniform",
               init_a: float = -0.05, init_b: float = 0.05, name: str = "hash_table",
               min_frequency: int = 0, ttl_steps: int = 0, max_rows: int = 0,
               filter_cells: int = 0):
    super().__init__(device=device)
    self._dim = int(dim)
    self._attrs = dict(dim=self._dim, seed=int(seed), initializer=initializer,
                       init_a=float(init_a), init_b=float(init_b),
                       min_frequency=int(min_frequency), ttl_steps=int(ttl_steps),
                       max_rows=int(max_rows), filter_cells=int(filter_cells))
    self._shared_name = f"tf_gba/{name}/{next(_uid)}_{id(object())}"
    with tf.init_scope():
      _ = self.resource_handle  # create now, on `device`

  @property
  def dim(self) -> int:
    return self._dim

  @property
  def device(self) -> str:
    return self._resource_device

  def _create_resource(self):
    return _ops().gba_hash_table_create(shared_name=self._shared_name, **self._attrs)

  def _destroy_resource(self):
    tf.raw_ops.DestroyResourceOp(resource=self.resource_handle, ignore_lookup_error=True)

  def lookup(self, keys, global_step=-1) -> tf.Tensor:
    """Training lookup (find-or-insert, frequency += 1, last_seen = global_step): [n, dim].

    global_step < 0: the step the shard knows, one past the iteration of its latest apply.
    """
    with tf.device(self._resource_device):
      return _ops().gba_hash_table_lookup(self.resource_handle, keys,
                                          tf.cast(global_step, tf.int64))

  def find(self, keys) -> tf.Tensor:
    """Evaluation lookup: missing keys get their initial rows, nothing is inserted: [n, dim]."""
    with tf.device(self._resource_device):
      return _ops().gba_hash_table_find(self.resource_handle, keys)

  def apply(self, keys, gradients, optimizer: str, learning_rate, iteration=0, beta_1=0.9,
            beta_2=0.999, epsilon=1e-7, initial_accumulator: float = 0.1) -> tf.Operation:
    """The fused row update of `optimizer` ("sgd", "adagrad" or "adam" = LazyAdam)."""
    if optimizer not in OPTIMIZERS:
      raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}.")
    f32 = lambda x: tf.cast(x, tf.float32)  # pylint: disable=unnecessary-lambda-assignment
    with tf.device(self._resource_device):
      return _ops().gba_hash_table_apply(
          self.resource_handle, keys, gradients, f32(learning_rate), f32(beta_1), f32(beta_2),
          f32(epsilon), tf.cast(iteration, tf.int64), optimizer=optimizer,
          initial_accumulator=float(initial_accumulator))

  def size(self) -> Tuple[tf.Tensor, tf.Tensor]:
    """(rows, allocated bytes)."""
    with tf.device(self._resource_device):
      return _ops().gba_hash_table_size(self.resource_handle)

  def evict(self, global_step=-1, with_rows: bool = True) -> Dict[str, tf.Tensor]:
    """Runs eviction (TTL, then the budget) at `global_step` (< 0: the shard's own).

    Returns the removed rows: keys [n], values [n, dim], frequency [n] (all empty without
    `with_rows`).
    """
    with tf.device(self._resource_device):
      out = _ops().gba_hash_table_evict(self.resource_handle, tf.cast(global_step, tf.int64),
                                        with_rows=with_rows)
    return dict(zip(("keys", "values", "frequency"), out))

  def counters(self) -> tf.Tensor:
    """int64 [5]: COUNTER_FIELDS (rows, pending, admitted, filtered, evicted)."""
    with tf.device(self._resource_device):
      return _ops().gba_hash_table_counters(self.resource_handle)

  def export(self) -> Dict[str, tf.Tensor]:
    """Every row (EXPORT_FIELDS) and admission's pending counts (PENDING_FIELDS)."""
    with tf.device(self._resource_device):
      out = _ops().gba_hash_table_export(self.resource_handle)
    return dict(zip(EXPORT_FIELDS + PENDING_FIELDS, out))

  def export_filter(self) -> tf.Tensor:
    """uint8 [filter_cells]: the admission filter's cells (empty without a filter)."""
    with tf.device(self._resource_device):
      return _ops().gba_hash_table_export_filter(self.resource_handle)

  def import_filter(self, cells) -> tf.Operation:
    """Replaces the admission filter's cells (as `export_filter` returns them)."""
    with tf.device(self._resource_device):
      return _ops().gba_hash_table_import_filter(self.resource_handle,
                                                 tf.convert_to_tensor(cells, tf.uint8))

  def import_rows(self, rows: Dict[str, tf.Tensor]) -> tf.Operation:
    """Replaces the shard's rows with `rows` (as `export` returns them; pending counts optional)."""
    pending = [rows[f] if f in rows else tf.zeros([0], tf.int64) for f in PENDING_FIELDS]
    with tf.device(self._resource_device):
      return _ops().gba_hash_table_import(self.resource_handle,
                                          *[rows[f] for f in EXPORT_FIELDS], *pending)


  def export_delta(self, since) -> Dict[str, tf.Tensor]:
    """The rows changed after write number `since` (every row for since < 0; EXPORT_FIELDS),
    all pending counts (PENDING_FIELDS), `deleted_keys` (removed after `since`, known once
    `track_changes` was called) and `sequence`, the table's current write number."""
    with tf.device(self._resource_device):
      out = _ops().gba_hash_table_export_delta(self.resource_handle, tf.cast(since, tf.int64))
    return dict(zip(EXPORT_FIELDS + PENDING_FIELDS + (DELETED_FIELD, "sequence"), out))

  def import_delta(self, rows: Dict[str, tf.Tensor], replace) -> tf.Operation:
    """replace (bool): `import_rows(rows)`; otherwise inserts or overwrites `rows`, removes
    `rows["deleted_keys"]` and replaces the pending counts."""
    pending = [rows[f] if f in rows else tf.zeros([0], tf.int64) for f in PENDING_FIELDS]
    deleted = rows.get(DELETED_FIELD, tf.zeros([0], tf.int64))
    with tf.device(self._resource_device):
      return _ops().gba_hash_table_import_delta(
          self.resource_handle, tf.cast(replace, tf.bool), *[rows[f] for f in EXPORT_FIELDS],
          *pending, deleted)

  def track_changes(self, prune_through=-1) -> tf.Tensor:
    """Keeps the keys removed from now on (for `export_delta`), forgets those removed at or
    before write number `prune_through`, and returns the current write number."""
    with tf.device(self._resource_device):
      return _ops().gba_hash_table_track_changes(self.resource_handle,
                                                 tf.cast(prune_through, tf.int64))


EXPORT_FIELDS = ("keys", "values", "slots", "tags", "frequency", "last_seen")
# Admission's keys without a row yet: their training-lookup counts and latest steps.
PENDING_FIELDS = ("pending_keys", "pending_counts", "pending_last_seen")
# With an admission filter: its cells, [shards, filter_cells] (one row per shard when saved).
FILTER_FIELD = "admission_filter"
# Incremental checkpoints: the keys removed since the checkpoint before, and whether the rows are
# a delta (1) on top of that checkpoint or the whole table (0).
DELETED_FIELD = "deleted_keys"
DELTA_FIELD = "delta"
_LAST_SEQUENCE = (1 << 63) - 1
# The order of HashTableShard.counters().
COUNTER_FIELDS = ("rows", "pending", "admitted", "filtered", "evicted")


def _budget_split(max_rows: int, num_shards: int) -> List[int]:
  """Each shard's share of the table's max_rows (0: off): as even as whole rows allow."""
  if not max_rows:
    return [0] * num_shards
  return [max_rows // num_shards + (1 if i < max_rows % num_shards else 0)
          for i in range(num_shards)]


class ShardedHashTable(tf.__internal__.tracking.Trackable):
  """A hash embedding table over `len(devices)` shards, key -> shard mix64(key) mod P.

  Lookups deduplicate the keys, send each shard only its own (one op per shard, on the shard's
  device) and stitch the rows back in the keys' order.

  Checkpoint entries: `keys`, `values`, `slots`, `tags`, `frequency`, `last_seen`: every row of
  every shard, and, with `min_frequency` > 1, `pending_keys`, `pending_counts`,
  `pending_last_seen`: admission's counts (gathered on save; any order). A table without
  admission saves and reads the six row entries only, as before admission existed. With
  `admission_filter_cells`, `admission_filter` replaces the pending entries: every shard's filter,
  [P, C]. Restoring re-shards the rows by key into this table's shards; the filters go back to their
  own shards when P is unchanged, and otherwise every shard gets the cell-wise maximum of the saved
  ones (each key's count stays at or above its true count: only early admissions can follow). With
  `ttl_steps` or `max_rows`, every shard evicts before its rows are saved.

  `eviction_interval`: the GBA optimizer runs `evict` on each shard every that many global steps
  (with `ttl_steps` or `max_rows` set).

  Incremental checkpoints (`enable_incremental_checkpoints`): two more entries, `deleted_keys`
  and `delta`, and a checkpoint holds either the whole table (`delta` 0, `deleted_keys` empty)
  or, after `stage_checkpoint(full=False)`, only the rows changed since the checkpoint this table
  wrote or restored last, with the keys removed since (`delta` 1; pending counts and filters are
  whole in both). Restoring a delta applies it on top of the table: the full checkpoint and then
  every delta after it, in order, give the table of the last delta.
  """

  def __init__(self, dim: int, devices: Sequence[str] = ("",), seed: int = 0,
               initializer: str = "uniform", init_a: float = -0.05, init_b: float = 0.05,
               name: str = "hash_table", min_frequency: int = 0, ttl_steps: int = 0,
               max_rows: int = 0, eviction_interval: int = 100, admission_filter_cells: int = 0):
    if int(dim) != dim or dim < 1:
      raise ValueError(f"dim (the embedding width) must be an integer >= 1, got {dim!r}.")
    if initializer not in INITIALIZERS:
      raise ValueError(f"initializer must be one of {INITIALIZERS}, got {initializer!r}.")
    if not devices:
      raise ValueError("A hash table needs at least one device for its shards.")
    for what, value in (("min_frequency", min_frequency), ("ttl_steps", ttl_steps),
                        ("max_rows", max_rows)):
      if int(value) != value or value < 0:
        raise ValueError(f"{what} must be an integer >= 0 (0: off), got {value!r}.")
    if int(admission_filter_cells) != admission_filter_cells or admission_filter_cells < 0:
      raise ValueError("admission_filter_cells must be an integer >= 0 (0: exact admission "
                       f"counts), got {admission_filter_cells!r}.")
    if admission_filter_cells and min_frequency <= 1:
      raise ValueError(f"admission_filter_cells={admission_filter_cells} holds admission counts, "
                       "but admission is off (min_frequency <= 1): set min_frequency >= 2, or "
                       "drop admission_filter_cells.")
    if 0 < max_rows < len(devices):
      raise ValueError(f"max_rows={max_rows} is below the number of shards ({len(devices)}): each "
                       "shard keeps max_rows / shards rows; raise it or use fewer shards.")
    if int(eviction_interval) != eviction_interval or eviction_interval < 1:
      raise ValueError(f"eviction_interval must be an integer >= 1 (global steps), got "
                       f"{eviction_interval!r}.")
    self.min_frequency, self.ttl_steps, self.max_rows = (int(min_frequency), int(ttl_steps),
                                                         int(max_rows))
    self.eviction_interval = int(eviction_interval)
    self.admission_filter_cells = int(admission_filter_cells)
    self._dim = int(dim)
    self._seed = int(seed)
    self._name = name
    self._incremental = False
    self._base = None     # each shard's write number at the last checkpoint written or restored
    self._staged = None   # (entries, each shard's write number, full) of the next save
    self._shards = [HashTableShard(dim, device=d, seed=seed, initializer=initializer,
                                   init_a=init_a, init_b=init_b, name=f"{name}_{i}",
                                   min_frequency=min_frequency, ttl_steps=ttl_steps,
                                   max_rows=budget, filter_cells=admission_filter_cells)
                    for i, (d, budget) in enumerate(zip(devices,
                                                        _budget_split(max_rows, len(devices))))]

  @property
  def dim(self) -> int:
    return self._dim

  @property
  def shards(self) -> List[HashTableShard]:
    return list(self._shards)

  @property
  def num_shards(self) -> int:
    return len(self._shards)

  def partition(self, keys: tf.Tensor) -> Tuple[List[tf.Tensor], List[tf.Tensor]]:
    """Keys of each shard and their positions in `keys` (a vector)."""
    p = len(self._shards)
    if p == 1:
      return [keys], [tf.range(tf.size(keys))]
    shard = shard_of_keys(keys, p)
    positions = tf.dynamic_partition(tf.range(tf.size(keys)), shard, p)
    return tf.dynamic_partition(keys, shard, p), positions

  def _per_shard(self, keys: tf.Tensor, fn) -> tf.Tensor:
    parts, positions = self.partition(keys)
    rows = [fn(shard, part) for shard, part in zip(self._shards, parts)]
    if len(rows) == 1:
      return rows[0]
    return tf.dynamic_stitch(positions, rows)

  def lookup(self, keys, global_step=-1) -> tf.Tensor:
    """Training lookup of a vector of distinct keys: [n, dim] (see HashTableShard.lookup)."""
    return self._per_shard(keys, lambda s, k: s.lookup(k, global_step))

  def find(self, keys) -> tf.Tensor:
    """Evaluation lookup of a vector of keys (nothing inserted): [n, dim]."""
    return self._per_shard(keys, lambda s, k: s.find(k))

  def apply(self, keys, gradients, optimizer: str, **hyper) -> tf.Operation:
    """The fused update on each shard of its own keys' rows (see HashTableShard.apply)."""
    keys = tf.convert_to_tensor(keys, tf.int64)
    parts, positions = self.partition(keys)
    ops = [shard.apply(k, tf.gather(gradients, pos), optimizer, **hyper)
           for shard, k, pos in zip(self._shards, parts, positions)]
    return tf.group(ops)

  def size(self) -> int:
    """Rows over all shards (eager)."""
    return int(sum(int(s.size()[0]) for s in self._shards))

  def allocated_bytes(self) -> int:
    """Bytes the shards hold (eager)."""
    return int(sum(int(s.size()[1]) for s in self._shards))

  @property
  def evicts(self) -> bool:
    """Whether eviction has anything to do (ttl_steps or max_rows set, or an admission filter,
    which decays at evictions)."""
    return bool(self.ttl_steps or self.max_rows or self.admission_filter_cells)

  def evict(self, global_step=-1) -> tf.Operation:
    """Eviction on every shard, each on its own device (see HashTableShard.evict)."""
    return tf.group([s.evict(global_step, with_rows=False)["keys"] for s in self._shards])

  def counters(self) -> Dict[str, int]:
    """COUNTER_FIELDS summed over the shards (eager)."""
    total = np.sum([s.counters().numpy() for s in self._shards], axis=0)
    return {f: int(v) for f, v in zip(COUNTER_FIELDS, total)}

  def export(self) -> Dict[str, tf.Tensor]:
    """Every row and pending count of every shard, concatenated (on the caller's device)."""
    parts = [s.export() for s in self._shards]
    if len(parts) == 1:
      return parts[0]
    return {f: tf.concat([p[f] for p in parts], axis=0) for f in EXPORT_FIELDS + PENDING_FIELDS}

  def _split_rows(self, rows: Dict[str, tf.Tensor]) -> List[Dict[str, tf.Tensor]]:
    """Per shard, the rows (EXPORT_FIELDS) and pending counts (if any) of `rows` it owns."""
    _, positions = self.partition(tf.convert_to_tensor(rows["keys"], tf.int64))
    if "pending_keys" in rows:
      _, pending_positions = self.partition(tf.convert_to_tensor(rows["pending_keys"], tf.int64))
    else:
      pending_positions = [None] * len(self._shards)
    parts = []
    for pos, ppos in zip(positions, pending_positions):
      part = {f: tf.gather(rows[f], pos) for f in EXPORT_FIELDS}
      if ppos is not None:
        part.update({f: tf.gather(rows[f], ppos) for f in PENDING_FIELDS})
      parts.append(part)
    return parts

  def import_rows(self, rows: Dict[str, tf.Tensor]) -> tf.Operation:
    """Replaces every shard's rows (and pending counts) with those of `rows` whose keys it owns."""
    return tf.group([shard.import_rows(part)
                     for shard, part in zip(self._shards, self._split_rows(rows))])

  # ---- checkpointing ---------------------------------------------------------------------------
  def _checkpoint_fields(self) -> Tuple[str, ...]:
    if self.admission_filter_cells:
      return EXPORT_FIELDS
    return EXPORT_FIELDS + (PENDING_FIELDS if self.min_frequency > 1 else ())

  def export_filters(self) -> tf.Tensor:
    """uint8 [shards, admission_filter_cells]: every shard's admission filter."""
    return tf.stack([s.export_filter() for s in self._shards])

  def import_filters(self, cells) -> tf.Operation:
    """Every shard's filter from `cells` [P', C]: row i for shard i when P' is this table's shard
    count, else the cell-wise maximum of all rows for every shard."""
    cells = tf.convert_to_tensor(cells, tf.uint8)
    if cells.shape.rank != 2:
      raise ValueError(f"admission filters must be [shards, cells], got shape {cells.shape}.")
    if cells.shape[0] == len(self._shards):
      return tf.group([s.import_filter(cells[i]) for i, s in enumerate(self._shards)])
    merged = tf.reduce_max(cells, axis=0)
    return tf.group([s.import_filter(merged) for s in self._shards])

  # ---- incremental checkpoints (eager: the runner calls these around each save) ---------------
  @property
  def incremental(self) -> bool:
    return self._incremental

  def enable_incremental_checkpoints(self) -> None:
    """From now on every shard keeps the keys it removes, and checkpoints carry `deleted_keys`
    and `delta` (see the class docstring). The first checkpoint after this must be full."""
    for s in self._shards:
      s.track_changes(-1)
    self._incremental = True

  def stage_checkpoint(self, full: bool) -> None:
    """Exports what the next save writes: every row (full) or the delta since the checkpoint
    written or restored last. Evicts first. Nothing changes until `checkpoint_written`."""
    if not self._incremental:
      raise ValueError("stage_checkpoint needs enable_incremental_checkpoints() first.")
    if not full and self._base is None:
      raise ValueError("A delta checkpoint needs a full checkpoint before it (written or "
                       "restored by this table): stage_checkpoint(full=True) first.")
    if self.evicts:
      self.evict()
    parts = [s.export_delta(-1 if full else base)
             for s, base in zip(self._shards, self._base or [None] * len(self._shards))]
    fields = self._checkpoint_fields() + (DELETED_FIELD,)
    out = {f: tf.concat([p[f] for p in parts], axis=0) for f in fields}
    out[DELTA_FIELD] = tf.constant(0 if full else 1, tf.int64)
    if self.admission_filter_cells:
      out[FILTER_FIELD] = self.export_filters()
    self._staged = (out, [int(p["sequence"]) for p in parts], bool(full))

  @property
  def staged_entries(self) -> Optional[Dict[str, tf.Tensor]]:
    """The entries the next save writes (after `stage_checkpoint`), or None."""
    return None if self._staged is None else dict(self._staged[0])

  def checkpoint_written(self) -> None:
    """The staged checkpoint is on disk: the next delta starts from it, and after a full one the
    shards forget the keys removed before it (no delta needs them any more)."""
    if self._staged is None:
      return
    _, sequences, full = self._staged
    self._staged = None
    if full:
      for s, seq in zip(self._shards, sequences):
        s.track_changes(seq)
    self._base = sequences

  def discard_staged_checkpoint(self) -> None:
    """The staged checkpoint was not written (the save failed): the next delta starts where it
    would have without it."""
    self._staged = None

  def checkpoint_restored(self) -> None:
    """The table holds a checkpoint's rows (a full one and its deltas): the next delta starts
    from here, and removals before it are forgotten."""
    self._base = [int(s.track_changes(_LAST_SEQUENCE)) for s in self._shards]

  def _serialize_to_tensors(self):
    if self._incremental:
      if self._staged is not None:
        return dict(self._staged[0])
      return self._serialize_whole_incremental()
    # Rows past their time-to-live or over the budget are not saved (SPEC section 6: eviction
    # runs before every checkpoint).
    with tf.control_dependencies([self.evict()] if self.evicts else []):
      rows = self.export()
      out = {f: rows[f] for f in self._checkpoint_fields()}
      if self.admission_filter_cells:
        out[FILTER_FIELD] = self.export_filters()
    return out

  def _serialize_whole_incremental(self):
    """The whole table in the incremental layout, for a save nobody staged (an evaluation
    snapshot; the names a restore asks for). Writes no write numbers down."""
    with tf.control_dependencies([self.evict()] if self.evicts else []):
      parts = [s.export_delta(-1) for s in self._shards]
      out = {f: tf.concat([p[f] for p in parts], axis=0)
             for f in self._checkpoint_fields() + (DELETED_FIELD,)}
      out[DELTA_FIELD] = tf.constant(0, tf.int64)
      if self.admission_filter_cells:
        out[FILTER_FIELD] = self.export_filters()
    return out

  def import_delta(self, rows: Dict[str, tf.Tensor], replace) -> tf.Operation:
    """Every shard applies the part of `rows` it owns (see HashTableShard.import_delta)."""
    deleted = tf.convert_to_tensor(rows.get(DELETED_FIELD, tf.zeros([0], tf.int64)), tf.int64)
    deleted_parts, _ = self.partition(deleted)
    ops = []
    for shard, part, dpart in zip(self._shards, self._split_rows(rows), deleted_parts):
      part[DELETED_FIELD] = dpart
      ops.append(shard.import_delta(part, replace))
    return tf.group(ops)

  def _restore_from_tensors(self, restored_tensors):
    restored = dict(restored_tensors)
    filters = restored.pop(FILTER_FIELD, None)
    delta = restored.pop(DELTA_FIELD, None)
    if delta is None:
      ops = [self.import_rows(restored)]
    else:
      ops = [self.import_delta(restored, tf.equal(delta, 0))]
    if filters is not None:
      ops.append(self.import_filters(filters))
    return tf.group(ops)
