"""Every test module runs in its own Python process, as Bazel runs each test target.

Why: many modules start and stop local clusters in the test process. TensorFlow keeps one eager
context per process; each cluster re-points it at new servers, and what the old ones left (remote
handles released late, the executor's stored errors, the remote functions it can no longer
unregister) stays in it. After hundreds of tests and dozens of clusters in one process, that
history showed up as a test failing with another cluster's UnavailableError, and once as a
segmentation fault inside TF's copy of a closure's output. A module's own process starts from a
clean context; the DTS modules, which need their logical CPUs configured before TensorFlow
starts, get that for free.

The parent pytest collects as usual (so -k, -x, node ids and the progress line behave as users
expect), runs each module's selected tests in one child pytest and replays the child's reports as
its own, in collection order. A child is a fork of one process that has imported TensorFlow and
tf_gba already (`_forker`), not a new interpreter: each would otherwise spend ~6 CPU-seconds
importing them, over a hundred times a run. Up to --module-jobs children (TF_GBA_TEST_JOBS;
default: one more than the CPUs, at most 4) run at once: most cluster tests wait on sleeping
servers, so one child at a time left the CPUs idle most of a run. Children
start slowest module first (_KNOWN_SECONDS), so the run does not end waiting on one long module
started last; a module in _ALONE_MODULES runs before them all, with no other child beside it, and
no other test run's child either (_MachineQuiet: two `make test` runs on one machine take turns).
After a failure that stops the run (-x, --maxfail) no new child starts, and the running ones are
stopped. A child that dies (signal, watchdog) fails the tests it did not report,
with the end of its output. With -s the children run one at a time, so their outputs do not mix.
With one module selected, or with --in-one-process, everything runs here as usual.
"""

import argparse
import collections
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

_TAIL_CHARS = 6000
_JOBS_ENV = "TF_GBA_TEST_JOBS"
_MODULES = pytest.StashKey()    # parent: {module path: selected node ids}, in collection order
_REPORTS = pytest.StashKey()    # parent: {module path: {node id: [reports]}}, the current module
_SCHEDULER = pytest.StashKey()  # parent: the _Scheduler of the module processes
_OUTCOME = object()             # key of {node id: its process's (exit code, output tail)}

# Rough seconds of a module's process, for the order in which the children start: the slowest
# first. Only the order depends on them; a module missing here (a new one) counts as
# _DEFAULT_SECONDS. Measured in one run of 3 children on the shared 2-core machine (load average
# ~20, so ~5x a quiet machine's), where the fault drills alone took over 45 min; the training
# modules marked "est." did not finish in that run: estimated from their cluster runs.
_KNOWN_SECONDS = {
    "tests/e2e/test_fault_drills.py": 3000,
    "tests/e2e/test_quiet_output.py": 1500,
    "tests/e2e/test_switching_bench.py": 1250,
    "tests/training/test_train_binary.py": 1200,   # est.
    "tests/training/test_shadow_cluster.py": 900,  # est.
    "tests/training/test_auto_cluster.py": 600,    # est.
    "tests/e2e/test_e2e_cluster.py": 590,
    "tests/e2e/test_chaos_drill.py": 450,          # its own limit: 420 s (a hang)
    "tests/training/test_mode_registry.py": 500,   # est.
    "tests/ops/test_adaptive_revision_ops.py": 500,
    "tests/distribute/test_stragglers.py": 500,
    "tests/training/test_bad_input.py": 450,       # est.
    "tests/e2e/test_real_cluster_recipe.py": 430,
    "tests/training/test_resume_position.py": 400,  # est.
    "tests/training/test_checkpoints.py": 350,     # est.
    "tests/distribute/test_security.py": 320,
    "tests/data/test_data_criteo.py": 320,
    "tests/data/test_data_list.py": 310,
    "tests/training/test_pipelining.py": 300,      # est.
    "tests/training/test_zero_staleness.py": 300,  # est.
    "tests/training/test_resharding.py": 300,      # est.
    "tests/training/test_shard_position.py": 250,  # est.
    "tests/distribute/test_simulate.py": 210,
    "tests/data/test_models.py": 210,
    "tests/distribute/test_baselines_cluster.py": 200,
    "tests/distribute/test_shadow_runtime_handoff.py": 190,
    "tests/distribute/test_local_cluster.py": 190,
}
_DEFAULT_SECONDS = 150

