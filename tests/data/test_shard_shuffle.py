"""Shards shuffle with seeds of their own: a synchronous global batch is not runs of neighbours.

Shards are interleaved rows (shard k of n: rows k, k + n, ...). Shuffled with one seed, equally
long shards took the same permutation, so the n workers' i-th batches together were B runs of n
consecutive rows; in time-ordered data (MovieLens, Criteo) neighbours are mostly the same user or
moment. Checked on the in-memory pipeline (synthetic, MovieLens) and on the Criteo reader.
"""

import gzip

import numpy as np
import pytest

import tf_gba  # noqa: F401  (sets up Keras 2 before TensorFlow is imported)
import tensorflow as tf

from tf_gba.data import criteo, pipeline
from tf_gba.data.info import DataInfo

ROWS, SHARDS, BATCH = 400, 4, 10


def _from_arrays(seed, shard, as_tensor=False):
  """Rows of each batch of one shard's first epoch (the feature `row` is the row's index)."""
  ds = pipeline.from_arrays(
      DataInfo(categorical={"row": ROWS}), {"row": np.arange(ROWS)}, np.zeros(ROWS),
      batch_size=BATCH, num_shards=SHARDS, repeat=False, shuffle_seed=seed,
      shard_index=tf.constant(shard) if as_tensor else shard)
  return [f["row"].numpy() for f, _ in ds]


def _criteo(path, seed, shard):
  ds = criteo.make_dataset(path, "train", batch_size=BATCH, num_shards=SHARDS, shard_index=shard,
                           shuffle_seed=seed, eval_every=10 * ROWS, vocab_size=100)
  # I1 holds the row's index; the reader gives log1p of it.
  return [np.rint(np.expm1(f["I1"].numpy().astype(np.float64))).astype(np.int64) for f, _ in ds]


@pytest.fixture(scope="module")
def criteo_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("criteo") / "rows.tsv.gz"
  with gzip.open(path, "wt") as f:
    for row in range(ROWS):
      ints = [str(row)] + [str(i) for i in range(12)]
      cats = ["%08x" % (0x1000 + 31 * row + i) for i in range(26)]
      f.write("\t".join([str(row % 2)] + ints + cats) + "\n")
  return str(path)


def _check_independent_shards(read):
  shards = [read(k) for k in range(SHARDS)]
  for k, batches in enumerate(shards):
    # Still a partition: every row of the shard once in the epoch.
    np.testing.assert_array_equal(np.sort(np.concatenate(batches)), np.arange(k, ROWS, SHARDS))
  # Each shard's order of its rows (position j is row k + n j) is its own.
  orders = {tuple((np.concatenate(b) - k) // SHARDS) for k, b in enumerate(shards)}
  assert len(orders) == SHARDS
  # A global batch (batch 0 of every shard): with one shared permutation its n x B rows were
  # exactly B runs of n neighbours; independent draws of 4 x 10 of the 100 runs touch ~33.
  runs = np.concatenate([b[0] for b in shards]) // SHARDS
  assert len(set(runs.tolist())) > 2 * BATCH, sorted(runs.tolist())
  return shards


def test_in_memory_shards_shuffle_independently_and_reproducibly():
  shards = _check_independent_shards(lambda k: _from_arrays(0, k))
  # The same seed gives the same order again, whether the shard index is a number (sync
  # replicas) or the worker's own index read on the worker (parameter-server workers).
  for k in range(SHARDS):
    for batch, again, on_worker in zip(shards[k], _from_arrays(0, k), _from_arrays(0, k, True)):
      np.testing.assert_array_equal(batch, again)
      np.testing.assert_array_equal(batch, on_worker)
  # Another seed, another order.
  assert not np.array_equal(np.concatenate(_from_arrays(1, 0)), np.concatenate(shards[0]))


def test_criteo_shards_shuffle_independently(criteo_file):
  shards = _check_independent_shards(lambda k: _criteo(criteo_file, 0, k))
  np.testing.assert_array_equal(np.concatenate(_criteo(criteo_file, 0, 2)),
                                np.concatenate(shards[2]))


def test_shard_seed_is_distinct_for_every_seed_and_shard():
  seeds = {pipeline.shard_seed(s, SHARDS, k) for s in range(5) for k in range(SHARDS)}
  assert len(seeds) == 5 * SHARDS
  assert int(pipeline.shard_seed(3, SHARDS, tf.constant(2))) == pipeline.shard_seed(3, SHARDS, 2)
