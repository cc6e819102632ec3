"""A periodic checkpoint save held past its limit ends the job for a restart (save_watch)."""

import threading
import time

import pytest

from tf_gba.training import recovery
from tf_gba.training import save_watch
from tf_gba.training.shared_input import DEFAULT_STALL_TIMEOUT_S


def _run(tmp_path):
  d = str(tmp_path)
  recovery.begin(d, "gba", 400, 0, target_if_new=100)
  return d


@pytest.mark.parametrize("stall, longest", [(20.0, None), (300.0, None), (20.0, 1.0),
                                            (20.0, 9.0), (2.0, 0.25)])
def test_the_limit_is_the_stall_limit_or_a_multiple_of_the_longest_save(stall, longest):
  # Independent reference: the first save may take the default limit (it traces its function);
  # later ones the stall limit, or 4 times the longest save where that is more.
  expected = max(stall, 120.0) if longest is None else max(stall, 4 * longest)
  assert save_watch.save_limit(stall, longest) == pytest.approx(expected)
  assert DEFAULT_STALL_TIMEOUT_S == 120.0


def test_a_save_held_past_the_limit_ends_the_job_in_one_line_for_a_restart(tmp_path, capsys):
  d = _run(tmp_path)
  recovery.record_save_seconds(d, 0.05)  # a save before: limit max(0.3, 4 x 0.05) = 0.3 s
  exited = threading.Event()
  codes = []

  def exit_now(code):
    codes.append(code)
    exited.set()

  began = time.time()
  with save_watch.watched(d, 0.3, exit_now=exit_now):
    assert exited.wait(10.0), "a held save was not ended"
  held = time.time() - began
  assert codes == [recovery.EXIT_RESTART]
  assert 0.3 <= held < 5.0
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("tf_gba: a checkpoint save has waited 0 s"), err
  assert "--stall_timeout_s" in err[0]
  assert recovery.read(d)["restart_causes"] == ["Stalled"]


def test_a_save_in_time_records_its_duration_and_exits_nothing(tmp_path, capsys):
  d = _run(tmp_path)
  codes = []
  with save_watch.watched(d, 0.5, exit_now=codes.append):
    time.sleep(0.2)
  time.sleep(0.6)  # past the limit: the watch of a save that ended does nothing
  assert codes == [] and capsys.readouterr().err == ""
  first = recovery.longest_save_seconds(d)
  assert 0.2 <= first < 0.5
  with save_watch.watched(d, 0.5, exit_now=codes.append):
    pass
  assert recovery.longest_save_seconds(d) == first  # the longest is kept
  # A slower save than 4x the longest but within --stall_timeout_s is no stall.
  with save_watch.watched(d, 5.0, exit_now=codes.append):
    time.sleep(4 * first + 0.2)
  assert codes == []


def test_the_longest_save_is_kept_over_resumptions_and_not_into_a_new_run(tmp_path):
  d = _run(tmp_path)
  assert recovery.longest_save_seconds(d) is None
  recovery.record_save_seconds(d, 3.0)
  recovery.report(d, 40)
  recovery.begin(d, "gba", 400, 20, target_if_new=120)  # resumed after a failure
  assert recovery.longest_save_seconds(d) == 3.0
  recovery.report(d, 100, finished=True)
  recovery.begin(d, "gba", 400, 100, target_if_new=200)  # a new run of the same command
  assert recovery.longest_save_seconds(d) is None


def test_the_chaos_drill_reads_the_line_as_the_restart_s_cause():
  from benchmarks import chaos  # pylint: disable=g-import-not-at-top
  prefix = chaos._SAVE_HELD  # pylint: disable=protected-access
  assert ("tf_gba: " + save_watch.stalled_message(20.0)).startswith(prefix)