# Modules whose tests run in several processes (at most the number given), in parallel like
# modules: each test waits minutes on a training binary's servers (the fault and preemption
# drills) or runs a training job of its own, and in one process they would run one after
# another, the run's longest chain. What drills share (an undisturbed reference run) is kept where
# every process finds it (tests/e2e/test_fault_drills.py: _undisturbed).
_SPLIT_MODULES = {
    "tests/e2e/test_fault_drills.py": 9,
    "tests/e2e/test_preemption.py": 3,
    "tests/training/test_train_binary.py": 4,
    "tests/training/test_shadow_cluster.py": 3,
    "tests/training/test_bad_input.py": 3,
    "tests/e2e/test_quiet_output.py": 2,
}

# Modules that run with no other child beside them, first (the machine is quiet then), and with no
# child of another test run on the machine beside them (_MachineQuiet). Their
# assertions are about asynchronous training's accuracy, which the CPU contention of three other
# children changes (presumably a worker stalled that long sends gradients stale enough to throw
# the model off course for a few steps). Measured with the TFRS example, asynchronously: the test
# RMSE after 160 steps was 1.06-1.08 in 6 of 6 quiet runs, but 1.13 in 1 of 4 beside three busy
# loops; there, evaluated every 20 or 40 steps, the predictions' mean was 0.5-1.1 stars off at 3
# of 96 evaluations from step 40 on and back on course at the next one, with AdaptiveRevision as
# with Adagrad. Beside another `make test` (its children not held back then) the asynchronous
# AdaptiveRevision run ended at 1.250 against the mean predictor's 1.131 in 1 of 4 such runs.
_ALONE_MODULES = {
    "tests/e2e/test_tfrs_example.py",
}


def pytest_addoption(parser):
  group = parser.getgroup("tf_gba")
  group.addoption("--in-one-process", action="store_true",
                  help="run every selected module in this process instead of one process each")
  group.addoption("--module-jobs", type=int, default=None, metavar="N",
                  help=f"module processes run at once (default: ${_JOBS_ENV}, else one more than "
                       "the CPUs, at most 4)")
  group.addoption("--tf-gba-child-only", default=None, help=argparse.SUPPRESS)
  group.addoption("--tf-gba-child-reports", default=None, help=argparse.SUPPRESS)


def _is_child(config):
  return config.getoption("--tf-gba-child-reports") is not None


def _jobs(config):
  if config.option.capture == "no":  # -s: the children write to the terminal, one at a time
    return 1
  jobs = config.getoption("--module-jobs")
  if jobs is None and os.environ.get(_JOBS_ENV):
    jobs = int(os.environ[_JOBS_ENV])
  if jobs is None:
    jobs = min((os.cpu_count() or 1) + 1, 4)
  if jobs < 1:
    raise pytest.UsageError(f"--module-jobs / {_JOBS_ENV} must be at least 1, got {jobs}")
  return jobs


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
  del session
  only = config.getoption("--tf-gba-child-only")
  if only is not None:
    with open(only, encoding="utf-8") as f:
      keep = set(json.load(f))
    selected = [item for item in items if item.nodeid in keep]
    deselected = [item for item in items if item.nodeid not in keep]
    if deselected:
      config.hook.pytest_deselected(items=deselected)
    items[:] = selected
    return
  by_module = collections.OrderedDict()
  for item in items:
    by_module.setdefault(_module_of(item), []).append(item.nodeid)
  config.stash[_MODULES] = by_module
  config.stash[_REPORTS] = {}


def _module_of(item):
  return str(item.path)


