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


def _feed_timed(watch, lines):
  return [watch.interval(t, steps, each, functions) for t, steps, each, functions in lines]


_USUAL = [(0, 0, [0, 0], [0.3, 0.3]), (2, 40, [20, 20], [0.4, 0.3]), (4, 80, [40, 40], [0.3, 0.4])]


def test_a_worker_whose_function_was_long_held_the_interval_up_whatever_the_counts():
  # A worker's link cut for 12 s while a progress line waited for every worker: the other one
  # went on only until that line, so the counts are even (the case step counts alone called
  # "every worker held up"); the coordinator waited 13 s for one of worker 1's functions and at
  # most 0.4 s for worker 0's.
  watch = slow_interval.SlowIntervalWatch(waits_for_every_worker=False)
  said = _feed_timed(watch, _USUAL + [(18, 120, [60, 60], [0.4, 13.0])])
  assert said[:3] == [None] * 3
  lost = 14 - 2.0  # 40 steps in 14 s against 2 s
  assert 13.0 >= slow_interval.HELD_SHARE * lost > 0.4
  assert said[3].startswith("tf_gba: the last 40 steps took 14 s, 7x the usual (2.0 s): "
                            "worker:1 made 20 of them and held it up (a function of 13 s, the "
                            "others' at most 0.4 s); worked around it: the other workers made "
                            "their steps")


def test_every_worker_with_long_functions_was_held_up_even_when_counts_name_one():
  # A parameter server's link cut for 5 s: every worker's steps wait on it. Counts of whole
  # functions can leave one worker behind (a hash run at 12,000 steps read it as worker:0's);
  # every function was long, so every worker was held up.
  watch = slow_interval.SlowIntervalWatch(waits_for_every_worker=False)
  said = _feed_timed(watch, _USUAL + [(13, 120, [50, 70], [6.0, 5.5])])
  assert "every worker was held up (each one's longest function 6 s)" in said[3]
  assert "waited for it" in said[3] and "worked around" not in said[3]


def test_no_long_function_means_the_coordinator_itself_was_held_up():
  watch = slow_interval.SlowIntervalWatch(waits_for_every_worker=False)
  said = _feed_timed(watch, _USUAL + [(14, 120, [60, 60], [0.5, 0.4])])
  assert said[3].endswith("no worker's function took long (at most 0.5 s): the coordinator was "
                          "held up (a checkpoint, a read of the servers, a busy machine); waited "
                          "for it (--stall_timeout_s restarts the job past a limit).")
  # Unknown function times (None): the step counts decide, as before.
  counted = slow_interval.SlowIntervalWatch(waits_for_every_worker=False)
  said = _feed_timed(counted, [(t, s, e, None) for t, s, e, _ in _USUAL] +
                     [(18, 120, [44, 76], None)])
  assert "worker:0 made 4 of them; worked around it" in said[3]


def test_a_checkpoint_that_held_the_coordinator_is_said_as_such():
  # The short chaos drill: worker:1's link stalled 12 s as a checkpoint began; its save (traced
  # and registered with every server at each checkpoint) waited for the link, with no function
  # of any worker running. The coordinator spent 11 s of the interval's lost 10 in checkpoints.
  watch = slow_interval.SlowIntervalWatch(waits_for_every_worker=False)
  said = [watch.interval(t, s, e, f, c) for t, s, e, f, c in
          [line + (0.1,) for line in _USUAL] + [(14, 120, [60, 60], [0.5, 0.4], 11.0)]]
  assert said[3].endswith("no worker's function took long (at most 0.5 s): a checkpoint held the "
                          "coordinator 11 s (its save is registered with every server, which "
                          "waits for a stalled link, a worker's or a server's); waited for it "
                          "(--stall_timeout_s restarts the job past a limit).")
  # A checkpoint of its usual length explains nothing: the coordinator itself was held up.
  watch = slow_interval.SlowIntervalWatch(waits_for_every_worker=False)
  said = [watch.interval(t, s, e, f, 0.2) for t, s, e, f in _USUAL + [(14, 120, [60, 60],
                                                                      [0.5, 0.4])]]
  assert "the coordinator was held up (a checkpoint" in said[3]


def test_a_worker_that_does_not_answer_is_said_once_and_again_when_it_answers():
  silent = slow_interval.SilentWorkers()
  assert silent.update(100.0, [], [0.2, 0.3], 500) == []
  # Worker 1's function started 7 s before the line that found it silent.
  said = silent.update(110.0, [1], [0.4, 7.0], 800)
  assert len(said) == 1 and said[0].startswith(
      f"tf_gba: worker:1 did not answer in {slow_interval.NO_ANSWER_S:.0f} s (its function has "
      "run 7 s, the others' at most 0.4 s: its link or its process stalled); worked around it "
      "until the next checkpoint, which waits for it: the other workers go on")
  assert silent.silent == [1]
  assert silent.update(115.0, [1], [0.3, 12.0], 950) == []  # said once, not at every line
  # Back at 125 s: silent since 103 s (110 - 7), 1,100 - 800 global steps made meanwhile.
  assert silent.update(125.0, [], [0.3, 0.2], 1100) == [
      "tf_gba: worker:1 answers again after 22 s; 300 global steps were made without it."]
  assert silent.silent == []
