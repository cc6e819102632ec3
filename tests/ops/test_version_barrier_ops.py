"""Version barrier (Hop-BW): a worker waits until the version passes the last one it pushed for.

Blocked waits run in Python threads (an eager op releases the GIL while its kernel waits). That a
wait is blocked is checked through the barrier's own count of blocked waits, never by timing;
everything that must happen gets a generous deadline.
"""

import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from tf_gba.ops.version_barrier import VersionBarrier

DEADLINE_S = 120.0


class Wait(threading.Thread):
  def __init__(self, barrier, worker):
    super().__init__(daemon=True)
    self.barrier, self.worker = barrier, worker
    self.result, self.error = None, None
    self.start()

  def run(self):
    try:
      version, skip, _ = self.barrier.wait(self.worker)
      self.result = (int(version), bool(skip))
    except tf.errors.OpError as e:  # the barrier destroyed or the wait cancelled
      self.error = e


def _until(cond):
  deadline = time.time() + DEADLINE_S
  while not cond():
    assert time.time() < deadline, "timed out waiting for a condition that must hold"
    time.sleep(0.01)


def _blocked(barrier, n):
  _until(lambda: int(barrier.stats()["waiting"].sum()) == n)


def test_first_wait_passes_and_a_second_blocks_until_all_buffers_complete():
  b = VersionBarrier(3, initial_version=5)
  assert tuple(int(x) if x.dtype != tf.bool else bool(x) for x in b.wait(0)[:2]) == (5, False)
  b.report(0, 5, True, completed=0, num_buffers=2)   # worker 0 pushed for 5
  w = Wait(b, 0)
  _blocked(b, 1)
  # Worker 1's push completes one of the two buffers: version 5 is not complete yet.
  assert int(b.report(1, 5, True, completed=1, num_buffers=2)) == 5
  assert w.is_alive() and int(b.stats()["waiting"][0]) == 1
  # Worker 2 completes the second one: version 6, and worker 0 may go on with it.
  assert int(b.report(2, 5, True, completed=1, num_buffers=2)) == 6
  w.join(DEADLINE_S)
  assert w.result == (6, False)
  s = b.stats()
  assert s["version"] == 6
  np.testing.assert_array_equal(s["gradients"], [1, 1, 1])
  np.testing.assert_array_equal(s["duplicates"], [0, 0, 0])


def test_late_report_and_reference_schedule():
  """A scripted schedule against a plain-Python model of the rules."""
  rng = np.random.default_rng(0)
  n, buffers = 4, 3
  b = VersionBarrier(n)
  version, last, completions = 0, [-1] * n, 0
  for _ in range(200):
    w = int(rng.integers(n))
    if version > last[w]:
      got_version, skip, _ = b.wait(w)
      assert (int(got_version), bool(skip)) == (version, False)
      last[w] = version
      completed = int(rng.integers(0, buffers - completions + 1))
      if all(x == version for x in last):  # the last worker of a version completes it
        completed = buffers - completions
      completions += completed
      if completions >= buffers:
        version, completions = version + 1, 0
      assert int(b.report(w, last[w], True, completed, buffers)) == version
    else:
      # A report of an older version (a late gradient) changes nothing but the counters.
      assert int(b.report(w, last[w], False, 0, buffers)) == version
  s = b.stats()
  assert s["version"] == version > 10
  assert int(s["duplicates"].sum()) == 0


def test_release_lets_blocked_waits_skip():
  b = VersionBarrier(2)
  b.wait(0)
  b.report(0, 0, True, 0, 1)
  b.wait(1)
  b.report(1, 0, True, 0, 1)
  waits = [Wait(b, 0), Wait(b, 1)]
  _blocked(b, 2)
  b.release()
  for w in waits:
    w.join(DEADLINE_S)
    assert w.result == (0, True)
  s = b.stats()
  np.testing.assert_array_equal(s["released"], [1, 1])
  assert s["version"] == 0 and int(s["waiting"].sum()) == 0


def test_a_second_push_for_one_version_is_counted_as_duplicate():
  b = VersionBarrier(2)
  b.report(0, 0, True, 0, 1)
  b.report(0, 0, True, 0, 1)
  np.testing.assert_array_equal(b.stats()["duplicates"], [1, 0])


def test_destroying_the_barrier_fails_blocked_waits():
  b = VersionBarrier(1)
  b.report(0, 0, True, 0, 1)
  w = Wait(b, 0)
  _blocked(b, 1)
  b._destroy_resource()  # pylint: disable=protected-access
  w.join(DEADLINE_S)
  assert isinstance(w.error, tf.errors.CancelledError)


@pytest.mark.parametrize("in_function", [False, True])
def test_bad_inputs_have_actionable_errors(in_function):
  b = VersionBarrier(2)
  cases = [(lambda: b.wait(2), "worker must be in"),
           (lambda: b.report(-1, 0, True, 0, 1), "worker must be in"),
           (lambda: b.report(0, -1, True, 0, 1), "version must be >= 0"),
           (lambda: b.report(0, 0, True, 3, 2), "completed <= num_buffers")]
  for fn, message in cases:
    if in_function:
      fn = tf.function(fn)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
      fn()
  with pytest.raises(ValueError, match="num_workers must be >= 1"):
    VersionBarrier(0)
