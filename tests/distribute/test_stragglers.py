"""Straggler profiles: parsing, and real slowdowns on the async path of a local cluster."""

import json
import time

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute import GBAStrategy
from tf_gba.distribute import LocalCluster
from tf_gba.distribute import stragglers


def test_parse_profiles(tmp_path):
  assert stragglers.parse("none") == "none"
  assert stragglers.parse("persistent:3") == "persistent;0=3.0"
  assert stragglers.parse("persistent:2.5@1,3") == "persistent;1=2.5,3=2.5"
  assert stragglers.parse("transient:0.2:4") == "transient;0.2;4.0"
  trace = tmp_path / "trace.json"
  trace.write_text(json.dumps({"window_seconds": 5, "workers": {"1": [1, 3, 3, 1]}}))
  assert stragglers.parse(f"trace:{trace}") == "trace;5.0;1=1.0:3.0:3.0:1.0"
  assert stragglers.parse("transient:0.1:3+persistent:2@1") == (
      "transient;0.1;3.0+persistent;1=2.0")
  assert stragglers.parse("compute:40+persistent:2") == "compute;40.0+persistent;0=2.0"


@pytest.mark.parametrize("bad,message", [
    ("slow", "Unknown straggler profile"), ("persistent:0.5", ">= 1"),
    ("persistent:3@x", "integers"), ("transient:2:3", "probability"),
    ("transient:0.5", "transient:<p>:<factor>"), ("trace:/nonexistent.json", "does not exist"),
    ("compute:0", "positive"), ("compute:fast", "compute:<milliseconds>"),
])
def test_bad_profiles_are_refused(bad, message):
  with pytest.raises(ValueError, match=message):
    stragglers.parse(bad)


def test_transient_draws_are_reproducible_and_match_p():
  # Outside a cluster the op acts as worker 0; with p=0.3, about 30% of steps sleep.
  ops = stragglers._ops()
  delays = []
  for _ in range(300):
    start = ops.gba_step_begin()
    delays.append(float(ops.gba_step_end(start, profile="transient;0.3;1.5", seed=7)))
  slow = np.array(delays) > 0
  assert 0.2 < slow.mean() < 0.4


@pytest.mark.parametrize("factor", [1.0, 3.0])
def test_compute_floor_pads_the_step_then_the_factor_stretches_it(factor):
  """compute:<ms>: the step is padded to the floor, then stretched: with base = max(busy, floor),
  delay = (base - busy) + (factor - 1) * base. A step longer than the floor (a loaded machine can
  make a 30 ms step of nothing) is not padded, and its own time is what the factor stretches."""
  ops = stragglers._ops()
  floor_ms = 30.0
  profile = stragglers.parse(f"compute:{floor_ms}+persistent:{factor}@0")
  steps_before, busy_before, delay_before = ops.gba_worker_step_stats().numpy()[:3]
  for _ in range(5):
    start = ops.gba_step_begin()
    delay = float(ops.gba_step_end(start, profile=profile, seed=0))
    steps, busy_ns, delay_ns = ops.gba_worker_step_stats().numpy()[:3]
    busy = (busy_ns - busy_before) * 1e-9  # this step's own (real) time, as the kernel measured
    base = max(busy, floor_ms * 1e-3)
    want = (base - busy) + (factor - 1.0) * base
    assert steps == steps_before + 1
    assert delay == pytest.approx(want, abs=1e-6)
    assert (delay_ns - delay_before) * 1e-9 == pytest.approx(want, abs=1e-6)
    steps_before, busy_before, delay_before = steps, busy_ns, delay_ns


def test_the_longest_step_is_the_largest_own_time_plus_delay():
  """The counters' longest step: the max over timed steps of each step's busy + delay, as a
  reference computes it from the per-step differences of the sums."""
  ops = stragglers._ops()
  before = ops.gba_worker_step_stats().numpy()
  longest = int(before[6])
  profile = stragglers.parse("compute:5+transient:0.5:4")
  for _ in range(12):
    start = ops.gba_step_begin()
    ops.gba_step_end(start, profile=profile, seed=3)
    stats = ops.gba_worker_step_stats().numpy()
    step_ns = int(stats[1] - before[1]) + int(stats[2] - before[2])  # this step's busy + delay
    longest = max(longest, step_ns)
    assert int(stats[6]) == longest
    before = stats
  assert longest >= 4 * 5e6  # a 4x draw of a 5-ms floor came in 12 steps at p = 0.5