def _separate(config):
  if _is_child(config) or config.getoption("--in-one-process"):
    return False
  return len(config.stash.get(_MODULES, {})) > 1


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  config = item.config
  if not _separate(config):
    return None
  module = _module_of(item)
  reports = config.stash[_REPORTS]
  if module not in reports:
    if _SCHEDULER not in config.stash:
      config.stash[_SCHEDULER] = _Scheduler(config, item.session, config.stash[_MODULES])
    reports.clear()  # one module's reports at a time
    reports[module] = config.stash[_SCHEDULER].reports(module)
  item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
  replayed = list(reports[module].get(item.nodeid, []))
  if not any(report.when == "teardown" for report in replayed):  # the child died in this test
    replayed.append(_lost_report(item, reports[module], replayed))
  for report in replayed:
    item.ihook.pytest_runtest_logreport(report=report)
  item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
  return True


def pytest_sessionfinish(session):
  scheduler = session.config.stash.get(_SCHEDULER, None)
  if scheduler is not None:
    scheduler.stop()


class _ReportWriter:
  """In a child: every report goes to the parent's file as it is made (a crash keeps the ones
  before it)."""

  def __init__(self, config):
    self._config = config
    self._path = config.getoption("--tf-gba-child-reports")

  def pytest_runtest_logreport(self, report):
    data = self._config.hook.pytest_report_to_serializable(config=self._config, report=report)
    with open(self._path, "a", encoding="utf-8") as f:
      f.write(json.dumps(data) + "\n")


def pytest_configure(config):
  if _is_child(config):
    config.pluginmanager.register(_ReportWriter(config), "tf_gba_report_writer")
    # The servers of the module's local clusters (if it starts any) will be forks of a fork of
    # this process, which has imported TensorFlow already: made now, before any test runs an op
    # (tf_gba.distribute.server_forker.prefork). A module that starts none leaves it idle.
    from tf_gba.distribute import local_cluster  # pylint: disable=g-import-not-at-top
    local_cluster.prefork_forker(tempfile.gettempdir())


def _relative(config, module):
  return os.path.relpath(module, str(config.rootpath)).replace(os.sep, "/")


def _weight(config, module):
  return _KNOWN_SECONDS.get(_relative(config, module), _DEFAULT_SECONDS)


def _alone(config, module):
  return _relative(config, module) in _ALONE_MODULES


def _chunks(config, module, nodeids):
  """The node ids of `module`, as the groups that each run in one process."""
  parts = min(_SPLIT_MODULES.get(_relative(config, module), 1), len(nodeids))
  return [list(nodeids[i::parts]) for i in range(parts)]  # dealt in turn: long and short mixed


class _Scheduler:
  """Runs the modules' child processes, up to `jobs` at once, slowest first; hands their reports
  to the parent in whatever order it asks."""

  def __init__(self, config, session, modules):
    self._config = config
    self._session = session
    self._modules = modules
    self._jobs = _jobs(config)
    order = list(modules)
    # A job: (module, chunk number, node ids). A split module's tests share its weight: its
    # processes start together, early, as the whole module's one would.
    self._pending = [
        (m, i, chunk)
        for m in sorted(order, key=lambda m: (not _alone(config, m), -_weight(config, m),
                                              order.index(m)))
        for i, chunk in enumerate(_chunks(config, m, modules[m]))]
    self._left = collections.Counter(m for m, _, _ in self._pending)  # module: jobs not done
    self._running = {}  # (module, chunk): _Child
    self._done = {}     # module: {nodeid: [reports], _OUTCOME: (exit code, output tail)}
    self._seconds = collections.Counter()  # module: seconds its processes ran
    self._quiet = _MachineQuiet.open()

  def reports(self, module):
    """Waits for `module`'s processes (starting them and others as places free up); its
    reports."""
    while self._left[module]:
      self._reap()
      stopping = self._session.shouldfail or self._session.shouldstop
      while self._pending and len(self._running) < self._jobs and not stopping:
        alone = _alone(self._config, self._pending[0][0])
        if self._running and (self._alone_running() or alone):
          break
        if not self._quiet.may_start(alone):  # another run's alone module waits or runs
          break
        self._start(self._pending.pop(0))
      if stopping:  # after a stop (-x, --maxfail): the one module still wanted, alone
        for job in [job for job in self._pending if job[0] == module]:
          self._pending.remove(job)
          self._start(job)
      # Otherwise it waits for a free place like every other: starting it at once (because the
      # replay reached it) would run more processes than --module-jobs.
      if self._left[module]:
        time.sleep(0.05)
    return self._done.pop(module)

  def _alone_running(self):
    return any(_alone(self._config, module) for module, _ in self._running)

  def _start(self, job):
    module, chunk, nodeids = job
    self._running[(module, chunk)] = _Child(self._config, module, nodeids)

  def _reap(self):
    for (module, chunk), child in list(self._running.items()):
      if child.poll() is not None:
        del self._running[(module, chunk)]
        reports = child.collect()
        done = self._done.setdefault(module, {})
        outcome = reports.pop(_OUTCOME)
        done.update(reports)
        outcomes = done.setdefault(_OUTCOME, {})  # per test: the outcome of its own process
        for nodeid in child.nodeids:
          outcomes[nodeid] = outcome
        self._seconds[module] += child.seconds
        self._left[module] -= 1
    if not self._running:
      self._quiet.release()

  def stop(self):
    """Ends the children still running (a run stopped by -x or Ctrl-C) and keeps the modules'
    times in the run's temporary directory (module_seconds.json)."""
    for child in self._running.values():
      child.kill()
    self._running.clear()
    self._pending.clear()
    self._quiet.release()
    with open(os.path.join(tempfile.gettempdir(), "module_seconds.json"), "w",
              encoding="utf-8") as f:
      relative = {os.path.relpath(m, str(self._config.rootpath)): round(s, 1)
                  for m, s in sorted(self._seconds.items(), key=lambda kv: -kv[1])}
      json.dump(relative, f, indent=1)


