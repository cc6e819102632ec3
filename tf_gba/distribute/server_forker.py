"""Starts local servers (and collective workers) as forks of one process that has imported TF.

Why: importing TensorFlow (and loading tf_gba's op libraries) costs about 7 CPU-seconds on a
2-core machine, and almost nothing of a server's start-up is anything else. A binary run with 1 PS,
2 workers and 2 tf.data workers spent 35 of its 48 CPU-seconds importing TensorFlow in its five
servers, and a test module that starts ten clusters paid it forty times. The forker pays it once
per process that starts clusters: each server is then a fork of it (milliseconds), running the
same `tf_gba.distribute.server.main` a `python -m tf_gba.distribute.server` process runs. The
workers of `tf_gba.distribute.collective_cluster` (sync and DTS) start the same way.

Forking is safe here because the forker never creates a TensorFlow context, a server or a
thread of its own before it forks; each child starts its server after the fork, as a fresh
process would. The environment a child gets is applied before its server starts; only what
TensorFlow reads while it is imported (the log level, oneDNN, the Python path) must match the
forker's own, so clusters whose environments differ there get a forker each (`for_env`).
`TF_GBA_FORK_SERVERS=0` turns this off: every server is then a process of its own again.

A process that imports TensorFlow and tf_gba for itself (the training binary's job) need not pay
the import a second time: `prefork` makes a fork of it, before it runs any TensorFlow op, its
forker. The test runner forks its module processes from a forker too (tests/module_process.py),
with `run_atexit`: a test process ends as an interpreter does, its atexit handlers run.

A server keeps what the LocalCluster relies on: its own session (process group) when asked, its
log as stdout and stderr, its exit with its launcher (here the forker, which exits when the
process that started it goes), and a name that says which task it is (`/proc/<pid>/comm`:
"ps:0", "worker:1", "tfdata_worker:0"), since its command line is the forker's.

Protocol (one JSON object per line): the client writes {"op": "spawn", ...} or {"op": "poll",
"pid": N} to the forker's stdin; the forker answers {"pid": N} or {"returncode": N or null} on
its stdout.
"""

import atexit
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Dict, List, Optional

ENV_SWITCH = "TF_GBA_FORK_SERVERS"
# What TensorFlow and Python read while the forker imports them; a cluster whose environment
# differs in these needs a forker of its own. Not PYTHONPATH: a child puts its entries in front
# of sys.path itself (_run_child). Not the eager client's streaming switch, which
# ParameterServerStrategy sets in its process's environment when it connects: TensorFlow reads it
# on a process's first remote call, after the fork, from the environment the child is given; were
# it a key, every cluster a process started after its first strategy would cost a forker of its
# own (a new interpreter importing TensorFlow, about 6 CPU-seconds).
_IMPORT_TIME_PREFIXES = ("TF_CPP_", "TF_ENABLE_", "TF_USE_LEGACY_KERAS", "OMP_", "MKL_", "KMP_",
                         "PYTHON", "LD_")
_NOT_IMPORT_TIME = ("PYTHONPATH", "TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE")


def enabled() -> bool:
  return os.environ.get(ENV_SWITCH, "1") not in ("0", "false", "False", "")


# ---- the forker process ------------------------------------------------------------------------
def _name_process(name: str) -> None:
  """Sets /proc/self/comm (15 bytes at most), what `ps -o comm`, `top` and the tests read."""
  try:
    with open("/proc/self/comm", "w", encoding="utf-8") as f:
      f.write(name[:15])
  except OSError:
    pass  # not Linux, or no /proc: the name is only a convenience


def _redirect_stdio(log_path: Optional[str], stdout_path: Optional[str] = None) -> None:
  """stdin from /dev/null; stderr appended to `log_path` (None: kept); stdout appended to
  `stdout_path`, or (None) where stderr goes."""
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  os.close(null)
  for path, fd in ((log_path, 2), (stdout_path, 1)):
    if path:
      log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
      os.dup2(log, fd)
      os.close(log)
  if not stdout_path:
    os.dup2(2, 1)


