"""recovery.CheckpointSchedule: when the periodic checkpoints of every training loop are due."""

from tf_gba.training import recovery


class _Clock:
  def __init__(self):
    self.now = 1000.0

  def __call__(self):
    return self.now


def test_due_every_n_steps_counted_from_the_last_checkpoint(monkeypatch):
  clock = _Clock()
  monkeypatch.setattr(recovery.time, "time", clock)
  schedule = recovery.CheckpointSchedule(every_steps=40, every_secs=0)
  assert [s for s in range(0, 130) if schedule.due(s)][:1] == [40]
  schedule.written(43)  # written a few steps late: the next one is 40 steps after it
  assert not schedule.due(82) and schedule.due(83) and schedule.due_by_steps(83)
  clock.now += 1e6  # no time interval: time alone never makes one due
  assert not schedule.due(44)


def test_due_after_n_seconds_whatever_the_steps(monkeypatch):
  clock = _Clock()
  monkeypatch.setattr(recovery.time, "time", clock)
  schedule = recovery.CheckpointSchedule(every_steps=0, every_secs=30)
  clock.now += 29.9
  assert not schedule.due(10**6) and not schedule.due_by_steps(10**6)
  clock.now += 0.1
  assert schedule.due(1)
  schedule.written(1)
  assert not schedule.due(2)
  clock.now += 30
  assert schedule.due(2)


def test_either_interval_makes_it_due(monkeypatch):
  clock = _Clock()
  monkeypatch.setattr(recovery.time, "time", clock)
  schedule = recovery.CheckpointSchedule(every_steps=100, every_secs=60)
  assert not schedule.due(99)
  assert schedule.due(100)
  clock.now += 60
  assert schedule.due(5)
  assert not recovery.CheckpointSchedule(0, 0).due(10**9)
