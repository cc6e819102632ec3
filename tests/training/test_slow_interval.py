"""slow_interval: the one line a job prints about an interval far slower than the usual one."""

from tf_gba.training import slow_interval


def _feed(watch, lines):
  return [watch.interval(t, steps, each) for t, steps, each in lines]


def test_a_worker_that_fell_behind_is_worked_around_in_gba():
  watch = slow_interval.SlowIntervalWatch(waits_for_every_worker=False)
  # 20 steps a second per interval of 40 (2 s), then 40 steps in 12 s, worker 0 making 4.
  said = _feed(watch, [(0, 0, [0, 0]), (2, 40, [20, 20]), (4, 80, [40, 40]), (6, 120, [60, 60]),
                       (18, 160, [64, 96])])
  assert said[:4] == [None] * 4
  assert said[4].startswith("tf_gba: the last 40 steps took 12 s, 6x the usual (2.0 s)")
  assert "worker:0 made 4 of them; worked around it: the other workers made the rest" in said[4]


def test_every_worker_held_up_is_waited_for_and_sync_always_waits():
  gba = slow_interval.SlowIntervalWatch(waits_for_every_worker=False)
  said = _feed(gba, [(0, 0, [0, 0]), (2, 40, [20, 20]), (4, 80, [40, 40]), (14, 120, [60, 60])])
  assert "every worker was held up" in said[3] and "5x the usual" in said[3]
  sync = slow_interval.SlowIntervalWatch(waits_for_every_worker=True)
  said = _feed(sync, [(0, 0, None), (2, 40, None), (4, 80, None), (14, 120, None)])
  assert said[3].endswith("waited for the slowest worker (sync: every step waits for every "
                          "worker).")


def test_jitter_and_short_delays_say_nothing():
  watch = slow_interval.SlowIntervalWatch(waits_for_every_worker=False)
  # 2.9x the usual: under the factor.
  assert _feed(watch, [(0, 0, None), (2, 40, None), (4, 80, None), (9.8, 120, None)])[3] is None
  # 4x the usual, but only 1.5 s lost (under MIN_EXTRA_S).
  fast = slow_interval.SlowIntervalWatch(waits_for_every_worker=True)
  assert _feed(fast, [(0, 0, None), (0.5, 40, None), (1.0, 80, None), (3.0, 120, None)])[3] is None
  # The first intervals (no usual one yet) and an interval without steps say nothing.
  fresh = slow_interval.SlowIntervalWatch(waits_for_every_worker=True)
  assert _feed(fresh, [(0, 0, None), (30, 40, None), (60, 40, None)]) == [None, None, None]
