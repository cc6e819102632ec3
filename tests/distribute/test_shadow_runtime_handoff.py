"""Hand-offs between devices on real TF servers: what one function assigns, the next one reads.

The replicated modes pass values between the coordinator's threads through variables: a
worker's update is assigned on the worker, then read by the merge on the parameter server.
On TF 2.21 a plain remote tf.function call can return before the worker has run its
assignment, and the next function then reads the previous value. `completed_function` must
make every such hand-off see the value just written.
"""

import numpy as np
import tensorflow as tf

from tf_gba.distribute import LocalCluster
from tf_gba.distribute import shadow_runtime as rt

ROUNDS, SIZE = 200, 1000


def test_a_merge_reads_the_update_each_worker_just_handed_in():
  with LocalCluster(num_ps=1, num_workers=2) as cluster:
    rt.connect(cluster.resolver())
    with tf.device(rt.ps_device(0)):
      ps_x = tf.Variable(tf.zeros([SIZE]))
    xs, deltas = [], []
    for i in range(2):
      with tf.device(rt.worker_device(i)):
        xs.append(tf.Variable(tf.zeros([SIZE])))
        deltas.append(tf.Variable(tf.zeros([SIZE])))

    def take(x, delta):
      delta.assign(x.read_value() + 1.0)

    def merge(ds):
      ps_x.assign_add(tf.add_n([tf.convert_to_tensor(d) for d in ds]) / 2.0)

    take, merge = rt.completed_function(take), rt.completed_function(merge)
    increments = []
    for r in range(ROUNDS):
      for i in range(2):
        with tf.device(rt.worker_device(i)):
          xs[i].assign(tf.fill([SIZE], float(r + i)))
          take(xs[i], deltas[i])
      before = ps_x.numpy()
      with tf.device(rt.ps_device(0)):
        merge(deltas)
      increments.append(ps_x.numpy() - before)

  # Round r: the updates are r + 1 and r + 2, their mean r + 1.5, in every element.
  expected = np.arange(ROUNDS, dtype=np.float32)[:, None] + 1.5
  stale = [r for r in range(ROUNDS) if not np.allclose(increments[r], expected[r])]
  assert not stale, f"{len(stale)} of {ROUNDS} merges read an earlier update (rounds {stale[:5]})"
