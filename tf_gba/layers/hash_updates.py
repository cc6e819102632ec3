"""The row updates a HashEmbedding's table applies itself, with a tf_keras optimizer's rule.

The table keeps each row's slots and applies SGD (without momentum), Adagrad and Adam (as
LazyAdam) itself, fused, on the device of each shard (SPEC section 6). Every path that updates
rows ends in `fused_apply` with the optimizer whose rule it is:

* GBA's aggregates, per shard, from its keyed buffers (`tf_gba.optimizers.gba`);
* Sync's all-gathered rows (`tf_gba.optimizers.hash_rows.apply_replicated`), through `apply_rows`;
* a plain tf_keras optimizer's own step (`keras.optimizers.Adam(...)` given to `compile`, or its
  `apply_gradients` in a custom loop), through `apply_rows`: the layer takes its rows' pair out
  where Keras applies the step (`tf_gba.layers.hash_embedding`, by way of
  `tf_gba.common.keras_apply`).
"""

from typing import Dict, Optional, Tuple

import tensorflow as tf
import tf_keras as keras

from tf_gba.common import keras_apply

Fused = Tuple[str, Dict, float]

# What the table applies, for the messages of the refusals.
WHAT_WORKS = ("tf_keras.optimizers.SGD (without momentum), Adagrad or Adam (without amsgrad), "
              "alone or in tf_gba.optimizers.GBA(...)")


def fused_optimizer(inner: keras.optimizers.Optimizer) -> Fused:
  """(kind, hyper-parameters, Adagrad's initial accumulator) of the table's fused update.

  Raises ValueError, in one line, for an optimizer the table cannot apply.
  """
  if inner.weight_decay:
    raise keras_apply.one_line(ValueError(
        "weight_decay is not applied to HashEmbedding rows (their rows change only when their "
        "key is in an update): set weight_decay=None on the optimizer."))
  if isinstance(inner, keras.optimizers.SGD):
    if inner.nesterov or not isinstance(inner.momentum, (int, float)) or inner.momentum:
      raise keras_apply.one_line(ValueError(
          "HashEmbedding rows take plain SGD (momentum=0): the table keeps no momentum slot. "
          "Use SGD without momentum, Adagrad or Adam."))
    return "sgd", {}, 0.0
  if isinstance(inner, keras.optimizers.Adagrad):
    return "adagrad", {"epsilon": inner.epsilon}, float(inner.initial_accumulator_value)
  if isinstance(inner, keras.optimizers.Adam):
    if inner.amsgrad:
      raise keras_apply.one_line(ValueError(
          "HashEmbedding rows take Adam without amsgrad (the table keeps m and v)."))
    return "adam", {"beta_1": inner.beta_1, "beta_2": inner.beta_2,
                    "epsilon": inner.epsilon}, 0.0
  raise keras_apply.one_line(ValueError(
      f"HashEmbedding rows are updated by the table's fused SGD, Adagrad or Adam (LazyAdam); "
      f"{type(inner).__name__} is none of them: use {WHAT_WORKS}."))


def plain_optimizer(optimizer) -> Fused:
  """`fused_optimizer` of a tf_keras optimizer applied by itself (not inside GBA).

  Also refuses, in one line, what only the wrapper used to refuse: a legacy optimizer (whose
  update the table does not know) and `use_ema` (the table keeps no average of its rows).
  """
  if not isinstance(optimizer, keras.optimizers.Optimizer):
    legacy = isinstance(optimizer, keras.optimizers.legacy.Optimizer)
    name = (f"tf_keras.optimizers.legacy.{type(optimizer).__name__}" if legacy else
            f"{type(optimizer).__module__}.{type(optimizer).__name__}")
    raise keras_apply.one_line(ValueError(
        f"HashEmbedding rows cannot be updated by {name}: use {WHAT_WORKS}."))
  if optimizer.use_ema:
    raise keras_apply.one_line(ValueError(
        f"{type(optimizer).__name__}(use_ema=True) cannot average HashEmbedding rows (the table "
        "keeps no moving average): set use_ema=False."))
  return fused_optimizer(optimizer)


def fused_apply(target, optimizer: keras.optimizers.Optimizer, keys, rows, iteration,
                fused: Optional[Fused] = None) -> tf.Operation:
  """The fused update of (keys, rows) on `target` (a ShardedHashTable or one of its shards),
  with `optimizer`'s rule and learning rate; `iteration`: the step the update is (LazyAdam's
  t - 1, and the table's own step is one past it)."""
  kind, hyper, initial_accumulator = fused or fused_optimizer(optimizer)
  return target.apply(keys, rows, kind, learning_rate=tf.cast(optimizer.learning_rate, tf.float32),
                      iteration=iteration, initial_accumulator=initial_accumulator, **hyper)


def apply_rows(table, optimizer: keras.optimizers.Optimizer, aggregate: tf.IndexedSlices,
               iteration, fused: Optional[Fused] = None) -> tf.Operation:
  """`fused_apply` of `aggregate` (distinct keys) on every shard of `table`, then, for a table
  with `ttl_steps` or `max_rows`, its eviction when step `iteration + 1` is a multiple of its
  `eviction_interval`."""
  applied = fused_apply(table, optimizer, tf.cast(aggregate.indices, tf.int64),
                        tf.convert_to_tensor(aggregate.values, tf.float32), iteration, fused)
  if not table.evicts:
    return applied
  with tf.control_dependencies([applied]):
    # After the apply, so the shard's own step (evict's default) is this step's + 1.
    interval = tf.constant(table.eviction_interval, tf.int64)
    return tf.cond(tf.equal((tf.cast(iteration, tf.int64) + 1) % interval, 0),
                   lambda: _evicted(table), lambda: tf.constant(True))


def _evicted(table) -> tf.Tensor:
  with tf.control_dependencies([table.evict()]):
    return tf.constant(True)