class _MachineQuiet:
  """Turns between the test runs on one machine, for the modules that must run alone.

  A run holds a shared lock while any of its module processes runs; an alone module takes it
  exclusively, so it starts once no other run has a process running and no run starts one until it
  has finished. A gate in front (held by a run from the moment its alone module wants the lock)
  lets the other runs' running processes drain instead of handing the lock from one to the next.
  Both are flock(2) locks on files in the system's temporary directory, dropped by the kernel when
  a run's process ends however it ends. Without such a directory there are no turns.
  """

  def __init__(self, gate, lock):
    self._gate = gate
    self._lock = lock
    self._held = None          # None, fcntl.LOCK_SH or fcntl.LOCK_EX
    self._gate_held = False

  @classmethod
  def open(cls):
    run_dir = os.environ.get("TF_GBA_TEST_RUN_TMPDIR")  # conftest: <system tmp>/tf_gba_tests_<pid>
    directory = os.path.dirname(run_dir) if run_dir else tempfile.gettempdir()
    try:
      gate = open(os.path.join(directory, "tf_gba_tests.gate"), "a", encoding="utf-8")
      lock = open(os.path.join(directory, "tf_gba_tests.lock"), "a", encoding="utf-8")
    except OSError:
      return cls(None, None)
    return cls(gate, lock)

  @staticmethod
  def _try(f, operation):
    try:
      fcntl.flock(f, operation | fcntl.LOCK_NB)
    except BlockingIOError:
      return False
    return True

  def may_start(self, alone):
    """Whether a module process may start now (taking the lock it needs); never blocks."""
    if self._lock is None:
      return True
    if alone:
      if self._held == fcntl.LOCK_EX:
        return True
      if not self._gate_held:
        self._gate_held = self._try(self._gate, fcntl.LOCK_EX)
        if not self._gate_held:
          return False
      if not self._try(self._lock, fcntl.LOCK_EX):
        return False  # keeps the gate: the other runs start nothing new meanwhile
      self._held = fcntl.LOCK_EX
      return True
    if self._held == fcntl.LOCK_EX:
      return True
    if not self._try(self._gate, fcntl.LOCK_EX):  # another run's alone module waits or runs
      return False
    started = self._held == fcntl.LOCK_SH or self._try(self._lock, fcntl.LOCK_SH)
    fcntl.flock(self._gate, fcntl.LOCK_UN)
    if started:
      self._held = fcntl.LOCK_SH
    return started

  def release(self):
    """No module process of this run is running."""
    if self._held is not None:
      fcntl.flock(self._lock, fcntl.LOCK_UN)
      self._held = None
    if self._gate_held:
      fcntl.flock(self._gate, fcntl.LOCK_UN)
      self._gate_held = False


