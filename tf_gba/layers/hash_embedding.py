"""HashEmbedding: an embedding layer over an expandable hash table (SPEC section 6).

Used like `tf_keras.layers.Embedding`, without a vocabulary: any int64 id (or string, taken as its
64-bit Fingerprint64) gets a row on its first training lookup, initialised from (seed, id) only.
Without a strategy the table lives in this process; under a ParameterServerStrategy (such as
`tf_gba.distribute.GBAStrategy`) it is sharded over the parameter servers by `mix64(id) mod P`, and
each worker step deduplicates its ids and sends every shard only its own, in one lookup per shard.
Under an all-reduce strategy (MultiWorkerMirroredStrategy, one replica per process) every worker
holds the whole table, and a training lookup looks up the union of all replicas' ids (all-gathered)
so that every copy counts and inserts the same keys.

Gradients: the layer's rows reach the optimizer as the gradient of the layer's `hash_anchor`
weight, an `IndexedSlices` whose indices are the ids themselves. `tf_gba.optimizers.GBA` (every
mode: gba, async, bsp, hop_bs, hop_bw; with M = 1 outside a strategy, every gradient is applied as
it comes) sends them through a keyed sparse buffer per shard (per-ID staleness from the row's own
tag) to the table's fused SGD, Adagrad or LazyAdam update on the parameter server. A plain
tf_keras SGD, Adagrad or Adam (no strategy, or GBAStrategy's mode="async") hands the anchor's
pair to the table where Keras applies the step, and the table applies the same fused update
(`tf_gba.layers.hash_updates`); any other optimizer is refused in one line before it applies
anything. Under an all-reduce strategy, `tf_gba.optimizers.hash_rows.apply_replicated`
all-gathers the replicas' rows' gradients, sums them per key and applies the same fused update on
every worker (Sync, SPEC section 6); the sync job (`--mode=sync`) does this.

Example:

  ids = tf_keras.Input(shape=(3,), dtype=tf.int64)
  x = tf_gba.layers.HashEmbedding(8)(ids)                 # [batch, 3, 8]
  model = tf_keras.Model(ids, tf_keras.layers.Dense(1)(tf_keras.layers.Flatten()(x)))
  model.compile(tf_gba.optimizers.GBA(tf_keras.optimizers.Adagrad(0.1)), "mse")
"""

from typing import List, Optional, Tuple

import tensorflow as tf
import tf_keras as keras

from tf_gba.common import keras_apply
from tf_gba.layers import hash_embedding_serving
from tf_gba.layers import hash_updates
from tf_gba.ops import hash_table_ops

# The attribute of the anchor weight that names its table (read by the optimizer).
TABLE_ATTR = "_tf_gba_hash_table"


def table_of(variable) -> Optional[hash_table_ops.ShardedHashTable]:
  """The hash table behind a HashEmbedding's anchor weight, or None for any other variable."""
  return getattr(variable, TABLE_ATTR, None)


def _table_devices() -> List[str]:
  """Where the shards go: every parameter server under a PS strategy, else this process.

  Under an all-reduce strategy (MultiWorkerMirroredStrategy, MirroredStrategy) with one replica
  per process, every worker process holds the whole table, one shard on its own CPU, kept
  identical on all replicas by `replicated_lookup` and the optimizer's all-gathered update
  (`tf_gba.optimizers.hash_rows.apply_replicated`).
  """
  if not tf.distribute.has_strategy():
    return [""]
  strategy = tf.distribute.get_strategy()
  if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
    # TF internal (no public equivalent: the strategy's cluster_resolver is None here).
    num_ps = strategy.extended._num_ps  # pylint: disable=protected-access
    return [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(num_ps)]
  if is_replicated(strategy):
    local = len(strategy.extended.worker_devices)
    if local != 1:
      raise ValueError(
          f"HashEmbedding under {type(strategy).__name__} needs one replica per process (each "
          f"process holds one copy of the table), but this one has {local} local replicas "
          f"({', '.join(strategy.extended.worker_devices)}); run one worker process per device "
          "(MultiWorkerMirroredStrategy) instead.")
    return ["/device:CPU:0"]
  raise ValueError(
      f"HashEmbedding cannot live under {type(strategy).__name__}: its table is hosted by this "
      "process (no strategy), by the parameter servers of a ParameterServerStrategy such as "
      "tf_gba.distribute.GBAStrategy, or by every worker of a MultiWorkerMirroredStrategy or "
      "MirroredStrategy (one replica per process).")


