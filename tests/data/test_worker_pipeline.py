"""The pipelines parameter-server workers iterate run without tf.data's autotuning thread.

Deleting an iterator waits for that thread's sleep (up to 60 s); where `fit` returns, the
workers' iterators are deleted and each holds its worker's eager service until then
(`pipeline.on_a_worker`). Checked on the option the deletion depends on and on the data: the
rows are the same as without it.
"""

import numpy as np

import tf_gba  # noqa: F401  (sets up Keras 2 before TensorFlow is imported)

from tf_gba.data import pipeline
from tf_gba.data.info import DataInfo


def _rows(ds):
  return np.concatenate([f["row"].numpy() for f, _ in ds])


def _pipeline(rows):
  return pipeline.from_arrays(DataInfo(categorical={"row": rows}), {"row": np.arange(rows)},
                              np.zeros(rows), batch_size=8, num_shards=2, shard_index=1,
                              repeat=False, shuffle_seed=3)


def test_a_worker_pipeline_has_no_autotuning_and_the_same_rows():
  rows = 60
  assert _pipeline(rows).options().autotune.enabled in (None, True)  # tf.data's default: on
  worker = pipeline.on_a_worker(_pipeline(rows))
  assert worker.options().autotune.enabled is False
  # The first epoch of a fresh pipeline of the same seed, in the same order.
  np.testing.assert_array_equal(_rows(worker), _rows(_pipeline(rows)))
  # Shard 1 of 2: every odd row once.
  np.testing.assert_array_equal(np.sort(_rows(worker)), np.arange(1, rows, 2))