def _forker():
  """The process the children are forked from, or None (TF_GBA_FORK_SERVERS=0).

  It has imported TensorFlow and tf_gba and loaded the op libraries (about 6 CPU-seconds on
  this machine): every child would pay that again, over a hundred times a run. It is the local
  clusters' server forker (tf_gba.distribute.server_forker), for the same reason; a child forked
  from it starts as clean as a new interpreter would (no TensorFlow context, no server).
  """
  from tf_gba.distribute import server_forker  # pylint: disable=g-import-not-at-top
  if not server_forker.enabled():
    return None
  return server_forker.for_env(dict(os.environ), tempfile.gettempdir())


def _signal(proc, signum):
  try:
    os.kill(proc.pid, signum)
  except ProcessLookupError:
    pass


class _Child:
  """One module's selected tests in a child pytest."""

  def __init__(self, config, module, nodeids):
    self._config = config
    self.nodeids = list(nodeids)
    self._tmp = tempfile.mkdtemp(prefix="tf_gba_test_module_")
    only = os.path.join(self._tmp, "only.json")
    with open(only, "w", encoding="utf-8") as f:
      json.dump(nodeids, f)
    self._reports_path = os.path.join(self._tmp, "reports.jsonl")
    self._output_path = os.path.join(self._tmp, "output.txt")
    args = ["-q", "-p", "no:cacheprovider", f"--rootdir={config.rootpath}",
            f"--tf-gba-child-only={only}", f"--tf-gba-child-reports={self._reports_path}", module]
    shown = config.option.capture == "no"  # -s: the child's output goes to the terminal
    self._start = time.monotonic()
    self.seconds = None
    cwd = str(config.invocation_params.dir)
    forker = None if shown else _forker()
    if forker is not None:
      open(self._output_path, "w", encoding="utf-8").close()
      self._proc = forker.spawn("pytest", args, self._output_path, dict(os.environ),
                                module="pytest", cwd=cwd, run_atexit=True)
    else:
      with open(self._output_path, "w", encoding="utf-8") as out:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "pytest"] + args + (["-s"] if shown else []), cwd=cwd,
            stdout=None if shown else out, stderr=None if shown else subprocess.STDOUT,
            stdin=subprocess.DEVNULL)

  def poll(self):
    returncode = self._proc.poll()
    if returncode is not None and self.seconds is None:
      self.seconds = time.monotonic() - self._start
    return returncode

  def kill(self):
    """Stops the child (its servers exit with it); SIGTERM first, so it can stop its clusters."""
    if self._proc.poll() is None:
      _signal(self._proc, signal.SIGTERM)
      try:
        self._proc.wait(timeout=15)
      except subprocess.TimeoutExpired:
        _signal(self._proc, signal.SIGKILL)
        self._proc.wait()
    shutil.rmtree(self._tmp, ignore_errors=True)

  def collect(self):
    """The finished child's {nodeid: [reports]} and its outcome; removes its files."""
    config = self._config
    by_nodeid = collections.defaultdict(list)
    if os.path.exists(self._reports_path):
      with open(self._reports_path, encoding="utf-8") as f:
        for line in f:
          report = config.hook.pytest_report_from_serializable(config=config,
                                                               data=json.loads(line))
          by_nodeid[report.nodeid].append(report)
    with open(self._output_path, encoding="utf-8", errors="replace") as f:
      tail = f.read()[-_TAIL_CHARS:]
    shutil.rmtree(self._tmp, ignore_errors=True)
    by_nodeid = dict(by_nodeid)
    by_nodeid[_OUTCOME] = (self._proc.returncode, tail)
    return by_nodeid


def _lost_report(item, module_reports, replayed):
  """A failed report for a test its module's process did not finish (it died before or during)."""
  returncode, tail = module_reports[_OUTCOME][item.nodeid]
  when = "teardown" if any(report.when == "call" for report in replayed) else "call"
  return pytest.TestReport(
      nodeid=item.nodeid, location=item.location, keywords={}, outcome="failed",
      longrepr=(f"the module's test process ended (exit code {returncode}) before this test "
                f"finished; the end of its output:\n{tail}"),
      when=when, sections=[], duration=0.0)
