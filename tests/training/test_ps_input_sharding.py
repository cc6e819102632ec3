"""Parameter-server workers each read their own shard of the training rows, as sync workers do.

ParameterServerStrategy gives every worker the same InputContext (one pipeline, id 0); the job's
`dataset_fn` reads the worker's index where the pipeline runs. Checked on a real local cluster:
the batches each worker produced, tagged with the index of the worker that produced them, equal
that worker's shard read here with integer sharding, batch for batch.

The batches are fetched through a bare ClusterCoordinator, outside the binary's supervisor. A
fetch that fails inside TensorFlow's runtime (recovery.RuntimeFault: a request a worker could not
parse, no process died; seen once in a CI run of this module) is read again once from a new
cluster, as the supervisor restarts such a job; a second fault fails the test.
"""

import numpy as np
import tensorflow as tf

from tf_gba import data as data_lib
from tf_gba.ops import worker_clock
from tf_gba.training import recovery
from tf_gba.training import runner
from tf_gba.training.config import TrainConfig

WORKERS, BATCH, BATCHES_PER_WORKER = 2, 32, 6
_ROUNDS = 5
_WAIT_S = 120.0


def _batches_per_worker(cfg):
  """{worker index: [(first categorical feature's ids, labels)]}, in the order each worker read
  its batches, from the job's own per-worker dataset on a local cluster."""
  with runner._cluster(cfg) as (resolver, _):  # pylint: disable=protected-access
    strategy = runner.make_strategy(cfg, resolver)
    job = runner._Job(cfg, strategy)  # pylint: disable=protected-access
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    per_worker = coordinator.create_per_worker_dataset(
        lambda: job.dataset_fn(tf.distribute.InputContext()))  # what PSS hands every worker
    iterator = iter(per_worker)
    first = next(iter(job.info.categorical))
    with strategy.scope():
      started = tf.Variable(0, dtype=tf.int64, trainable=False)  # on the parameter server

    @tf.function
    def take(it):
      features, labels = next(it)
      # The coordinator gives a closure to whichever worker is free: on a loaded machine one
      # worker took every closure of five rounds before the other had started (seen once, two
      # test runs side by side). So a worker's closure waits until WORKERS closures have started
      # (at most _WAIT_S): the first WORKERS go to different workers, since a waiting worker
      # takes no other. After that no closure waits.
      started.assign_add(1)
      begin = tf.timestamp()
      tf.while_loop(
          lambda i: tf.logical_and(started.read_value() < WORKERS,
                                   tf.timestamp() - begin < _WAIT_S),
          lambda i: i + 1, [tf.constant(0, tf.int64)])
      return worker_clock.worker_index(), features[first], labels

    got = {w: [] for w in range(WORKERS)}
    # Should the wait above time out, rounds go on (each worker's iterator goes on through its
    # shard) until every worker has read, at most _ROUNDS of them.
    for _ in range(_ROUNDS):
      results = [coordinator.schedule(take, args=(iterator,))
                 for _ in range(WORKERS * BATCHES_PER_WORKER)]
      try:
        coordinator.join()
        # Closures run one at a time per worker, in the order they were scheduled.
        for r in results:
          worker, ids, labels = r.fetch()
          got[int(worker)].append((np.asarray(ids), np.asarray(labels)))
      except tf.errors.InternalError as error:
        recovery.raise_if_lost(error, None, jobs=("ps", "worker"))
        raise
      if all(got.values()):
        break
  return got, first


def test_each_ps_worker_reads_its_own_shard(tmp_path):
  cfg = TrainConfig(mode="gba", data="synthetic", data_options="num_examples=512", num_ps=1,
                    input="sharded",
                    num_workers=WORKERS, local_batch_size=BATCH, model_dir=str(tmp_path))
  try:
    got, first = _batches_per_worker(cfg)
  except recovery.RuntimeFault as fault:
    print(f"WARNING: read again on a new cluster after a fault in TensorFlow's runtime: {fault}")
    got, first = _batches_per_worker(cfg)

  assert all(got[w] for w in range(WORKERS)), "every worker ran steps"
  for w in range(WORKERS):
    want = data_lib.make_dataset(cfg.data, split="train", batch_size=BATCH, num_shards=WORKERS,
                                 shard_index=w, repeat=True, shuffle_seed=cfg.seed,
                                 **cfg.data_kwargs())
    for (ids, labels), (features, want_labels) in zip(got[w], want):
      np.testing.assert_array_equal(ids, features[first].numpy())
      np.testing.assert_array_equal(labels, want_labels.numpy())
  # The shards partition the rows: no row index is read by two workers.
  seen = [np.concatenate([ids for ids, _ in got[w]]) for w in range(WORKERS)]
  assert not np.array_equal(seen[0][:BATCH], seen[1][:BATCH])
