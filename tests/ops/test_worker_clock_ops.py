"""Worker clock (Hop-BS): a wait blocks while its worker leads the slowest by more than the bound.

Every rule is checked against `RefClock`, a plain-Python model of the clock. Blocked waits run in
Python threads (an eager op releases the GIL while its kernel waits). Nothing here asserts that
something happens within a short time: a wait that must be blocked is checked through the clock's
own count of blocked waits, and everything that must happen is given a generous deadline.
"""

import os
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from tf_gba.ops import worker_clock
from tf_gba.ops.worker_clock import WorkerClock

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEADLINE_S = 120.0  # for things that must happen: only ever reached by a bug (or a hang)
NO_TIMEOUT = 0
LONG_TIMEOUT_MS = 600_000  # a timeout that must never fire: a wrong release shows as timed_out


class RefClock:
  """The clock's rules in plain Python."""

  def __init__(self, num_workers):
    self.completed = [0] * num_workers

  def lead(self, worker):
    return self.completed[worker] - min(self.completed)

  def allowed(self, worker, bound):
    return self.lead(worker) <= bound

  def tick(self, worker):
    self.completed[worker] += 1


class Wait(threading.Thread):
  """One clock.wait(...) in its own thread; keeps its result or its exception."""

  def __init__(self, clock, worker, bound, timeout_ms=NO_TIMEOUT, fn=None):
    super().__init__(daemon=True)
    self.clock, self.worker, self.bound, self.timeout_ms = clock, worker, bound, timeout_ms
    self.fn = fn
    self.result = None
    self.error = None
    self.start()

  def run(self):
    try:
      fn = self.fn or self.clock.wait
      waited, timed_out = fn(self.worker, self.bound, self.timeout_ms)
      self.result = (int(waited), bool(timed_out))
    except Exception as e:  # pylint: disable=broad-except
      self.error = e

  def finished(self, timeout=DEADLINE_S):
    self.join(timeout)
    assert not self.is_alive(), "wait did not return"
    if self.error is not None:
      raise self.error
    return self.result


def _eventually(predicate, what, timeout=DEADLINE_S):
  deadline = time.monotonic() + timeout
  while not predicate():
    assert time.monotonic() < deadline, f"never happened: {what}"
    time.sleep(0.005)


def _park(clock, waits_expected):
  """Waits until the clock reports `waits_expected` (per worker) blocked waits."""
  _eventually(lambda: list(clock.waiting()) == list(waits_expected),
              f"blocked waits == {list(waits_expected)} (now {list(clock.waiting())})")


# ------------------------------------------------------------------------------------------------
# Scripted scenarios


def test_wait_blocks_until_the_slowest_workers_catch_up():
  clock, ref = WorkerClock(3), RefClock(3)
  for _ in range(2):
    clock.tick(0)
    ref.tick(0)
  assert not ref.allowed(0, 1)
  w = Wait(clock, 0, bound=1, timeout_ms=LONG_TIMEOUT_MS)
  _park(clock, [1, 0, 0])
  time.sleep(0.2)
  assert w.is_alive()

  clock.tick(1)
  ref.tick(1)
  assert not ref.allowed(0, 1)  # min is still worker 2's 0
  assert list(clock.waiting()) == [1, 0, 0]  # released (or not) inside the tick itself
  assert w.is_alive()

  clock.tick(2)
  ref.tick(2)
  assert ref.allowed(0, 1)
  waited_ns, timed_out = w.finished()
  assert not timed_out and waited_ns > 0
  stats = clock.stats()
  np.testing.assert_array_equal(stats["completed"], ref.completed)
  np.testing.assert_array_equal(stats["waits"], [1, 0, 0])
  np.testing.assert_array_equal(stats["timeouts"], [0, 0, 0])
  assert stats["blocked_ns"][0] == waited_ns
  assert stats["max_lead"] == ref.lead(0) == 1


def test_allowed_wait_returns_at_once():
  clock, ref = WorkerClock(2), RefClock(2)
  clock.tick(0)
  ref.tick(0)
  assert ref.allowed(0, 1) and ref.allowed(1, 0)
  # Run in this very thread: it would hang the test if it blocked (timeout_ms=0: no limit).
  for worker, bound in [(0, 1), (1, 0), (0, 5)]:
    _, timed_out = clock.wait(worker, bound, NO_TIMEOUT)
    assert not bool(timed_out)
  stats = clock.stats()
  np.testing.assert_array_equal(stats["waits"], [2, 1])
  assert stats["max_lead"] == 1


