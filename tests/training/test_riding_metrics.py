"""A step's metric adds sent with its gradients (`tf_gba.training.riding_metrics`, `step_context.ride`).

In one process: riders packed with a device's gradients come out on that device to the bit and
leave the gradients as they were; a rider no optimizer takes is sent when the step's trace ends.
On real TF servers (1 PS, 1 worker): the binary's step (`shared_input._train_step`) under
`GBAStrategy` keeps Keras' loss tracker (total, count) as NumPy computes it, whether its adds ride
in GBA's gradient transfer or, with a plain optimizer, travel on their own.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute import GBAStrategy
from tf_gba.distribute import LocalCluster
from tf_gba.distribute import step_context
from tf_gba.optimizers import GBA
from tf_gba.optimizers import gba as gba_lib
from tf_gba.training import riding_metrics
from tf_gba.training import shared_input


def test_riders_come_out_of_the_gradients_transfer_to_the_bit():
  rng = np.random.default_rng(0)
  grads = [rng.normal(size=s).astype(np.float32) for s in ([3, 2], [2])]
  variables = [tf.Variable(tf.zeros(g.shape)) for g in grads]
  riding = np.array([1.5, -2.25, 3e-8], np.float32)
  got, elsewhere = tf.Variable(tf.zeros([3])), tf.Variable(tf.zeros([2]))

  @tf.function
  def step():
    info = step_context.StepInfo(token=tf.constant(0, tf.int64), ticket=tf.constant(0, tf.int64))
    with step_context.scope(info):
      step_context.ride(variables[0].device, tf.constant(riding), got.assign)
      # A device no gradient goes to (soft placement puts it on this one): sent on its own
      # when the step's trace ends.
      step_context.ride("/job:localhost/replica:0/task:0/device:CPU:1", tf.constant([7.0, 8.0]),
                        elsewhere.assign)
      out, arrived = gba_lib._one_transfer_per_device(  # pylint: disable=protected-access
          [(tf.constant(g), v) for g, v in zip(grads, variables)], info)
      left = len(info.riders)
      for rider, there in arrived:
        step_context.send(rider, there)
    ops = [op.type for op in tf.compat.v1.get_default_graph().get_operations()]
    return [g for g, _ in out], left, ops.count("ConcatV2"), ops.count("SplitV")

  out, left, concats, splits = step()
  assert (left, concats, splits) == (1, 1, 1)  # the other device's rider is not packed
  for g, want in zip(out, grads):
    np.testing.assert_array_equal(g.numpy(), want)
  np.testing.assert_array_equal(got.numpy(), riding)
  np.testing.assert_array_equal(elsewhere.numpy(), [7.0, 8.0])


class _On:
  """Stands for a variable on `device` (the packing reads only where a variable is)."""

  def __init__(self, device):
    self.device = device


@pytest.mark.parametrize("servers", [1, 2])
def test_a_rider_after_the_pushes_rides_only_where_every_gradient_goes(servers):
  ps = [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(2)]
  with tf.Graph().as_default():
    pairs = [(tf.ones([2]), _On(ps[0])), (tf.ones([3]), _On(ps[servers - 1]))]
    info = step_context.StepInfo(token=tf.constant(0, tf.int64), ticket=tf.constant(0, tf.int64))
    info.riders.append(step_context.Rider(ps[0], tf.ones([3]), tf.identity, after_pushes=True))
    _, arrived = gba_lib._one_transfer_per_device(pairs, info)  # pylint: disable=protected-access
  assert (len(arrived), len(info.riders)) == ((1, 0) if servers == 1 else (0, 1))


def test_a_metric_with_an_update_of_its_own_does_not_ride():
  class Doubled(keras.metrics.Mean):
    def update_state(self, values, sample_weight=None):
      return super().update_state(2 * values, sample_weight)

  assert not riding_metrics._rides(Doubled())  # pylint: disable=protected-access
  # Outside a parameter-server strategy there is nothing to send: updates as Keras does.
  plain = keras.metrics.Mean()
  assert not riding_metrics._rides(plain)  # pylint: disable=protected-access
  with riding_metrics.adds_ride([plain]):
    plain.update_state([1.0, 3.0])
  assert plain.result().numpy() == 2.0


@pytest.fixture(scope="module")
def cluster():
  with LocalCluster(num_ps=1, num_workers=1) as c:
    yield c


@pytest.mark.parametrize("mode", ["gba", "async"])
def test_the_binarys_step_keeps_the_loss_tracker_as_numpy(cluster, mode):
  """gba: the adds ride in GBA's gradient transfer; async (a plain SGD): on their own."""
  strategy = GBAStrategy(cluster.resolver(), mode=mode)
  kernel = np.array([[0.5], [-1.0]], np.float32)
  with strategy.scope():
    model = keras.Sequential([keras.layers.Dense(
        1, kernel_initializer=keras.initializers.Constant(kernel), bias_initializer="zeros")])
    model.build([None, 2])
    sgd = keras.optimizers.SGD(0.0)  # the weights stay: each batch's loss from NumPy
    model.compile(optimizer=GBA(sgd) if mode == "gba" else sgd, loss="mse")
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

  @tf.function
  def train(x, y):
    return strategy.run(lambda x, y: shared_input._train_step(model, (x, y)), args=(x, y))  # pylint: disable=protected-access

  rng = np.random.default_rng(1)
  batches = [(rng.normal(size=[n, 2]).astype(np.float32), rng.normal(size=[n, 1]).astype(np.float32))
             for n in (3, 5, 4)]
  for x, y in batches:
    coordinator.schedule(train, args=(x, y))
  coordinator.join()
  tracker = model.compiled_loss.metrics[0]
  total = sum(float(np.mean((x @ kernel - y) ** 2)) * len(x) for x, y in batches)
  np.testing.assert_allclose(tracker.total.numpy(), total, rtol=1e-5)
  assert tracker.count.numpy() == 12
  # Where the adds came from: the split of the step's one gradient transfer (gba), or the two
  # values sent as one tensor of their own (async).
  graph = train.get_concrete_function(*[tf.TensorSpec(a.shape, a.dtype) for a in batches[0]]).graph
  sources = [_source(op) for op in graph.get_operations() if op.type == "AssignAddVariableOp"
             and _source(op) in ("SplitV", "Identity")]
  assert sources == (["SplitV"] * 2 if mode == "gba" else ["Identity"] * 2), sources


def _source(assign_add) -> str:
  """The op that the added value was sliced from (`values[k]` of a rider's delivery)."""
  value = assign_add.inputs[1].op
  return value.inputs[0].op.type if value.type == "StridedSlice" else value.type
