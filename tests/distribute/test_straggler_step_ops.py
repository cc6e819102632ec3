"""Straggler injection costs nothing without a profile: the step carries a step count only.

The step functions are traced and their graphs read: with --stragglers=none they hold no timing or
delay op (GBA>StepBegin, GBA>StepEnd), only GBA>StepCount (the per-worker step statistics); with a
profile they hold the timing pair and no separate count.
"""

import pytest
import tensorflow as tf

from tf_gba.distribute import GBAStrategy
from tf_gba.distribute import LocalCluster
from tf_gba.distribute import stragglers

STRAGGLER_OPS = {"GBA>StepBegin", "GBA>StepEnd"}


def _op_types(concrete) -> set:
  """Op types of a traced function's graph and of every function it calls."""
  graph_def = concrete.graph.as_graph_def()
  types = {node.op for node in graph_def.node}
  for fn in graph_def.library.function:
    types |= {node.op for node in fn.node_def}
  return types


@pytest.mark.parametrize("profile,present,absent", [
    ("none", {"GBA>StepCount"}, STRAGGLER_OPS),
    ("persistent:2@0", STRAGGLER_OPS, {"GBA>StepCount"}),
])
def test_timed_step_helpers(profile, present, absent):
  canonical = stragglers.parse(profile)

  @tf.function
  def step(x):
    start = stragglers.timed_step_start(canonical)
    with tf.control_dependencies([] if start is None else [start]):
      y = x * 2.0
    with tf.control_dependencies([y]):
      end = stragglers.timed_step_end(start, canonical, seed=0)
    with tf.control_dependencies([end]):
      return tf.identity(y)

  types = _op_types(step.get_concrete_function(tf.TensorSpec([], tf.float32)))
  assert present <= types and not absent & types, types


def test_step_count_counts_like_step_end():
  ops = stragglers._ops()  # pylint: disable=protected-access
  before = int(ops.gba_worker_step_stats().numpy()[0])
  counts = [int(ops.gba_step_count()) for _ in range(3)]
  assert counts == [before + 1, before + 2, before + 3]
  # The first step of the process started its clock (the straggler position's).
  stats = ops.gba_worker_step_stats().numpy()
  assert stats[3] > 0 and stats[5] > 0
  delay = ops.gba_step_end(ops.gba_step_begin(), profile="none", seed=0)
  assert float(delay) == 0.0
  assert int(ops.gba_worker_step_stats().numpy()[0]) == before + 4


def _train_step(strategy, v):
  def replica_fn():
    return v.assign_add(1.0)

  @tf.function
  def train_step():
    return strategy.run(replica_fn)
  return train_step


def test_strategy_step_has_no_straggler_ops_without_a_profile():
  """GBAStrategy.run's step, traced on a real cluster, with and without a profile."""
  with LocalCluster(num_ps=1, num_workers=1) as cluster:
    found = {}
    for profile in ("none", "transient:0.2:4"):
      strategy = GBAStrategy(cluster.resolver(), mode="async", stragglers=profile)
      with strategy.scope():
        v = tf.Variable(0.0)
      found[profile] = _op_types(_train_step(strategy, v).get_concrete_function())
  assert not STRAGGLER_OPS & found["none"] and "GBA>StepCount" in found["none"]
  assert STRAGGLER_OPS <= found["transient:0.2:4"]
  assert "GBA>StepCount" not in found["transient:0.2:4"]