def test_timed_profile_times_every_step_and_slows_none():
  # `timed` (what --mode=auto runs without a profile): each step's own time is counted as under
  # a profile, no delay; `none` carries no timing op at all.
  assert stragglers.parse("timed") == stragglers.TIMED
  assert stragglers.timed("none") == stragglers.TIMED
  assert stragglers.timed("compute;40.0") == "compute;40.0"
  assert stragglers.timed_step_start("none") is None
  ops = stragglers._ops()
  steps0, busy0, delay0 = ops.gba_worker_step_stats().numpy()[:3]
  for _ in range(3):
    begin = time.monotonic_ns()
    start = stragglers.timed_step_start(stragglers.TIMED)
    time.sleep(0.01)
    delay = float(stragglers.timed_step_end(start, stragglers.TIMED, 0))
    outside = (time.monotonic_ns() - begin) * 1e-9
    steps, busy, delays = ops.gba_worker_step_stats().numpy()[:3]
    assert delay == 0.0 and delays == delay0
    assert steps == steps0 + 1
    assert 0.01 <= (busy - busy0) * 1e-9 <= outside
    steps0, busy0 = steps, busy
  factors, floor = stragglers.slowdown_factors([0, 1], [3, 4], [1.0, 2.0], stragglers.TIMED, 0)
  assert np.array_equal(factors, [1.0, 1.0]) and floor == 0.0


def test_compute_floor_leaves_a_longer_step_alone():
  ops = stragglers._ops()
  start = ops.gba_step_begin()
  x = tf.random.uniform([300, 300])
  for _ in range(20):
    x = tf.matmul(x, x) / 300.0
  with tf.control_dependencies([x]):
    delay = float(ops.gba_step_end(start, profile=stragglers.parse("compute:0.001"), seed=0))
  assert delay == 0.0


def _check_padded_then_stretched(w, floor_s, factor):
  """Worker stats `w` against the kernel's delay: a step that was busy b sleeps
  (max(b, floor) - b) + (factor - 1) x max(b, floor), so its delay + busy = factor x max(b, floor).

  Summed over n steps: delay = factor x floor x n - busy + factor x E, E the time steps ran past
  their floor. E = 0 while every step is shorter than its floor (then the equality is exact); a
  loaded machine makes steps outlast it (seen: 180 ms busy per 100 ms floor, delay 7.9 s against
  4.98 s for E = 0), and E <= max(0, busy - floor): at least one floor of each step past it is
  in the busy time, not in E.
  """
  padded = factor * floor_s * w["steps"] - w["busy_seconds"]
  past_floor_max = max(0.0, w["busy_seconds"] - floor_s)
  assert padded - 1e-6 <= w["delay_seconds"] <= padded + factor * past_floor_max + 1e-6, (
      w, floor_s, factor)


def test_persistent_straggler_runs_a_third_as_many_steps_async():
  """Worker 0 3x slower on a real cluster, with a 300 ms compute floor per step.

  The floor makes each worker's cycle mostly its own (padded, then stretched) step, as on
  machines of their own: without it, on 2 shared cores the fast workers speed up while the slow
  one sleeps, and the ratio depends on the machine's load (0.42-0.79 seen).
  """
  floor_s = 0.3
  with LocalCluster(num_ps=1, num_workers=3) as cluster:
    strategy = GBAStrategy(cluster.resolver(), mode="async",
                           stragglers=f"compute:{floor_s * 1000:g}+persistent:3@0")
    with strategy.scope():
      inp = keras.Input((3,), dtype=tf.int64)
      x = keras.layers.Flatten()(keras.layers.Embedding(1000, 8)(inp))
      model = keras.Model(inp, keras.layers.Dense(1, activation="sigmoid")(x))
      # One step per scheduled function: each worker takes its steps one by one, so the step
      # counts show the workers' speeds (functions of 20 would split 60 steps 20/20/20).
      model.compile(keras.optimizers.Adam(0.01), loss="binary_crossentropy",
                    steps_per_execution=1)

    def dataset_fn(_):
      ids = np.random.default_rng(0).integers(0, 1000, (4096, 3))
      y = (ids.sum(1) % 2).astype(np.float32)
      return tf.data.Dataset.from_tensor_slices((ids, y)).repeat().batch(256)

    model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
              steps_per_epoch=60, verbose=0)
    stats = strategy.worker_step_stats()
  slow, fast = stats[0], stats[1:]
  fast_mean = np.mean([w["steps"] for w in fast])
  ratio = slow["steps"] / fast_mean
  # Cycles of floor + o and 3 floor + o, o the RPCs around the step: 1/3 for o = 0, 0.4 for
  # o = 100 ms.
  assert 0.2 < ratio < 0.5, stats
  # Each step sleeps (floor - busy) + (3 - 1) x floor on the slow worker, floor - busy on the
  # others: exact while every step is shorter than its floor, and with the excess of the steps a
  # loaded machine makes outlast it bounded by the busy time measured (the placement test's rule).
  _check_padded_then_stretched(slow, floor_s, 3.0)
  for w in fast:
    _check_padded_then_stretched(w, floor_s, 1.0)


