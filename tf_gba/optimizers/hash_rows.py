"""The GBA path of a HashEmbedding's rows: keyed sparse buffers and the table's fused update.

A hash table of P shards gets P keyed sparse buffers, each on its shard's parameter server. Every
worker step pushes to every one of them, with the keys of that shard only (possibly none), so
that each buffer counts the same M entries per global step and they complete together. Each key's
staleness is judged from the tag kept in the table's row (SPEC section 1, unchanged: the same
decay and divisor as a partitioned row), and a completed aggregate goes, on that parameter
server, to the table's fused update with the inner optimizer's hyper-parameters. A table with
`ttl_steps` or `max_rows` then evicts on that shard, on the parameter server, whenever the
aggregation brought its global step to a multiple of the table's `eviction_interval`.

Sync (all-reduce, every worker holding the whole table): `apply_replicated` all-gathers the
replicas' (key, gradient row) pairs, sums them per key and applies the same fused update on
every worker; `split_hash_gradients` separates the anchors' gradients from those Keras applies.
"""

from typing import Callable, List, Tuple

import tensorflow as tf
import tf_keras as keras

from tf_gba.layers import hash_embedding
from tf_gba.layers import hash_updates
from tf_gba.ops import gba_ops
from tf_gba.ops import hash_table_ops


# The table's fused update of a tf_keras optimizer (kept here under its old name: the GBA path,
# Sync's apply_replicated and the training job ask for it).
fused_optimizer = hash_updates.fused_optimizer


class HashBuffers:
  """The keyed sparse buffers of one hash table, one per shard (on the shard's device)."""

  def __init__(self, table: hash_table_ops.ShardedHashTable, config: gba_ops.BufferConfig,
               initial_step: int):
    self.table = table
    self.buffers: List[gba_ops.SparseBuffer] = [
        gba_ops.SparseBuffer(0, [table.dim], tf.float32, config, device=shard.device,
                             initial_step=initial_step, name="hash_buffer", keyed=True)
        for shard in table.shards]

  def push_and_maybe_apply(
      self, token, ticket, grad: tf.IndexedSlices,
      apply_fn: Callable[[tf.IndexedSlices, hash_table_ops.HashTableShard], tf.Operation]):
    """Pushes each shard its own rows; where a global batch completes, applies its aggregate.

    Returns whether the push completed shard 0's global batch. Every shard's buffer receives
    every push, so each completes once per global batch, but not necessarily on the same push:
    two workers' pushes can reach two parameter servers in opposite orders, and then no push
    completes both. Shard 0 stands for the table, as one buffer does for a variable (the GBA
    optimizer counts its global step on the push its leading buffer completes).
    """
    keys = tf.cast(grad.indices, tf.int64)
    parts, positions = self.table.partition(keys)
    readies = []
    for shard, buf, shard_keys, pos in zip(self.table.shards, self.buffers, parts, positions):
      with tf.device(shard.device):
        ready, agg_keys, agg_rows, step = buf.push_keyed(
            token, ticket, shard_keys, tf.gather(grad.values, pos), shard.resource_handle)

        def apply(agg_keys=agg_keys, agg_rows=agg_rows, shard=shard, step=step):
          with tf.control_dependencies([apply_fn(tf.IndexedSlices(agg_rows, agg_keys), shard)]):
            if not self.table.evicts:
              return tf.constant(True)
            # After the apply, so the shard's own step (evict's default) is this aggregate's.
            interval = tf.constant(self.table.eviction_interval, tf.int64)
            evicted = tf.cond(tf.equal(step % interval, 0),
                              lambda: tf.size(shard.evict(with_rows=False)["keys"]) >= 0,
                              lambda: tf.constant(True))
            return tf.identity(evicted)

        # Under the shard's device, the branch runs on its parameter server: no round trip.
        readies.append(tf.cond(ready, apply, lambda: tf.constant(False)))
    # The other shards' conds run all the same (they are inputs of nothing but their own apply):
    # tie them to the result so that none is pruned from the step's graph.
    with tf.control_dependencies(readies[1:]):
      return tf.identity(readies[0])

  def set_step(self, step) -> None:
    """Every shard's buffer at global step `step`, its pending entries discarded (a restore)."""
    for b in self.buffers:
      b.import_state(step, tf.zeros([0], tf.int64))

  def stats(self) -> gba_ops.BufferStats:
    return gba_ops.merge_stats([b.stats() for b in self.buffers])