def is_replicated(strategy) -> bool:
  """Whether `strategy` is an all-reduce one whose replicas each hold a whole table."""
  return isinstance(strategy, (tf.distribute.MultiWorkerMirroredStrategy,
                               tf.distribute.MirroredStrategy))


def _replica_context():
  """This replica's context under an all-reduce strategy (inside `strategy.run`), else None."""
  if not tf.distribute.has_strategy() or not is_replicated(tf.distribute.get_strategy()):
    return None
  return tf.distribute.get_replica_context()  # None in a cross-replica context


def all_gather_rows(ctx, tensors: List[tf.Tensor]) -> Tuple[List[tf.Tensor], tf.Tensor]:
  """Every replica's `tensors` (same first dimension n_r, which may differ between replicas),
  concatenated in replica order on every replica, and this replica's offset in them.

  The tensors are padded to the largest n_r first (collectives take equal shapes) and the padding
  is masked out after the gather: no key value is reserved as a sentinel.
  """
  n = tf.shape(tensors[0], out_type=tf.int64)[:1]
  counts = ctx.all_gather(n, axis=0)  # [N]
  longest = tf.reduce_max(counts)
  gathered = []
  for t in tensors:
    pad = tf.concat([[[0, longest - n[0]]], tf.zeros([tf.rank(t) - 1, 2], tf.int64)], axis=0)
    gathered.append(ctx.all_gather(tf.pad(t, pad), axis=0))
  mask = tf.reshape(tf.range(longest)[tf.newaxis, :] < counts[:, tf.newaxis], [-1])
  offset = tf.reduce_sum(counts[:ctx.replica_id_in_sync_group])
  return [tf.boolean_mask(g, mask) for g in gathered], offset


def replicated_lookup(ctx, table: hash_table_ops.ShardedHashTable, keys: tf.Tensor) -> tf.Tensor:
  """Training lookup of this replica's distinct `keys` under an all-reduce strategy.

  The keys of all replicas are all-gathered and their union looked up (inserted and counted) in
  this replica's table, in the same order on every replica: frequencies, `last_seen`, admission
  and the rows inserted are the same everywhere. Returns this replica's rows.
  """
  (everyone,), offset = all_gather_rows(ctx, [keys])
  union, position = tf.unique(everyone)
  rows = table.lookup(union)
  return tf.gather(rows, position[offset:offset + tf.size(keys, out_type=tf.int64)])


# ---- a plain tf_keras optimizer (not GBA) applying a step with HashEmbedding rows --------------
def _has_rows(grads_and_vars) -> bool:
  return any(g is not None and table_of(v) is not None for g, v in grads_and_vars)


def _refuse_what_the_table_cannot_apply(optimizer, grads_and_vars) -> None:
  """At the entry of a plain optimizer's `apply_gradients`: refuses, in one line, an optimizer
  the table cannot apply, and an all-reduce strategy (whose rows take `apply_replicated`)."""
  if not _has_rows(grads_and_vars):
    return
  hash_updates.plain_optimizer(optimizer)
  strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
  if strategy is not None and is_replicated(strategy):
    raise keras_apply.one_line(ValueError(
        f"HashEmbedding rows under {type(strategy).__name__} are all-gathered and applied by "
        "tf_gba.optimizers.hash_rows.apply_replicated, not by "
        f"{type(optimizer).__name__}.apply_gradients: split them out with "
        "tf_gba.optimizers.hash_rows.split_hash_gradients (docs/hash_embeddings.md, "
        "\"Sync (all-reduce)\")."))


