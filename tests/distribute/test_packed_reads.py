"""A step's dense reads of a server's variables as one tensor (`tf_gba.distribute.packed_reads`).

The mechanics in one process (a traced step, the variables wrapped as the strategy wraps them):
the values and gradients of served reads against NumPy, also for a tape opened after the pack was
built and for a gathered table (its rows' gradient only), what is left out of a pack, and reads
after an update. Then on real TF servers (1 PS, 1 worker): a custom training loop under
`GBAStrategy` whose step reads the server's two variables in one transfer and trains exactly as
NumPy's SGD does, where `pack_reads=False` reads each on its own.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute import GBAStrategy
from tf_gba.distribute import LocalCluster
from tf_gba.distribute import packed_reads

X = np.array([[1.0, -2.0]], np.float32)
K0 = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]], np.float32)
B0 = np.array([0.1, -0.2, 0.3], np.float32)
T0 = np.arange(12, dtype=np.float32).reshape(4, 3)
IDS = [1, 3]


def _variables():
  registry = packed_reads.Registry()
  wrap = lambda value: packed_reads.PackableVariable(tf.Variable(value), registry)  # pylint: disable=unnecessary-lambda-assignment
  return registry, wrap(K0), wrap(B0), wrap(T0)


def _reads(concrete) -> dict:
  """Per captured variable handle: how many ReadVariableOps read it, and how many feed a pack."""
  by_handle = {id(inner): outer for outer, inner in concrete.graph.captures}
  counts = {}
  for op in concrete.graph.get_operations():
    if op.type != "ReadVariableOp":
      continue
    outer = by_handle.get(id(op.inputs[0]))
    consumers = [c for out in op.outputs for c in out.consumers()]
    packed = any(c.type == "Reshape" and any(cc.type == "ConcatV2" for cc in c.outputs[0].consumers())
                 for c in consumers)
    total, in_pack = counts.get(id(outer), (0, 0))
    counts[id(outer)] = (total + 1, in_pack + int(packed))
  return counts


def test_served_reads_have_the_values_and_gradients_of_plain_reads():
  registry, k, b, t = _variables()

  @tf.function
  def step(pack):
    with packed_reads.step_scope(registry if pack else None):
      with tf.GradientTape() as tape:
        rows = tf.gather(t, IDS)          # gathered first: the table is no pack member
        h = tf.matmul(X, k) + b           # the first dense read builds the pack
        with tf.GradientTape() as inner:  # opened after the pack: still gets its gradient
          y_inner = tf.reduce_sum((tf.matmul(X, k) + b) * k)
        g_inner = inner.gradient(y_inner, k)
        loss = tf.reduce_sum(h * h) + tf.reduce_sum(rows)
      g_k, g_b, g_t = tape.gradient(loss, [k, b, t])
    return g_k, g_b, g_t, g_inner, h

  h = X @ K0 + B0
  want_k = X.T @ (2 * h)
  want_b = (2 * h).sum(0)
  want_inner = np.broadcast_to(h, K0.shape) + np.outer(X[0], K0.sum(0))
  for pack in (False, True):
    g_k, g_b, g_t, g_inner, got_h = step(pack)
    np.testing.assert_allclose(got_h.numpy(), h, rtol=1e-6)
    np.testing.assert_allclose(g_k.numpy(), want_k, rtol=1e-6)
    np.testing.assert_allclose(g_b.numpy(), want_b, rtol=1e-6)
    np.testing.assert_allclose(g_inner.numpy(), want_inner, rtol=1e-6)
    # The table's gradient is its gathered rows only: no dense zero beside them.
    assert isinstance(g_t, tf.IndexedSlices), type(g_t)
    np.testing.assert_array_equal(g_t.indices.numpy(), IDS)
    np.testing.assert_array_equal(g_t.values.numpy(), np.ones([2, 3], np.float32))

  packed, plain = _reads(step.get_concrete_function(True)), _reads(step.get_concrete_function(False))
  # Packed: k and b are read once each, into the pack; plain: each read of theirs is an op.
  assert packed[id(k.get().handle)] == (1, 1) and packed[id(b.get().handle)] == (1, 1), packed
  assert plain[id(k.get().handle)][0] >= 2 and plain[id(k.get().handle)][1] == 0, plain
  assert id(t.get().handle) not in packed  # gathered: ResourceGather, no dense read
  assert t._gba_gathered and not k._gba_unread  # pylint: disable=protected-access


def test_reads_after_an_update_read_the_variable_itself():
  registry, k, b, _ = _variables()

  @tf.function
  def step():
    with packed_reads.step_scope(registry):
      before = tf.reduce_sum(k) + tf.reduce_sum(b)
      with tf.control_dependencies([before]):
        k.assign_add(tf.ones_like(K0))  # an update ends the pack
      after = tf.reduce_sum(k)
    return before, after

  before, after = step()
  assert before.numpy() == pytest.approx(K0.sum() + B0.sum())
  assert after.numpy() == pytest.approx(K0.sum() + K0.size)


def test_what_a_pack_leaves_out():
  registry = packed_reads.Registry()
  big = packed_reads.PackableVariable(
      tf.Variable(tf.zeros([packed_reads.MAX_ELEMENTS + 1])), registry)
  frozen = packed_reads.PackableVariable(tf.Variable(B0, trainable=False), registry)
  small = packed_reads.PackableVariable(tf.Variable(B0), registry)
  unused = packed_reads.PackableVariable(tf.Variable(K0), registry)

  @tf.function
  def step():
    with packed_reads.step_scope(registry):
      return tf.reduce_sum(big) + tf.reduce_sum(frozen) + tf.reduce_sum(small)

  assert step().numpy() == pytest.approx(2 * B0.sum())
  reads = _reads(step.get_concrete_function())
  assert reads[id(small.get().handle)] == (1, 1)
  assert reads[id(big.get().handle)] == (1, 0) and reads[id(frozen.get().handle)] == (1, 0)
  # `unused` rode in the first trace's pack without being read: later traces leave it out.
  assert unused._gba_unread  # pylint: disable=protected-access
  assert registry.members(small.device, tf.float32) == [small]


@pytest.fixture(scope="module")
def cluster():
  with LocalCluster(num_ps=1, num_workers=1) as c:
    yield c


@pytest.mark.parametrize("pack", [True, False])
def test_a_custom_loop_reads_a_server_once_per_step_and_trains_as_numpy(cluster, pack):
  strategy = GBAStrategy(cluster.resolver(), mode="async", pack_reads=pack)
  with strategy.scope():
    kernel = tf.Variable(np.zeros([2, 1], np.float32))
    bias = tf.Variable(np.zeros([1], np.float32))
    sgd = keras.optimizers.SGD(0.05)
  assert isinstance(kernel, packed_reads.PackableVariable) == pack
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  x = np.array([[1.0, 2.0], [-1.0, 0.5]], np.float32)
  y = np.array([[1.0], [-2.0]], np.float32)

  @tf.function
  def train():
    def replica():
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.matmul(x, kernel) + bias - y))
      sgd.apply_gradients(zip(tape.gradient(loss, [kernel, bias]), [kernel, bias]))
      return loss
    return strategy.run(replica)

  for _ in range(5):
    coordinator.schedule(train)
  coordinator.join()
  w, c = np.zeros([2, 1], np.float32), np.zeros([1], np.float32)
  for _ in range(5):
    err = x @ w + c - y
    w, c = w - 0.05 * (2 * x.T @ err / len(x)), c - 0.05 * (2 * err.mean(0))
  np.testing.assert_allclose(kernel.numpy(), w, rtol=1e-5)
  np.testing.assert_allclose(bias.numpy(), c, rtol=1e-5)
  reads = _reads(train.get_concrete_function())
  handles = [id(v.handle) for v in (kernel, bias)]
  if pack:
    assert [reads[h] for h in handles] == [(1, 1), (1, 1)], reads
  else:
    assert all(reads[h][1] == 0 for h in handles), reads
