"""Runs a repository script (the training binary) as a test's subprocess, forked from a process that
has imported TensorFlow and tf_gba.

Why: a test that runs `python examples/train.py ...` pays the interpreter's start and TensorFlow's
import (about 4 CPU-seconds) in the binary's process before it does anything else; a flag error
costs that, and the suite runs the binary well over a hundred times. Forked from the test
module's server forker (tf_gba.distribute.server_forker, made before any test ran an op), the
binary starts with those imports done and is otherwise the process a user starts: its own pid,
session, environment, working directory, stdin from /dev/null, stdout and stderr of its own, and
`sys.argv`, `sys.path` and `__main__` as `python <script> args` has them.

What a fork cannot show, tests leave to real interpreters: what a new process prints while it
imports TensorFlow (tests/e2e/test_quiet_output.py), and a process tree found by its command line
(the fault drills). `TF_GBA_FORK_SERVERS=0` turns forking off here too.
"""

import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Dict, Optional, Sequence

from tf_gba.distribute import server_forker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")


def main(argv) -> int:
  """In the forked child: runs the script `argv[0]` as `python argv[0] argv[1:]` would."""
  sys.argv = list(argv)
  sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # a script's own directory
  runpy.run_path(argv[0], run_name="__main__")
  return 0


def _command(script, args, env):
  env = dict(os.environ if env is None else env)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return [sys.executable, script, *args], env


def _spawn(script, args, env, cwd, stdout, stderr):
  """The forked child: `python <script> args` with its stdout and stderr appended to those
  paths, in a session of its own."""
  forker = server_forker.for_env(env, tempfile.gettempdir())
  return forker.spawn(os.path.basename(script)[:15], [script, *args], stderr, env,
                      module=__name__, cwd=cwd, run_atexit=True, stdout=stdout)


def run(args: Sequence[str], *, script: str = TRAIN, env: Optional[Dict[str, str]] = None,
        cwd: str = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
  """`python <script> args` to its end, as `subprocess.run(..., capture_output=True, text=True)`
  returns it; `env` (default: this process's) gets the repository in front of PYTHONPATH.
  Raises `subprocess.TimeoutExpired` (the process killed) after `timeout` seconds."""
  command, env = _command(script, args, env)
  if not server_forker.enabled():
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=cwd, check=False)
  with tempfile.TemporaryDirectory(prefix="tf_gba_script_") as tmp:
    out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    for path in (out, err):
      open(path, "w", encoding="utf-8").close()
    proc = _spawn(script, args, env, cwd, out, err)
    try:
      proc.wait(timeout)
    except subprocess.TimeoutExpired:
      _kill_session(proc.pid)
      proc.wait()
      raise subprocess.TimeoutExpired(command, timeout) from None
    with open(out, encoding="utf-8", errors="replace") as f:
      stdout = f.read()
    with open(err, encoding="utf-8", errors="replace") as f:
      stderr = f.read()
  return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _kill_session(pid: int) -> None:
  try:
    # Its process group, which its session started: the script and what stayed in the group
    # (the binary's job has a group of its own and follows its supervisor).
    os.killpg(pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


class Started:
  """A script `start` forked: what a test uses of a `subprocess.Popen` with `stdout=PIPE,
  stderr=PIPE, text=True` (pid, poll, wait, send_signal, and the two streams to read)."""

  def __init__(self, proc, tmp: str, stdout: str, stderr: str):
    self._proc, self._tmp, self.pid = proc, tmp, proc.pid
    # The child opens its stderr, then its stdout, for writing; a FIFO's open waits for its
    # reader, so both are opened here at once.
    opened = {}

    def open_for_reading(name, path):
      opened[name] = open(path, encoding="utf-8", errors="replace")

    threads = [threading.Thread(target=open_for_reading, args=item, daemon=True)
               for item in (("stdout", stdout), ("stderr", stderr))]
    for t in threads:
      t.start()
    for t in threads:
      t.join(120)
    if len(opened) != 2:
      _kill_session(self.pid)
      raise RuntimeError(f"a forked script did not open its stdout and stderr (pid {self.pid})")
    self.stdout, self.stderr = opened["stdout"], opened["stderr"]

  @property
  def returncode(self) -> Optional[int]:
    return self._proc.returncode

  def poll(self) -> Optional[int]:
    return self._proc.poll()

  def wait(self, timeout: Optional[float] = None) -> int:
    code = self._proc.wait(timeout)
    shutil.rmtree(self._tmp, ignore_errors=True)
    return code

  def send_signal(self, signum: int) -> None:
    if self._proc.poll() is None:
      os.kill(self.pid, signum)


def start(args: Sequence[str], *, script: str = TRAIN, env: Optional[Dict[str, str]] = None,
          cwd: str = ROOT):
  """`python <script> args` started, its stdout and stderr pipes to read as they come (as
  `subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True)`; that, unforked)."""
  command, env = _command(script, args, env)
  if not server_forker.enabled():
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd)
  tmp = tempfile.mkdtemp(prefix="tf_gba_script_")
  out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
  for path in (out, err):
    os.mkfifo(path)
  return Started(_spawn(script, args, env, cwd, out, err), tmp, out, err)