def _placement_run(placement: str, optimizer_fn, steps: int = 48, floor_s: float = 0.1,
                   slow: float = 4.0, mode: str = "gba"):
  """GBA (M = 3) on a real 3-worker cluster, worker 0 `slow`x slower, the delay at `placement`.

  Returns (optimizer stats, worker step stats).
  """
  with LocalCluster(num_ps=1, num_workers=3) as cluster:
    strategy = GBAStrategy(cluster.resolver(), mode=mode, num_aggregate=3,
                           stragglers=f"compute:{floor_s * 1000:g}+persistent:{slow:g}@0",
                           straggler_delay=placement)
    with strategy.scope():
      inp = keras.Input((3,), dtype=tf.int64)
      x = keras.layers.Flatten()(keras.layers.Embedding(1000, 8)(inp))
      model = keras.Model(inp, keras.layers.Dense(1, activation="sigmoid")(x))
      optimizer = optimizer_fn()
      # One step per scheduled function, as above: the staleness counts are of steps taken one
      # by one as each worker is free.
      model.compile(optimizer, loss="binary_crossentropy", steps_per_execution=1)

    def dataset_fn(_):
      ids = np.random.default_rng(0).integers(0, 1000, (4096, 3))
      y = (ids.sum(1) % 2).astype(np.float32)
      return tf.data.Dataset.from_tensor_slices((ids, y)).repeat().batch(64)

    model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
              steps_per_epoch=steps, verbose=0)
    return optimizer.stats(), strategy.worker_step_stats()


@pytest.mark.parametrize("placement", ["after_push", "before_push"])
def test_a_slow_machines_gradients_are_stale_only_when_it_sleeps_before_the_push(placement):
  """Where the straggler sleeps decides whether its gradients are stale (real servers).

  Reference: worker 0 takes 8 floors per step, workers 1 and 2 one floor. Before the push, the
  two fast workers push 2 x 8 = 16 gradients while worker 0 computes and sleeps, 16 / M = 5.3
  global steps: each of worker 0's gradients is at least 2 steps stale, and a fast worker's
  (one floor, during which at most 2 other gradients arrive: < one global step) at most 1.
  Two global steps take 2M = 6 fast gradients, so this holds while a fast worker's whole cycle
  (its floor and the RPCs around it) stays under 8/3 floors; with 4 floors per slow step it held
  only under 4/3 floors, and a loaded machine (a fast cycle of ~1.3 floors, 6.5 fast gradients per
  slow step) left 3 of 8 slow gradients 1 stale.
  After the push, every gradient is pushed a few milliseconds after its token: none is 2 stale.
  The delay accounting is the same in both: each step padded to its floor, then stretched.
  """
  from tf_gba.optimizers import GBA  # pylint: disable=g-import-not-at-top
  floor_s, slow, steps = 0.1, 8.0, 120  # 120: >= 6 slow steps (~7 with no overhead, 1 in 17)
  stats, workers = _placement_run(
      placement, lambda: GBA(keras.optimizers.Adam(0.01), num_aggregate=3), steps=steps,
      floor_s=floor_s, slow=slow)
  dense = stats["dense"]
  histogram = np.asarray(dense["histogram"])
  stale = int(histogram[2:].sum())
  slow_steps = workers[0]["steps"]
  assert sum(w["steps"] for w in workers) == int(histogram.sum()) == steps, (workers, dense)
  if placement == "before_push":
    # Every slow step's gradient but the first and the last: while the first is computed the
    # others are still starting; during the last, the others have run out of steps to push.
    assert slow_steps >= 6 and slow_steps - 2 <= stale <= slow_steps, (slow_steps, histogram,
                                                                       workers)
  else:
    assert stale == 0, (slow_steps, histogram, workers)
  _check_padded_then_stretched(workers[0], floor_s, slow)
  for w in workers[1:]:
    _check_padded_then_stretched(w, floor_s, 1.0)


def test_before_push_without_the_gba_optimizer_is_refused():
  """A bare Keras optimizer has no push to delay: a clear error, not a delay moved to the end.
  (Under mode="async", the one mode that takes a bare optimizer.)"""
  with pytest.raises(ValueError, match="before_push.*needs the GBA optimizer"):
    _placement_run("before_push", lambda: keras.optimizers.Adam(0.01), steps=3, mode="async")


def test_an_unknown_placement_is_refused():
  with pytest.raises(ValueError, match="--straggler_delay must be one of after_push, before_push"):
    stragglers.check_placement("middle")
