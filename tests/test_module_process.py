"""The test runner's turns between test runs on one machine (module_process._MachineQuiet).

Two instances stand for two `make test` runs: each opens the lock files itself, and flock(2)
locks on separate opens conflict as between processes.
"""

import os
import subprocess
import sys

import module_process
import pytest


@pytest.fixture
def machine(tmp_path, monkeypatch):
  """Lock files in a directory of the test's own, not the ones the running suite holds."""
  run_dir = tmp_path / "tf_gba_tests_1"
  run_dir.mkdir()
  monkeypatch.setenv("TF_GBA_TEST_RUN_TMPDIR", str(run_dir))
  runs = []
  yield lambda: runs.append(module_process._MachineQuiet.open()) or runs[-1]
  for run in runs:
    run.release()


def test_runs_without_an_alone_module_start_side_by_side(machine):
  a, b = machine(), machine()
  assert a.may_start(alone=False) and b.may_start(alone=False)
  assert a.may_start(alone=False)  # a second process of a run that already holds its share


def test_an_alone_module_waits_for_the_other_runs_processes_and_holds_back_new_ones(machine):
  a, b = machine(), machine()
  assert a.may_start(alone=False)
  assert not b.may_start(alone=True)   # a has a process running
  assert not a.may_start(alone=False)  # b waits at the gate: a starts nothing new
  a.release()                          # a's processes have ended
  assert b.may_start(alone=True)
  assert not a.may_start(alone=False)  # nor while b's alone module runs
  b.release()
  assert a.may_start(alone=False)


def test_two_alone_modules_take_turns(machine):
  a, b = machine(), machine()
  assert a.may_start(alone=True)
  assert not b.may_start(alone=True)
  a.release()
  assert b.may_start(alone=True)
  assert not a.may_start(alone=False)


def test_a_run_killed_with_its_turn_gives_it_back(machine):
  b = machine()
  holder = subprocess.Popen(
      [sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True,
      env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(__file__))))
  try:
    assert holder.stdout.readline().strip() == "held"
    assert not b.may_start(alone=False)
  finally:
    holder.kill()
    holder.wait()
  assert b.may_start(alone=True)  # the kernel dropped the dead run's locks


_HOLDER = """
import time, module_process
run = module_process._MachineQuiet.open()
assert run.may_start(alone=True)
print("held", flush=True)
time.sleep(60)
"""


def test_without_a_writable_temporary_directory_there_are_no_turns(tmp_path, monkeypatch):
  monkeypatch.setenv("TF_GBA_TEST_RUN_TMPDIR", str(tmp_path / "missing" / "tf_gba_tests_1"))
  a, b = module_process._MachineQuiet.open(), module_process._MachineQuiet.open()
  assert a.may_start(alone=True) and b.may_start(alone=True)
