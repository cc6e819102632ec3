"""Shared test setup: quiet TensorFlow logs, Keras 2, and paths to the shared real data."""

import os

# 3: not even TF's C++ ERROR lines. The tests start and stop many local clusters in one process;
# each time a cluster goes away TF logs a "Failed to remove function remotely ... Connection
# refused" block for every remote function it can no longer release, at any moment (garbage
# collection), past pytest's capture. What a test checks never depends on those lines; servers
# keep their own logs.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

# The run's temporary directory. Every process of a test run (the module processes, the binaries
# and servers the tests start) inherits it through TMPDIR, so what a process cannot remove itself
# stays there instead of in the system's temporary directory: the logs of a binary or a cluster a
# test kills on purpose, AutoGraph's generated sources, what TF's runtime prints at exit. The next
# run removes it. Under Bazel, which gives each test a TMPDIR of its own, nothing changes.
_RUN_TMP_ENV = "TF_GBA_TEST_RUN_TMPDIR"
_RUN_TMP_PREFIX = "tf_gba_tests_"


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _run_tmpdir() -> str:
  import shutil  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  path = os.environ.get(_RUN_TMP_ENV)
  if path is None and "TEST_TMPDIR" not in os.environ:  # a run's top-level pytest
    system_tmp = tempfile.gettempdir()
    for name in os.listdir(system_tmp):  # earlier runs' directories, not a run still going
      pid = name[len(_RUN_TMP_PREFIX):]
      if name.startswith(_RUN_TMP_PREFIX) and pid.isdigit() and not _pid_alive(int(pid)):
        shutil.rmtree(os.path.join(system_tmp, name), ignore_errors=True)
    path = os.path.join(system_tmp, f"{_RUN_TMP_PREFIX}{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    os.environ[_RUN_TMP_ENV] = path
  if path is not None:
    os.environ["TMPDIR"] = path
    tempfile.tempdir = path
  return path or tempfile.gettempdir()


_EXIT_LOG = os.path.join(_run_tmpdir(), "pytest_exit.log")


import tf_gba  # noqa: E402,F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)

# One process per test module (why: module_process.py's docstring).
try:
  from module_process import (  # noqa: E402,F401  pylint: disable=g-bad-import-order
      pytest_addoption, pytest_collection_modifyitems, pytest_configure,
      pytest_runtest_protocol, pytest_sessionfinish)
except ModuleNotFoundError:  # loaded as a plugin (`-p tests.conftest`), not as tests/' conftest
  from tests.module_process import (  # noqa: E402,F401  pylint: disable=g-bad-import-order
      pytest_addoption, pytest_collection_modifyitems, pytest_configure,
      pytest_runtest_protocol, pytest_sessionfinish)


def pytest_unconfigure(config):
  """After pytest's report: what TF's C++ runtime writes at exit goes to a file, not the terminal.

  At interpreter exit TF tries to release remote handles on the servers of the tests' local
  clusters, long gone by then, and logs a "Failed to register function remotely ... Connection
  refused" block for each on file descriptor 2, past pytest's capture. Nothing there is about the
  tests' results; the file (`pytest_exit.log` in the run's temporary directory, one for every
  process of the run) keeps it for whoever wants to look.
  """
  del config
  fd = os.open(_EXIT_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  os.dup2(fd, 2)
  os.close(fd)


# A test that hangs (a cluster waiting on a process that will not answer) would otherwise hold
# the whole run until CI's limit: past this many seconds the run stops with every thread's stack.
_TEST_TIME_LIMIT_S = int(os.environ.get("TF_GBA_TEST_TIME_LIMIT_S", "1200"))


def pytest_runtest_setup(item):
  del item
  import faulthandler  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  faulthandler.dump_traceback_later(_TEST_TIME_LIMIT_S, exit=True, file=sys.__stderr__)


def pytest_runtest_teardown(item):
  del item
  import faulthandler  # pylint: disable=g-import-not-at-top
  _drain_remote_releases()  # still under the test's watchdog, should a release never return
  faulthandler.cancel_dump_traceback_later()


def _drain_remote_releases():
  """Settles, between tests, what a test's stopped cluster leaves in this process's executor.

  A test's model and variables outlive its `with LocalCluster(...)` block until the test
  function returns; when they are collected, TF enqueues the release of their remote handles to
  servers already stopped, and the "Connection refused" that comes back is stored in the eager
  executor, to be raised by whatever op the *next* test runs first (seen as a plain tf.data test
  failing with UnavailableError for /job:ps). Collected and cleared here, the error stays with
  the test that caused it, which has already passed its checks.
  """
  import sys  # pylint: disable=g-import-not-at-top
  if "tensorflow" not in sys.modules:
    return
  import gc  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  gc.collect()
  executor = context.context().executor
  try:
    executor.wait()
  except tf.errors.OpError:
    executor.clear_error()