def test_own_tick_never_releases_own_wait():
  # A worker that ticks while its own wait is blocked only gets further ahead.
  clock, ref = WorkerClock(2), RefClock(2)
  clock.tick(0)
  ref.tick(0)
  w = Wait(clock, 0, bound=0, timeout_ms=LONG_TIMEOUT_MS)
  _park(clock, [1, 0])
  clock.tick(0)
  ref.tick(0)
  assert list(clock.waiting()) == [1, 0] and not ref.allowed(0, 0)
  clock.tick(1)
  ref.tick(1)
  assert list(clock.waiting()) == [1, 0] and not ref.allowed(0, 0)
  clock.tick(1)
  ref.tick(1)
  assert ref.allowed(0, 0)
  assert w.finished()[1] is False


def test_reset_releases_every_blocked_wait_and_zeroes_the_counters():
  clock = WorkerClock(3)
  for _ in range(3):
    clock.tick(2)
  waits = [Wait(clock, 2, bound=b, timeout_ms=LONG_TIMEOUT_MS) for b in (0, 1, 2)]
  _park(clock, [0, 0, 3])
  clock.reset()
  for w in waits:
    assert w.finished()[1] is False
  stats = clock.stats()
  np.testing.assert_array_equal(stats["completed"], [0, 0, 0])
  np.testing.assert_array_equal(stats["timeouts"], [0, 0, 0])
  # The released waits are the first events of the new count, at lead 0.
  np.testing.assert_array_equal(stats["waits"], [0, 0, 3])
  assert stats["max_lead"] == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_script_matches_reference(seed):
  """Random ticks, waits (several per worker, random bounds) and resets, checked step by step.

  After every tick the set of blocked waits must be exactly the reference's: released waits have
  returned, the others are still blocked (the clock releases inside the tick, so this is exact).
  """
  rng = random.Random(seed)
  n = 4
  clock, ref = WorkerClock(n), RefClock(n)
  blocked = []  # (Wait, lead it will be released at is computed on release)
  expect_waits, expect_blocked_ns = [0] * n, [0] * n
  max_lead = 0

  def count(w, lead):
    nonlocal max_lead
    waited_ns, timed_out = w.finished()
    assert not timed_out
    expect_waits[w.worker] += 1
    expect_blocked_ns[w.worker] += waited_ns
    max_lead = max(max_lead, lead)

  def blocked_per_worker():
    c = [0] * n
    for w in blocked:
      c[w.worker] += 1
    return c

  for _ in range(120):
    r = rng.random()
    if r < 0.45 and len(blocked) < 6:
      worker, bound = rng.randrange(n), rng.randrange(3)
      w = Wait(clock, worker, bound, LONG_TIMEOUT_MS)
      if ref.allowed(worker, bound):
        count(w, ref.lead(worker))
      else:
        blocked.append(w)
        _park(clock, blocked_per_worker())
    elif r < 0.97:
      worker = rng.randrange(n)
      clock.tick(worker)
      ref.tick(worker)
      still = []
      for w in blocked:
        if ref.allowed(w.worker, w.bound):
          count(w, ref.lead(w.worker))
        else:
          still.append(w)
      blocked = still
      assert list(clock.waiting()) == blocked_per_worker()
      assert all(w.is_alive() for w in blocked)
    else:
      stats = clock.stats()
      np.testing.assert_array_equal(stats["completed"], ref.completed)
      np.testing.assert_array_equal(stats["waits"], expect_waits)
      np.testing.assert_array_equal(stats["blocked_ns"], expect_blocked_ns)
      assert stats["max_lead"] == max_lead
      clock.reset()
      ref = RefClock(n)
      expect_waits, expect_blocked_ns, max_lead = [0] * n, [0] * n, 0
      for w in blocked:
        count(w, 0)
      blocked = []

  stats = clock.stats()
  np.testing.assert_array_equal(stats["completed"], ref.completed)
  np.testing.assert_array_equal(stats["waits"], expect_waits)
  np.testing.assert_array_equal(stats["blocked_ns"], expect_blocked_ns)
  np.testing.assert_array_equal(stats["timeouts"], [0] * n)
  assert stats["max_lead"] == max_lead
  clock.reset()
  for w in blocked:
    w.finished()


# ------------------------------------------------------------------------------------------------
# Timeouts


def test_timeout_proceeds_anyway_and_is_counted():
  clock = WorkerClock(2)
  clock.tick(0)
  clock.tick(0)
  timeout_ms = 300
  waited_ns, timed_out = clock.wait(0, 0, timeout_ms)  # worker 1 never ticks
  assert bool(timed_out)
  assert timeout_ms * 1_000_000 <= int(waited_ns) < DEADLINE_S * 1e9
  stats = clock.stats()
  np.testing.assert_array_equal(stats["waits"], [1, 0])
  np.testing.assert_array_equal(stats["timeouts"], [1, 0])
  assert stats["blocked_ns"][0] == int(waited_ns)
  assert stats["max_lead"] == 0  # a timed-out wait says nothing about the bound
  assert list(clock.waiting()) == [0, 0]


