"""BoundedCalls: a call that does not return by the deadline is left running, once per key."""

import threading
import time

import pytest

from tf_gba.common import bounded_calls


def test_a_call_in_time_returns_its_value_and_a_silent_one_is_not_started_again():
  calls = bounded_calls.BoundedCalls(deadline_s=0.2)
  release = threading.Event()
  started = []

  def silent():
    started.append(1)
    release.wait(10)
    return "late"

  t0 = time.monotonic()
  answers = calls.call_many({"fast": lambda: 7, "silent": silent})
  waited = time.monotonic() - t0
  assert answers == {"fast": (True, 7), "silent": (False, None)}
  assert 0.15 <= waited < 5.0  # waited for the deadline, not for the silent call
  assert calls.in_flight("silent") and not calls.in_flight("fast")
  # Asked again while the first is still running: no answer at once, and no second call.
  t0 = time.monotonic()
  assert calls.call("silent", silent) == (False, None)
  assert time.monotonic() - t0 < 0.15 and len(started) == 1
  release.set()
  for _ in range(100):
    if not calls.in_flight("silent"):
      break
    time.sleep(0.01)
  # Its late answer is dropped; the next read is a new call.
  assert calls.call("silent", lambda: "fresh") == (True, "fresh")


def test_an_error_raised_in_time_reaches_the_caller():
  calls = bounded_calls.BoundedCalls(deadline_s=1.0)

  def fails():
    raise KeyError("gone")

  with pytest.raises(KeyError, match="gone"):
    calls.call("k", fails)
  with pytest.raises(ValueError, match="positive"):
    bounded_calls.BoundedCalls(deadline_s=0)


def test_a_deadline_given_with_the_calls_replaces_the_default():
  calls = bounded_calls.BoundedCalls(deadline_s=30.0)
  release = threading.Event()
  t0 = time.monotonic()
  assert calls.call_many({"k": lambda: release.wait(10)}, deadline_s=0.1) == {"k": (False, None)}
  assert time.monotonic() - t0 < 5.0
  release.set()
