"""The GBA path of a HashEmbedding's rows: keyed sparse buffers and the table's fused update.

A hash table of P shards gets P keyed sparse buffers, each on its shard's parameter server. Every
worker step pushes to every one of them, with the keys of that shard only (possibly none), so
that each buffer counts the same M entries per global step and they complete together. Each key's
staleness is judged from the tag kept in the table's row (SPEC section 1, unchanged: the same
decay and divisor as a partitioned row), and a completed aggregate goes, on that parameter
server, to the table's fused update with the inner optimizer's hyper-parameters. A table with
`ttl_steps` or `max_rows` then evicts on that shard, on the parameter server, whenever the
aggregation brought its global step to a multiple of the table's `eviction_interval`.
"""

from typing import Callable, Dict, List, Tuple

import tensorflow as tf
import tf_keras as keras

from tf_gba.ops import gba_ops
from tf_gba.ops import hash_table_ops


def fused_optimizer(inner: keras.optimizers.Optimizer) -> Tuple[str, Dict, float]:
  """(kind, hyper-parameters, Adagrad's initial accumulator) of the table's fused update.

  Raises ValueError, in one line, for an optimizer the table cannot apply.
  """
  if inner.weight_decay:
    raise ValueError("weight_decay is not applied to HashEmbedding rows (their rows change only "
                     "when their key is in an aggregate): set weight_decay=None on the optimizer.")
  if isinstance(inner, keras.optimizers.SGD):
    if inner.nesterov or not isinstance(inner.momentum, (int, float)) or inner.momentum:
      raise ValueError("HashEmbedding rows take plain SGD (momentum=0): the table keeps no "
                       "momentum slot. Use SGD without momentum, Adagrad or Adam.")
    return "sgd", {}, 0.0
  if isinstance(inner, keras.optimizers.Adagrad):
    return "adagrad", {"epsilon": inner.epsilon}, float(inner.initial_accumulator_value)
  if isinstance(inner, keras.optimizers.Adam):
    if inner.amsgrad:
      raise ValueError("HashEmbedding rows take Adam without amsgrad (the table keeps m and v).")
    return "adam", {"beta_1": inner.beta_1, "beta_2": inner.beta_2,
                    "epsilon": inner.epsilon}, 0.0
  raise ValueError(f"HashEmbedding rows are updated by the table's fused SGD, Adagrad or Adam "
                   f"(LazyAdam); {type(inner).__name__} is none of them.")


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