# ---- Sync (all-reduce) ------------------------------------------------------------------------
def split_hash_gradients(grads_and_vars) -> Tuple[list, list]:
  """(pairs of HashEmbedding anchors, the other pairs) of `grads_and_vars`."""
  hashed, others = [], []
  for grad, var in grads_and_vars:
    (hashed if hash_embedding.table_of(var) is not None else others).append((grad, var))
  return hashed, others


def apply_replicated(optimizer: keras.optimizers.Optimizer, grads_and_vars) -> tf.Operation:
  """Sync's update of hash rows (SPEC section 6), in a replica context of an all-reduce strategy.

  For each HashEmbedding anchor: the (key, gradient row) pairs of all N replicas are
  all-gathered, summed per key (a key absent from a replica's batch counts as zero) and applied
  by the table's fused update with `optimizer`'s kind and hyper-parameters (Adam: LazyAdam, as
  under GBA), the same on every replica. The sum is what Keras' all-reduce makes of dense
  gradients: with each replica's loss divided by N (as the sync job does), it is the mean over
  replicas of their gradients. Tables with `ttl_steps` or `max_rows` then evict whenever the step
  reaches a multiple of their `eviction_interval`. Must run before `optimizer.apply_gradients`
  of the same step, which advances `optimizer.iterations` (the LazyAdam step and the table's own).

  Returns the group of the updates; pairs with a None gradient are skipped.
  """
  ctx = tf.distribute.get_replica_context()
  pairs = [(g, v) for g, v in grads_and_vars if g is not None]
  if not pairs:
    return tf.no_op()
  fused = fused_optimizer(optimizer)
  ops = []
  for grad, var in pairs:
    table = hash_embedding.table_of(var)
    if not isinstance(grad, tf.IndexedSlices):
      raise ValueError(f"{var.name} (a HashEmbedding's anchor) got a dense gradient: its rows' "
                       "gradient is IndexedSlices of the layer's ids.")
    keys, rows = tf.cast(grad.indices, tf.int64), tf.convert_to_tensor(grad.values, tf.float32)
    if ctx is not None and ctx.num_replicas_in_sync > 1:
      (keys, rows), _ = hash_embedding.all_gather_rows(ctx, [keys, rows])
    unique, position = tf.unique(keys)
    summed = tf.math.unsorted_segment_sum(rows, position, tf.size(unique))
    aggregate = optimizer._clip_gradients(  # pylint: disable=protected-access
        [tf.IndexedSlices(summed, unique, grad.dense_shape)])[0]
    ops.append(hash_updates.apply_rows(table, optimizer, aggregate,
                                       tf.identity(optimizer.iterations), fused))
  return tf.group(ops)


def align_replicated_step(optimizer: keras.optimizers.Optimizer, variables) -> None:
  """After a restore: every table of `variables` knows global step `optimizer.iterations` (eager).

  A table's own step (what a training lookup writes as `last_seen`) is one past its latest
  apply; restored, it is taken from the rows' tags and `last_seen`, which Sync's update leaves
  one step behind (it writes no tags). An apply of no rows at the step before sets it.
  """
  step = int(optimizer.iterations.numpy())
  if step < 1:
    return
  kind, hyper, initial_accumulator = fused_optimizer(optimizer)
  for var in variables:
    table = hash_embedding.table_of(var)
    if table is None:
      continue
    table.apply(tf.zeros([0], tf.int64), tf.zeros([0, table.dim], tf.float32), kind,
                learning_rate=0.0, iteration=step - 1, initial_accumulator=initial_accumulator,
                **hyper)