def test_release_and_timeout_of_concurrent_waits():
  # A (bound 1, long timeout) is released by ticks; B (bound 0) still cannot go and times out;
  # C, parked after B with an earlier deadline, times out first.
  clock = WorkerClock(3)
  clock.tick(0)
  clock.tick(0)
  a = Wait(clock, 0, 1, LONG_TIMEOUT_MS)
  b = Wait(clock, 0, 0, 3000)
  _park(clock, [2, 0, 0])
  c = Wait(clock, 0, 0, 200)
  assert c.finished()[1] is True
  clock.tick(1)
  clock.tick(2)
  assert a.finished()[1] is False
  waited_b, timed_out_b = b.finished()
  assert timed_out_b and waited_b >= 3000 * 1_000_000
  stats = clock.stats()
  np.testing.assert_array_equal(stats["waits"], [3, 0, 0])
  np.testing.assert_array_equal(stats["timeouts"], [2, 0, 0])
  assert stats["max_lead"] == 1


# ------------------------------------------------------------------------------------------------
# Many workers at once


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_stress_bound_holds_and_nothing_deadlocks(mode):
  n, steps, bound = 4, 25, 1
  clock = WorkerClock(n)
  lock = threading.Lock()
  ticked = [0] * n  # == the clock's counts: ticks happen under `lock`
  violations, waited_sum, errors = [], [0] * n, []

  if mode == "function":
    @tf.function
    def wait_fn(worker, b, timeout):
      return clock.wait(worker, b, timeout)

    @tf.function
    def tick_fn(worker):
      clock.tick(worker)
  else:
    wait_fn, tick_fn = clock.wait, clock.tick

  def worker_loop(w):
    rng = random.Random(w)
    try:
      for step in range(steps):
        waited, timed_out = wait_fn(tf.constant(w, tf.int64), tf.constant(bound, tf.int64),
                                    tf.constant(LONG_TIMEOUT_MS, tf.int64))
        assert not bool(timed_out)
        waited_sum[w] += int(waited)
        with lock:
          # The wait returned when every worker had completed >= step - bound steps; counts only
          # grow, so this still holds now.
          if min(ticked) < step - bound:
            violations.append((w, step, list(ticked)))
        time.sleep(rng.random() * 0.002 * (1 + w))  # worker w is (1 + w) times slower
        with lock:
          tick_fn(tf.constant(w, tf.int64))
          ticked[w] += 1
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=worker_loop, args=(w,), daemon=True) for w in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(DEADLINE_S * 2)
  assert not any(t.is_alive() for t in threads), "deadlock"
  assert not errors, errors
  assert not violations, violations
  stats = clock.stats()
  np.testing.assert_array_equal(stats["completed"], [steps] * n)
  np.testing.assert_array_equal(stats["waits"], [steps] * n)
  np.testing.assert_array_equal(stats["timeouts"], [0] * n)
  np.testing.assert_array_equal(stats["blocked_ns"], waited_sum)
  assert 0 <= stats["max_lead"] <= bound


_FEW_THREADS_SCRIPT = r"""
import os, sys, threading, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
os.environ["CUDA_VISIBLE_DEVICES"] = ""
import tf_gba
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(2)
tf.config.threading.set_intra_op_parallelism_threads(1)
from tf_gba.ops.worker_clock import WorkerClock

clock = WorkerClock(2)
clock.tick(0)
N = 8

# N independent waits of worker 0 (bound 0), all blocked until worker 1 ticks. A v1-style graph:
# tf.function would chain ops on one resource by automatic control dependencies.
many_waits = tf.compat.v1.wrap_function(
    lambda: [clock.wait(0, 0, 600000)[1] for _ in range(N)], signature=[])

@tf.function
def tick_one():
  clock.tick(1)

out = {}
t = threading.Thread(target=lambda: out.update(r=[bool(x) for x in many_waits()]), daemon=True)
t.start()
deadline = time.monotonic() + 120
while clock.waiting()[0] != N:
  if time.monotonic() > deadline:
    print("BLOCKED", clock.waiting().tolist()); sys.exit(1)
  time.sleep(0.01)
tick_one()  # a function too: it needs an inter-op thread to run
t.join(120)
print("RESULT", out.get("r"), clock.stats()["waits"].tolist())
sys.exit(0 if out.get("r") == [False] * N else 2)
"""