def _run_child(request, protocol_fds) -> None:
  """In a forked child: becomes the server `request` describes; never returns."""
  code = 1
  try:
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
      signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])  # blocked by _serve's fork
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request.get("new_session"):
      os.setsid()
    for fd in protocol_fds:
      os.close(fd)
    _redirect_stdio(request["log"], request.get("stdout"))
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # The forker's sys.path is that of its own start. In front go what `python -m <module>`
    # started in `cwd` with this PYTHONPATH would have (the collective workers import their
    # target from `cwd`), so PYTHONPATH need not be part of a forker's key.
    front = [request["cwd"]] + [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep)
                                if p]
    for entry in reversed(front):
      if entry not in sys.path:
        sys.path.insert(0, entry)
    _name_process(request["name"])
    # The module whose main() the child runs, named by the client (the forker depends on none
    # of them: run_collective_cluster's workers import this module to be forked).
    code = importlib.import_module(request["module"]).main(request["argv"])
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 1
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
  finally:
    # A process of its own would run its atexit handlers now (a test process: its temporary
    # files); a server does not ask for them: it ends as its cluster is torn down.
    if request.get("run_atexit"):
      try:
        atexit._run_exitfuncs()  # pylint: disable=protected-access
      except BaseException:  # pylint: disable=broad-except
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except (OSError, ValueError):
        pass
    os._exit(int(code or 0))  # pylint: disable=protected-access


def _serve(proto_in: int, proto_out: int) -> None:
  statuses: Dict[int, int] = {}

  def reap(*_):
    while True:
      try:
        pid, status = os.waitpid(-1, os.WNOHANG)
      except ChildProcessError:
        return
      if pid == 0:
        return
      statuses[pid] = os.waitstatus_to_exitcode(status)

  signal.signal(signal.SIGCHLD, reap)
  parent = os.getppid()
  pending = b""
  while True:
    # The launcher's end of the pipe closes when it exits, and a read then returns b"". Polled
    # as well: a process it forked may still hold that end open.
    ready, _, _ = select.select([proto_in], [], [], 1.0)
    if os.getppid() != parent:
      return
    if not ready:
      continue
    chunk = os.read(proto_in, 65536)
    if not chunk:
      return
    pending += chunk
    while b"\n" in pending:
      line, pending = pending.split(b"\n", 1)
      request = json.loads(line)
      if request["op"] == "spawn":
        # A new child may get the pid of one reaped long ago (pids wrap: a test run forks tens
        # of thousands of processes): its status goes, but not one of the new child's, should it
        # end at once, so SIGCHLD waits until then.
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
        pid = os.fork()
        if pid == 0:
          _run_child(request, (proto_in, proto_out))
        statuses.pop(pid, None)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        reply = {"pid": pid}
      elif request["op"] == "poll":
        reap()
        reply = {"returncode": statuses.get(request["pid"])}
      else:
        reply = {"error": f"unknown op {request['op']!r}"}
      os.write(proto_out, json.dumps(reply).encode("utf-8") + b"\n")


def main() -> int:
  # The protocol moves off fds 0 and 1, which become /dev/null and the forker's log (stderr),
  # so nothing a child inherits there reaches the pipes.
  proto_in, proto_out = os.dup(0), os.dup(1)
  _redirect_stdio(None)
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops the servers, not Ctrl-C
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  _preload()
  os.write(proto_out, b'{"ready": true}\n')
  _serve(proto_in, proto_out)
  return 0


def _preload() -> None:
  """What every server needs imported and loaded: TensorFlow, tf_gba and its op libraries."""
  import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
  import tf_gba  # pylint: disable=g-import-not-at-top,unused-import
  from tf_gba.data import data_list  # pylint: disable=g-import-not-at-top,unused-import
  from tf_gba.distribute import server  # pylint: disable=g-import-not-at-top,unused-import
  from tf_gba.ops import loader  # pylint: disable=g-import-not-at-top
  loader.load_all()


def _become_forker(proto_in: int, proto_out: int, log_path: Optional[str]) -> None:
  """In a fork of a client process (`prefork`): becomes what `main` makes of a new process; never
  returns."""
  code = 1
  try:
    os.setsid()  # as the client starts a forker: its own session
    _name_process("server_forker")  # not the client's name (`ps`, the fault drills' process tree)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client stops the servers, not Ctrl-C
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
      signal.signal(sig, signal.SIG_DFL)  # not the client's handlers (the binary's interrupt)
    # Nothing of the client's open files: a server holding the client's stdout pipe open would
    # keep whoever reads it waiting past the client's exit.
    keep = sorted({proto_in, proto_out})
    low = 3
    for fd in keep + [os.sysconf("SC_OPEN_MAX")]:
      if fd >= low:
        os.closerange(low, fd)
        low = fd + 1
    _redirect_stdio(log_path)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # the client may have replaced them
    os.write(proto_out, b'{"ready": true}\n')
    _serve(proto_in, proto_out)
    code = 0
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
  finally:
    os._exit(code)  # pylint: disable=protected-access


# ---- the client (in the LocalCluster's process) ------------------------------------------------
class ForkedServer:
  """A server forked by the forker: what LocalCluster uses of a `subprocess.Popen`."""

  def __init__(self, forker: "Forker", pid: int):
    self._forker, self.pid, self.returncode = forker, pid, None

  def poll(self) -> Optional[int]:
    if self.returncode is None:
      self.returncode = self._forker.returncode(self.pid)
    return self.returncode

  def wait(self, timeout: Optional[float] = None) -> int:
    deadline = None if timeout is None else time.time() + timeout
    while self.poll() is None:
      if deadline is not None and time.time() > deadline:
        raise subprocess.TimeoutExpired(f"forked server {self.pid}", timeout)
      time.sleep(0.02)
    return self.returncode


