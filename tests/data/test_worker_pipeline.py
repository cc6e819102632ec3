"""The pipelines training workers iterate run without tf.data's autotuning thread.

Deleting an iterator waits for that thread's sleep (up to 60 s); where `fit` returns, the
parameter-server workers' iterators are deleted and each holds its worker's eager service until
then (`pipeline.on_a_worker`), and so do the per-device iterators tf.distribute builds on top
while `fit` runs (`pipeline.device_iterators_on_a_worker`); a Sync or DTS worker deletes its
iterator as it returns, and the job ends with its last worker
(`pipeline.distributed_iterator_on_a_worker`). Checked on the option the deletion depends on and
on the data: the rows are the same as without it.
"""

import numpy as np

import tf_gba  # noqa: F401  (sets up Keras 2 before TensorFlow is imported)
import tensorflow as tf
from tensorflow.python.data.ops import multi_device_iterator_ops  # pylint: disable=g-direct-tensorflow-import

from tf_gba import data as data_lib
from tf_gba.data import data_list
from tf_gba.data import pipeline
from tf_gba.data.info import DataInfo
from tf_gba.training import sync_job
from tf_gba.training.config import TrainConfig


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


def _device_dataset_autotune(ds):
  """Autotuning of the per-device dataset a MultiDeviceIterator (a strategy's per-worker
  iterator) builds over `ds`, and the elements it yields."""
  it = multi_device_iterator_ops.OwnedMultiDeviceIterator(ds, ["/cpu:0"],
                                                          source_device="/cpu:0")
  device_dataset = it._device_iterators[0]._dataset  # pylint: disable=protected-access
  values = [int(it.get_next()[0]) for _ in range(3)]
  return device_dataset.options().autotune.enabled, values


def test_the_per_device_iterators_run_without_autotuning_only_where_asked():
  ds = pipeline.on_a_worker(tf.data.Dataset.range(10).map(lambda x: x * 3))
  outside, values = _device_dataset_autotune(ds)
  assert outside in (None, True)  # TensorFlow's default, and no way to pass another
  with pipeline.device_iterators_on_a_worker():
    with pipeline.device_iterators_on_a_worker():  # reentrant
      inner, inner_values = _device_dataset_autotune(ds)
    still, _ = _device_dataset_autotune(ds)
  after, _ = _device_dataset_autotune(ds)
  assert inner is False and still is False
  assert after in (None, True)  # TensorFlow's own function is back once the last one closes
  assert inner_values == values == [0, 3, 6]


def test_the_shared_list_reader_has_no_autotuning_and_reads_every_batch_once():
  rows = 22
  dl = data_list.DataList({"row": np.arange(rows)}, np.zeros(rows, np.float32), batch_size=4,
                          seed=5)
  dispatcher = data_list.start_dispatcher()
  service_worker = tf.data.experimental.service.WorkerServer(
      tf.data.experimental.service.WorkerConfig(
          dispatcher_address=dispatcher.target.split("://", 1)[1]))
  reader = dl.dataset(dispatcher.target, job_name="worker_pipeline_test")
  assert reader.options().autotune.enabled is False
  read = [(f["row"].numpy(), int(b)) for f, _, b in reader]
  np.testing.assert_array_equal(np.sort(np.concatenate([r for r, _ in read])), np.arange(rows))
  assert sorted(b for _, b in read) == list(range(dl.num_batches))
  del service_worker


def test_a_sync_workers_iterator_and_its_device_iterators_have_no_autotuning():
  # One worker of MultiWorkerMirroredStrategy (no TF_CONFIG): the same iterator classes as on a
  # cluster's worker (tf.distribute's per-worker iterator over a MultiDeviceIterator).
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  cfg = TrainConfig(mode="sync", data="synthetic", data_options="num_examples=64",
                    local_batch_size=8)
  iterator = sync_job.train_iterator(strategy, cfg, cfg.data_kwargs())
  features, labels = next(iterator)
  info = data_lib.data_info(cfg.data, **cfg.data_kwargs())
  assert labels.shape == (8,)
  assert set(features) == set(info.categorical) | set(info.numeric)
  worker_iterators = iterator._iterators  # pylint: disable=protected-access
  assert len(worker_iterators) == 1
  assert worker_iterators[0]._dataset.options().autotune.enabled is False  # pylint: disable=protected-access
  multi_device = worker_iterators[0]._iterator  # pylint: disable=protected-access
  assert isinstance(multi_device, multi_device_iterator_ops.OwnedMultiDeviceIterator)
  assert [it._dataset.options().autotune.enabled  # pylint: disable=protected-access
          for it in multi_device._device_iterators] == [False]  # pylint: disable=protected-access