def test_blocked_waits_hold_no_inter_op_thread():
  # 8 waits blocked at once with only 2 inter-op threads; the tick, itself run by a function on
  # those threads, must still get through and release them all.
  proc = subprocess.run([sys.executable, "-c", _FEW_THREADS_SCRIPT], cwd=_ROOT,
                        capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  assert "RESULT [False, False, False, False, False, False, False, False] [8, 0]" in proc.stdout


# ------------------------------------------------------------------------------------------------
# Cancellation and destruction


def test_destroying_the_clock_cancels_blocked_waits():
  clock = WorkerClock(2)
  clock.tick(0)
  w = Wait(clock, 0, 0, NO_TIMEOUT)
  _park(clock, [1, 0])
  tf.raw_ops.DestroyResourceOp(resource=clock.resource_handle, ignore_lookup_error=False)
  with pytest.raises(tf.errors.CancelledError, match="destroyed"):
    w.finished()


def test_cancelled_step_cancels_its_blocked_wait():
  from tensorflow.python.eager import cancellation  # pylint: disable=g-import-not-at-top
  clock = WorkerClock(2)
  clock.tick(0)

  @tf.function
  def wait():
    return clock.wait(0, 0, NO_TIMEOUT)

  manager = cancellation.CancellationManager()
  cancelable = manager.get_cancelable_function(wait.get_concrete_function())
  w = Wait(clock, 0, 0, fn=lambda *_: cancelable())
  _park(clock, [1, 0])
  manager.start_cancel()
  with pytest.raises(tf.errors.CancelledError):
    w.finished()
  assert list(clock.waiting()) == [0, 0]
  np.testing.assert_array_equal(clock.stats()["waits"], [0, 0])  # a failed wait counts nowhere
  clock.tick(1)  # the clock still works
  assert clock.wait(0, 0, NO_TIMEOUT)[1].numpy() == False  # noqa: E712


# ------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("graph", [False, True])
def test_bad_arguments_are_clear_errors(graph):
  clock = WorkerClock(3)

  def tick(worker):
    clock.tick(worker)

  def call(f, *args):
    if graph:
      args = [tf.constant(a, tf.int64) for a in args]
      return tf.function(f)(*args)
    return f(*args)

  cases = [
      (clock.wait, (3, 0, 0), r"worker must be in \[0, num_workers=3\), got 3"),
      (clock.wait, (-1, 0, 0), r"worker must be in \[0, num_workers=3\), got -1"),
      (clock.wait, (0, -1, 0), r"bound must be >= 0, got -1"),
      (clock.wait, (0, 0, -5), r"timeout_ms must be >= 0 \(0: no time limit\), got -5"),
      (tick, (7,), r"worker must be in \[0, num_workers=3\), got 7"),
  ]
  for f, args, message in cases:
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
      call(f, *args)
  np.testing.assert_array_equal(clock.stats()["completed"], [0, 0, 0])


def test_wrong_shapes():
  clock = WorkerClock(2)
  with pytest.raises(tf.errors.InvalidArgumentError, match="worker must be a scalar"):
    clock.wait([0, 1], 0, 0)
  with pytest.raises(tf.errors.InvalidArgumentError, match="bound must be a scalar"):
    clock.wait(0, [0], 0)
  with pytest.raises(ValueError, match="rank"):  # static shapes: refused when tracing

    @tf.function
    def f():
      return clock.wait(0, 0, tf.constant([1, 2], tf.int64))

    f()

  @tf.function(input_signature=[tf.TensorSpec(None, tf.int64)])
  def g(worker):  # unknown shape: refused by the kernel
    clock.tick(worker)

  with pytest.raises(tf.errors.InvalidArgumentError, match="worker must be a scalar"):
    g(tf.constant([0, 1], tf.int64))


def test_num_workers_must_be_positive():
  with pytest.raises(ValueError, match="num_workers"):
    WorkerClock(0)
  with pytest.raises(tf.errors.InvalidArgumentError, match="num_workers must be >= 1"):
    worker_clock._ops().gba_worker_clock_create(num_workers=0, shared_name="tf_gba/test/bad")


# ------------------------------------------------------------------------------------------------
# Worker index


def test_worker_index_is_zero_outside_a_cluster():
  assert int(worker_clock.worker_index()) == 0
  assert int(tf.function(worker_clock.worker_index)()) == 0
  # This process's own CPU: /job:localhost, or /job:chief after an earlier test in the same
  # process connected to a local cluster as its coordinator; never a worker.
  with tf.device(tf.config.list_logical_devices("CPU")[0].name):
    assert int(worker_clock.worker_index()) == 0


def test_not_checkpointed(tmp_path):
  clock = WorkerClock(2)
  clock.tick(1)
  ckpt = tf.train.Checkpoint(clock=clock)
  path = ckpt.save(str(tmp_path / "ck"))
  names = [name for name, _ in tf.train.list_variables(path)]
  assert not any("clock" in name for name in names), names