def _apply_rows(optimizer, grads_and_vars):
  """Where a plain optimizer applies its step (aggregated, clipped, duplicate keys summed):
  each anchor's rows go to its table's fused update with the optimizer's rule, at the step's
  `iterations` (read before Keras advances it). Returns (the other pairs, the updates)."""
  if not _has_rows(grads_and_vars):
    return grads_and_vars, []
  fused = hash_updates.plain_optimizer(optimizer)
  iteration = tf.identity(optimizer.iterations)
  others, updates = [], []
  for grad, var in grads_and_vars:
    table = table_of(var)
    if table is None or grad is None:
      others.append((grad, var))
      continue
    if not isinstance(grad, tf.IndexedSlices):
      raise keras_apply.one_line(ValueError(
          f"{var.name} (a HashEmbedding's anchor) got a dense gradient: its rows' gradient is "
          "IndexedSlices of the layer's ids."))
    updates.append(hash_updates.apply_rows(table, optimizer, grad, iteration, fused))
  return others, updates


@keras.utils.register_keras_serializable(package="tf_gba")
class HashEmbedding(keras.layers.Layer):
  """An embedding of unbounded int64 (or string) ids in an expandable hash table.

  Args:
    output_dim: width of each row.
    seed: the table's seed; a row's first value depends on (seed, id) only.
    embeddings_initializer: "uniform" (in [minval, maxval)), "normal" (mean, stddev) or "zeros".
    minval, maxval: the uniform initializer's range (default Keras Embedding's +-0.05).
    mean, stddev: the normal initializer's parameters.
    min_frequency: admission (0 or 1: off): an id gets a row at its min_frequency-th training
      lookup; before, it reads the zero row and its gradients are dropped (counted `filtered`).
    ttl_steps: eviction (0: off) of rows whose id was not looked up in training for more than
      this many global steps.
    max_rows: the table's row budget (0: off), split evenly over the shards: beyond it the least
      frequent rows go first, ties to the oldest last lookup.
    eviction_interval: with ttl_steps or max_rows, every shard evicts each time its global step
      reaches a multiple of this (and before every checkpoint save).
    admission_filter_cells: with min_frequency >= 2, the admission counts live in a counting
      Bloom filter of this many one-byte cells per shard instead of one exact count per id
      (0): fixed memory; a false positive admits an id early.

  Call with ids of any rank >= 1 (int32, int64 or string); returns ids.shape + [output_dim].
  `training=False` (evaluate, predict, serving) finds rows without inserting: an unseen id gets
  its initial row (the zero row with admission on). Training lookups insert, count the id's
  `frequency` and set its `last_seen`.
  """

  def __init__(self, output_dim: int, seed: int = 0, embeddings_initializer: str = "uniform",
               minval: float = -0.05, maxval: float = 0.05, mean: float = 0.0,
               stddev: float = 0.05, min_frequency: int = 0, ttl_steps: int = 0,
               max_rows: int = 0, eviction_interval: int = 100, admission_filter_cells: int = 0,
               **kwargs):
    super().__init__(**kwargs)
    if int(output_dim) != output_dim or output_dim < 1:
      raise ValueError(f"output_dim must be an integer >= 1, got {output_dim!r}.")
    if embeddings_initializer not in hash_table_ops.INITIALIZERS:
      raise ValueError(f"embeddings_initializer must be one of {hash_table_ops.INITIALIZERS} "
                       f"(a function of (seed, id) only), got {embeddings_initializer!r}.")
    self.output_dim = int(output_dim)
    self.seed = int(seed)
    self.embeddings_initializer = embeddings_initializer
    self.minval, self.maxval, self.mean, self.stddev = minval, maxval, mean, stddev
    for what, value, low in (("min_frequency", min_frequency, 0), ("ttl_steps", ttl_steps, 0),
                             ("max_rows", max_rows, 0),
                             ("eviction_interval", eviction_interval, 1),
                             ("admission_filter_cells", admission_filter_cells, 0)):
      if int(value) != value or value < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}.")
    self.min_frequency, self.ttl_steps, self.max_rows = (int(min_frequency), int(ttl_steps),
                                                         int(max_rows))
    self.eviction_interval = int(eviction_interval)
    self.admission_filter_cells = int(admission_filter_cells)
    if self.admission_filter_cells and self.min_frequency < 2:
      raise ValueError(f"admission_filter_cells={self.admission_filter_cells} holds admission "
                       "counts, but admission is off: set min_frequency >= 2, or drop "
                       "admission_filter_cells.")
    self.table: Optional[hash_table_ops.ShardedHashTable] = None

  def build(self, input_shape):
    normal = self.embeddings_initializer == "normal"
    with tf.init_scope():
      self.table = hash_table_ops.ShardedHashTable(
          self.output_dim, devices=_table_devices(), seed=self.seed,
          initializer=self.embeddings_initializer,
          init_a=self.mean if normal else self.minval,
          init_b=self.stddev if normal else self.maxval, name=self.name,
          min_frequency=self.min_frequency, ttl_steps=self.ttl_steps, max_rows=self.max_rows,
          eviction_interval=self.eviction_interval,
          admission_filter_cells=self.admission_filter_cells)
    # The weight the rows' gradient is taken for: empty, it only carries the table to the
    # optimizer (the gradient's indices are the ids, its values the rows' gradients).
    self.hash_anchor = self.add_weight(name="hash_anchor", shape=(0, self.output_dim),
                                       initializer="zeros", trainable=True)
    setattr(self.hash_anchor, TABLE_ATTR, self.table)
    # A plain tf_keras optimizer (not GBA) hands the table its rows' gradient, or is refused.
    keras_apply.add_check("hash_embedding", 1, _refuse_what_the_table_cannot_apply)
    keras_apply.add_applier("hash_embedding", _apply_rows)
    super().build(input_shape)

  def _check_ids(self, ids) -> tf.Tensor:
    keys = hash_table_ops.check_keys(ids, what=f"The ids of {self.name}")
    if keys.shape.rank == 0:
      raise ValueError(f"The ids of {self.name} are a scalar: pass at least one dimension "
                       "(e.g. [batch] or [batch, ids_per_example]).")
    return keys

  def __call__(self, inputs, *args, **kwargs):
    # Checked before Keras' own input handling, so a ragged or float input fails with this
    # layer's message.
    if isinstance(inputs, (tf.RaggedTensor, tf.SparseTensor)):
      self._check_ids(inputs)
    if _is_floating(getattr(inputs, "dtype", None)):
      # Keras would cast float64 ids to float32 first: the message names the dtype passed.
      self._check_ids(tf.zeros([0], inputs.dtype))
    return super().__call__(inputs, *args, **kwargs)

  def call(self, ids, training=None):
    keys = self._check_ids(ids)
    flat = tf.reshape(keys, [-1])
    unique, position = tf.unique(flat)
    serving = hash_embedding_serving.serving_rows(self)
    if serving is not None:  # a SavedModel is being written: its rows, found with stock ops
      rows = serving.find(unique)
    elif training is False:
      rows = self.table.find(unique)
    else:
      ctx = _replica_context()
      found = (self.table.lookup(unique) if ctx is None else
               replicated_lookup(ctx, self.table, unique))
      rows = _attach_gradient(self.hash_anchor.value(), found, unique)
    out = tf.gather(rows, position)
    return tf.reshape(out, tf.concat([tf.shape(keys), [self.output_dim]], axis=0))

  def compute_output_shape(self, input_shape):
    return tf.TensorShape(input_shape).concatenate([self.output_dim])

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    children = super()._trackable_children(save_type, **kwargs)
    if save_type == "savedmodel":  # read by servers without tf_gba's ops
      children = hash_embedding_serving.savedmodel_children(self, children)
    return children

  def get_config(self):
    return {**super().get_config(), "output_dim": self.output_dim, "seed": self.seed,
            "embeddings_initializer": self.embeddings_initializer, "minval": self.minval,
            "maxval": self.maxval, "mean": self.mean, "stddev": self.stddev,
            "min_frequency": self.min_frequency, "ttl_steps": self.ttl_steps,
            "max_rows": self.max_rows, "eviction_interval": self.eviction_interval,
            "admission_filter_cells": self.admission_filter_cells}


def _is_floating(dtype) -> bool:
  try:
    return dtype is not None and tf.as_dtype(dtype).is_floating
  except TypeError:  # NumPy's str and object dtypes
    return False


@tf.custom_gradient
def _attach_gradient(anchor, rows, keys):
  """rows, whose gradient is handed to `anchor` as IndexedSlices(d rows, keys)."""

  def grad(d_rows):
    dim = tf.shape(d_rows, out_type=tf.int64)[1]
    # dense_shape: the key space, which no dense tensor ever takes.
    return (tf.IndexedSlices(d_rows, keys, tf.stack([tf.constant(2**63 - 1, tf.int64), dim])),
            None, None)

  return tf.identity(rows), grad
