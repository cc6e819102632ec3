"""The tf.data steps every source shares: argument checks, sharding, shuffling and batching; and
the options of the pipelines training workers iterate (`on_a_worker`)."""

import contextlib
import threading
from typing import Mapping, Optional

import numpy as np
import tensorflow as tf
from tensorflow.python.data.ops import multi_device_iterator_ops  # pylint: disable=g-direct-tensorflow-import

from tf_gba.data.info import DataInfo

SPLITS = ("train", "eval")


def check_split(split: str):
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")


def check_common_args(split: str, batch_size: int, num_shards: int, shard_index: int):
  """Raises ValueError for arguments no source accepts."""
  check_split(split)
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
  if num_shards < 1:
    raise ValueError(f"num_shards must be >= 1, got {num_shards}.")
  # A tensor index is the worker's own, read at run time (parameter-server workers); it is checked
  # where it is used.
  if not isinstance(shard_index, tf.Tensor) and not 0 <= shard_index < num_shards:
    raise ValueError(f"shard_index must be in [0, num_shards={num_shards}), got {shard_index}.")


def shard_seed(shuffle_seed: int, num_shards: int, shard_index):
  """The shuffle seed of shard `shard_index`: a different one for each shard of a seed.

  Shards are interleaved rows (`k, k + n, ...`). Shuffled with one seed, equally long shards get
  the same permutation, so the workers' i-th batches together are runs of n consecutive rows:
  a synchronous global batch of n x B rows would hold only B independent draws of rows that, in
  time-ordered data (MovieLens, Criteo), come mostly from the same user or moment.
  `shard_index` may be a tensor (the worker's own index, read on the worker).
  """
  if isinstance(shard_index, tf.Tensor):
    return tf.cast(shuffle_seed, tf.int64) * num_shards + tf.cast(shard_index, tf.int64)
  return shuffle_seed * num_shards + shard_index


def on_a_worker(ds: tf.data.Dataset) -> tf.data.Dataset:
  """A pipeline that a training worker iterates (parameter-server, Sync or DTS), without tf.data's
  autotuning thread.

  That thread (`model::Model::OptimizeLoop`) sleeps between tuning rounds, up to 60 s once a
  pipeline is steady, and deleting the iterator waits until it wakes. Where `fit` returns, the
  per-worker iterators are deleted on the workers, and each deletion holds its worker's eager
  service, so the next operation the coordinator sent that worker waited for it: 12 to 90 s at
  the end of a day on 8 workers (docs/evaluation.md); a Sync or DTS worker's end waited for it
  too (`distributed_iterator_on_a_worker`). Without the thread, `AUTOTUNE` takes tf.data's
  static choices (a map as parallel as the worker's threads).
  """
  options = tf.data.Options()
  options.autotune.enabled = False
  return ds.with_options(options)


_device_datasets_lock = threading.Lock()
_device_datasets_users = 0
_tf_create_device_dataset = multi_device_iterator_ops._create_device_dataset  # pylint: disable=protected-access


def _device_dataset_on_a_worker(*args, **kwargs):
  return on_a_worker(_tf_create_device_dataset(*args, **kwargs))


@contextlib.contextmanager
def device_iterators_on_a_worker():
  """While open, the per-device iterators tf.distribute creates on a worker run without tf.data's
  autotuning thread too (see `on_a_worker`).

  A ParameterServerStrategy worker reads its pipeline through a MultiDeviceIterator: one host
  iterator of the pipeline (whose options are the pipeline's: `on_a_worker` covers it) and, per
  device, an iterator of a generator dataset that TensorFlow builds itself, with default options
  and no argument to pass others. Deleting that one waited for its autotuning thread as well:
  24 and 28 s after two of three Hop-BW days on the shared list whose pipelines ran without it
  (docs/evaluation.md). There is nothing to tune in it: a generator and, at most, a prefetch of
  fixed size. Opened around `model.fit`, where the per-worker iterators are created; reentrant,
  for any thread.
  """
  global _device_datasets_users
  with _device_datasets_lock:
    _device_datasets_users += 1
    multi_device_iterator_ops._create_device_dataset = _device_dataset_on_a_worker  # pylint: disable=protected-access
  try:
    yield
  finally:
    with _device_datasets_lock:
      _device_datasets_users -= 1
      if not _device_datasets_users:
        multi_device_iterator_ops._create_device_dataset = _tf_create_device_dataset  # pylint: disable=protected-access


def distributed_iterator_on_a_worker(strategy: tf.distribute.Strategy, dataset_fn):
  """`iter(strategy.distribute_datasets_from_function(dataset_fn))` without tf.data's autotuning
  thread, in the pipelines `dataset_fn` makes (`on_a_worker`) and in the per-device iterators
  tf.distribute adds (`device_iterators_on_a_worker`).

  For a MultiWorkerMirroredStrategy worker (Sync, DTS), which deletes its iterator as its training
  function returns: with the thread, in 4 of 4 short 4-worker Sync runs one or two workers ended
  14-15 s after the others (DTS: 4-5 s), and the job's end waited for them; without it, the
  workers ended within 0.6 s of each other in 5 of 5 runs (DTS: 3 of 3).
  """
  with device_iterators_on_a_worker():
    return iter(strategy.distribute_datasets_from_function(
        lambda ctx: on_a_worker(dataset_fn(ctx))))


def check_day(day: Optional[int], num_days: int):
  if day is not None and not 0 <= day < num_days:
    raise ValueError(f"day must be None (all days) or in [0, {num_days}), got {day}.")


def from_arrays(info: DataInfo, features: Mapping[str, np.ndarray], labels: np.ndarray, *,
                batch_size: int, num_shards: int, shard_index: int, repeat: bool,
                shuffle_seed: Optional[int]) -> tf.data.Dataset:
  """Batches in-memory rows into `(features, label)`.

  Shard `k` of `n` takes rows `k, k + n, k + 2n, ...`, so the shards partition the rows. Rows are
  shuffled (again in each epoch) when `shuffle_seed` is not None.

  The pipeline shuffles and batches row *indices* and gathers each batch from the column tensors:
  one gather per batch instead of one tf.data element per row, which keeps it cheap for a million
  rows.
  """
  columns = {name: tf.constant(np.asarray(features[name]), tf.int64) for name in info.categorical}
  columns.update({name: tf.constant(np.asarray(features[name]), tf.float32)
                  for name in info.numeric})
  label = tf.constant(np.asarray(labels), tf.float32)

  # The shard's row indices; `shard_index` may be a tensor (the worker's index, known only where
  # the pipeline runs), so the rows are selected in the pipeline, not with NumPy.
  if isinstance(shard_index, tf.Tensor):
    shard_index = tf.cast(shard_index, tf.int64)
    check = tf.debugging.assert_less(shard_index, tf.constant(num_shards, tf.int64),
                                      message=f"shard_index must be < num_shards={num_shards}")
    with tf.control_dependencies([check]):
      shard_index = tf.identity(shard_index)
  ds = tf.data.Dataset.range(shard_index, len(labels), num_shards)
  if shuffle_seed is not None:
    shard_rows = -(-len(labels) // num_shards)  # an upper bound of the shard's rows
    ds = ds.shuffle(max(shard_rows, 1), seed=shard_seed(shuffle_seed, num_shards, shard_index),
                    reshuffle_each_iteration=True)
  if repeat:
    ds = ds.repeat()
  ds = ds.batch(batch_size)

  def gather(index):
    return {name: tf.gather(col, index) for name, col in columns.items()}, tf.gather(label, index)

  return ds.map(gather, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
