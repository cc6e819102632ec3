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
its own. A child that dies (signal, watchdog) fails the tests it did not report, with the end of
its output. With one module selected, or with --in-one-process, everything runs here as usual.
"""

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile

import pytest

_TAIL_CHARS = 6000
_MODULES = pytest.StashKey()  # parent: {module path: selected node ids}, in collection order
_REPORTS = pytest.StashKey()  # parent: {module path: {node id: [reports]}}, the current module
_OUTCOME = object()           # key of a module's (exit code, output tail) among its reports


def pytest_addoption(parser):
  group = parser.getgroup("tf_gba")
  group.addoption("--in-one-process", action="store_true",
                  help="run every selected module in this process instead of one process each")
  group.addoption("--tf-gba-child-only", default=None, help=argparse.SUPPRESS)
  group.addoption("--tf-gba-child-reports", default=None, help=argparse.SUPPRESS)


def _is_child(config):
  return config.getoption("--tf-gba-child-reports") is not None


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
    reports.clear()  # one module's reports at a time
    reports[module] = _run_module(config, module, config.stash[_MODULES][module])
  item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
  replayed = list(reports[module].get(item.nodeid, []))
  if not any(report.when == "teardown" for report in replayed):  # the child died in this test
    replayed.append(_lost_report(item, reports[module], replayed))
  for report in replayed:
    item.ihook.pytest_runtest_logreport(report=report)
  item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
  return True


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


def _run_module(config, module, nodeids):
  """Runs `nodeids` of `module` in a child pytest; returns {nodeid: [reports]} and its output."""
  with tempfile.TemporaryDirectory(prefix="tf_gba_test_module_") as tmp:
    only = os.path.join(tmp, "only.json")
    with open(only, "w", encoding="utf-8") as f:
      json.dump(nodeids, f)
    reports_path = os.path.join(tmp, "reports.jsonl")
    output_path = os.path.join(tmp, "output.txt")
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            f"--rootdir={config.rootpath}", f"--tf-gba-child-only={only}",
            f"--tf-gba-child-reports={reports_path}", module]
    shown = config.option.capture == "no"  # -s: the child's output goes to the terminal
    with open(output_path, "w", encoding="utf-8") as out:
      returncode = subprocess.run(
          args + (["-s"] if shown else []), cwd=str(config.invocation_params.dir),
          stdout=None if shown else out, stderr=None if shown else subprocess.STDOUT,
          check=False).returncode
    by_nodeid = collections.defaultdict(list)
    if os.path.exists(reports_path):
      with open(reports_path, encoding="utf-8") as f:
        for line in f:
          report = config.hook.pytest_report_from_serializable(config=config,
                                                               data=json.loads(line))
          by_nodeid[report.nodeid].append(report)
    with open(output_path, encoding="utf-8", errors="replace") as f:
      tail = f.read()[-_TAIL_CHARS:]
  by_nodeid = dict(by_nodeid)
  by_nodeid[_OUTCOME] = (returncode, tail)
  return by_nodeid


def _lost_report(item, module_reports, replayed):
  """A failed report for a test its module's process did not finish (it died before or during)."""
  returncode, tail = module_reports[_OUTCOME]
  when = "teardown" if any(report.when == "call" for report in replayed) else "call"
  return pytest.TestReport(
      nodeid=item.nodeid, location=item.location, keywords={}, outcome="failed",
      longrepr=(f"the module's test process ended (exit code {returncode}) before this test "
                f"finished; the end of its output:\n{tail}"),
      when=when, sections=[], duration=0.0)