class ForkedChild:
  """A child forked from this process: what its parent uses of a `subprocess.Popen` (pid,
  returncode, poll, wait, send_signal, kill)."""

  def __init__(self, pid: int):
    self.pid, self.returncode = pid, None

  def poll(self) -> Optional[int]:
    if self.returncode is None:
      try:
        pid, status = os.waitpid(self.pid, os.WNOHANG)
      except ChildProcessError:  # reaped elsewhere
        pid, status = self.pid, 0
      if pid:
        self.returncode = os.waitstatus_to_exitcode(status)
    return self.returncode

  def wait(self) -> int:
    while self.poll() is None:
      time.sleep(0.02)
    return self.returncode

  def send_signal(self, signum: int) -> None:
    if self.poll() is None:
      os.kill(self.pid, signum)

  def kill(self) -> None:
    try:
      os.kill(self.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


class _ForkedProcess(ForkedChild):
  """A forker forked from this process (`prefork`): what Forker uses of a `subprocess.Popen`."""

  def __init__(self, pid: int, stdin_fd: int, stdout_fd: int):
    super().__init__(pid)
    self.stdin = os.fdopen(stdin_fd, "wb")
    self.stdout = os.fdopen(stdout_fd, "rb")


class Forker:
  """One forker process; `spawn` starts a server as its fork."""

  def __init__(self, proc, log_path: Optional[str], start_timeout: float = 120.0):
    """`proc`: the forker's process (a `subprocess.Popen` of this module, or a _ForkedProcess),
    its stdin and stdout the protocol's pipes; waits for its "ready"."""
    self._lock = threading.Lock()
    self._log_path = log_path
    self._proc = proc
    self._reply(start_timeout)

  @classmethod
  def start(cls, env: Dict[str, str], log_path: str, start_timeout: float = 120.0) -> "Forker":
    """A new process `python -m tf_gba.distribute.server_forker` with environment `env`."""
    with open(log_path, "ab") as log:
      proc = subprocess.Popen(
          [sys.executable, "-m", "tf_gba.distribute.server_forker"], stdin=subprocess.PIPE,
          stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
    return cls(proc, log_path, start_timeout)

  def alive(self) -> bool:
    return self._proc.poll() is None

  def _reply(self, timeout: Optional[float] = None) -> dict:
    if timeout is not None:
      ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
      if not ready:
        self._proc.kill()
        raise TimeoutError(f"the server forker did not start in {timeout:.0f} s; its log: "
                           f"{self._log_path}")
    line = self._proc.stdout.readline()
    if not line:
      tail = "(this process's stderr)"
      if self._log_path:
        with open(self._log_path, "rb") as f:
          tail = f.read().decode("utf-8", "replace")[-4000:]
      raise RuntimeError(f"the server forker exited (code {self._proc.wait()}); its log:\n{tail}")
    return json.loads(line)

  def _ask(self, request: dict) -> dict:
    with self._lock:
      self._proc.stdin.write(json.dumps(request).encode("utf-8") + b"\n")
      self._proc.stdin.flush()
      return self._reply()

  def spawn(self, name: str, argv: List[str], log: str, env: Dict[str, str],
            new_session: bool = True, module: str = "tf_gba.distribute.server",
            cwd: Optional[str] = None, run_atexit: bool = False,
            stdout: Optional[str] = None) -> ForkedServer:
    """Forks a process running `<module>.main(argv)`, as `python -m <module> argv` would
    (`tf_gba.distribute.server`, or `tf_gba.distribute.collective_cluster` for its workers).
    `run_atexit`: the child runs its atexit handlers when main returns, as an interpreter does
    at exit (by default it ends at once, as a server should). Its stderr is appended to `log`,
    its stdout too unless `stdout` names a file of its own."""
    reply = self._ask({"op": "spawn", "name": name, "argv": argv, "log": log, "env": env,
                       "cwd": cwd or os.getcwd(), "new_session": new_session,
                       "module": module, "run_atexit": run_atexit, "stdout": stdout})
    return ForkedServer(self, reply["pid"])

  def returncode(self, pid: int) -> Optional[int]:
    try:
      return self._ask({"op": "poll", "pid": pid})["returncode"]
    except (OSError, RuntimeError, ValueError):
      # The forker is gone: its servers follow it (their parent watch); one still there counts
      # as running until it has.
      try:
        os.kill(pid, 0)
        return None
      except ProcessLookupError:
        return -signal.SIGKILL


def launch(name: str, module: str, argv: List[str], log: str, env: Dict[str, str],
           cwd: Optional[str] = None, append: bool = True, python: Optional[str] = None):
  """Starts `python -m <module> argv` in a session of its own, its stdout and stderr in `log`
  (appended to, or started afresh); returns its `subprocess.Popen` or `ForkedServer`.

  Forked from this process's forker for `env` (kept beside `log`), unless forking is turned off
  (`TF_GBA_FORK_SERVERS=0`) or another interpreter than this one is asked for.
  """
  mode = "ab" if append else "wb"
  if enabled() and python in (None, sys.executable):
    open(log, mode).close()  # there before the child writes it: readiness checks read it
    return for_env(env, os.path.dirname(log)).spawn(name, argv, log, env, module=module, cwd=cwd)
  with open(log, mode) as f:
    return subprocess.Popen([python or sys.executable, "-m", module, *argv], cwd=cwd, env=env,
                            stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)


_FORKERS: Dict[tuple, Forker] = {}
_FORKERS_LOCK = threading.Lock()
_KEY_LOCKS: Dict[tuple, threading.Lock] = {}  # one per environment: starting one forker (seconds)
                                              # does not hold up the clusters of another


def _forget_forkers() -> None:
  """In a forked child: the parent's forkers are not its own (their pipes are the parent's), and
  a lock the parent held at the fork (`prefork` forks holding its environment's) stays held."""
  global _FORKERS_LOCK
  _FORKERS.clear()
  _KEY_LOCKS.clear()
  _FORKERS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_forkers)


def _key(env: Dict[str, str]) -> tuple:
  return tuple(sorted((k, v) for k, v in env.items()
                      if k.startswith(_IMPORT_TIME_PREFIXES) and k not in _NOT_IMPORT_TIME))


def _key_lock(env: Dict[str, str]):
  key = _key(env)
  with _FORKERS_LOCK:
    return key, _KEY_LOCKS.setdefault(key, threading.Lock())


def for_env(env: Dict[str, str], log_dir: str) -> Forker:
  """The forker of this process for servers with environment `env` (started on first use; kept
  for the process's later clusters)."""
  key, key_lock = _key_lock(env)
  with key_lock:
    forker = _FORKERS.get(key)
    if forker is None or not forker.alive():
      forker = Forker.start(env, os.path.join(log_dir, "server_forker.log"))
      _FORKERS[key] = forker
    return forker


def _has_tf_context() -> bool:
  """Whether this process has run TensorFlow (its eager context exists, with its thread pools): a
  fork of it is no clean forker (a server forked from it can hang at start)."""
  if "tensorflow" not in sys.modules:
    return False
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  ctx = context.context_safe()
  return ctx is not None and getattr(ctx, "_context_handle", None) is not None


def imported_unused() -> bool:
  """Whether this process has imported TensorFlow and run none of it: a fork of it starts as a new
  interpreter would, less the import (the binary's supervisor forks its job when this holds)."""
  return "tensorflow" in sys.modules and not _has_tf_context()


def prefork(env: Dict[str, str], log_dir: Optional[str] = None) -> bool:
  """Makes a fork of this process, now, its forker for servers with environment `env`.

  For a process that imports TensorFlow and tf_gba for itself anyway (the training binary's job):
  its forker then costs a fork, not a TensorFlow import of its own (about 6 CPU-seconds, and as
  many seconds of a job's start on 2 cores). The fork must be as clean as a forker's own start:
  call this before the process runs a TensorFlow op or starts a server. Only the calling thread
  is carried into the fork. `log_dir`: where the forker's log goes (None: this process's stderr).
  Returns whether it forked: not when forking is off, when this process has run TensorFlow
  already (a test calling the binary's main in process), when a forker for `env` runs already, or
  when what TensorFlow reads at import differs between `env` and this process's environment
  (the servers then get a forker of their own, as without this call).
  """
  if not enabled() or _has_tf_context() or _key(env) != _key(dict(os.environ)):
    return False
  key, key_lock = _key_lock(env)
  with key_lock:
    forker = _FORKERS.get(key)
    if forker is not None and forker.alive():
      return False
    _preload()
    log_path = os.path.join(log_dir, "server_forker.log") if log_dir else None
    for stream in (sys.stdout, sys.stderr):  # or the fork writes what is buffered a second time
      stream.flush()
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    pid = os.fork()
    if pid == 0:
      _become_forker(request_r, reply_w, log_path)
    os.close(request_r)
    os.close(reply_w)
    _FORKERS[key] = Forker(_ForkedProcess(pid, request_w, reply_r), log_path)
    return True


if __name__ == "__main__":
  sys.exit(main())
