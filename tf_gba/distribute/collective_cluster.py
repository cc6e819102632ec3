"""Runs a function on N localhost worker processes set up for MultiWorkerMirroredStrategy.

`run_collective_cluster("pkg.module:function", num_workers=2, kwargs={...})` picks free ports on
127.0.0.1, starts one process per worker with its `TF_CONFIG`
(`{"cluster": {"worker": [...]}, "task": {"type": "worker", "index": i}}`), calls
`function(**kwargs)` in each (the function creates `tf.distribute.MultiWorkerMirroredStrategy()`
itself, which reads `TF_CONFIG`), and returns the JSON-serialisable return values, ordered by
worker index. The processes are always ended: on success, on a worker failure (a failed worker
leaves its peers stuck in a collective, so the others are killed at once), on timeout and on
Ctrl-C. Each worker runs in its own process group, which is killed as a whole, and exits by
itself if the launching process goes away without cleaning up (e.g. killed with SIGKILL).

The target is `module:function` or `path/to/file.py:function`. Command line (prints the results):

  python -m tf_gba.distribute.collective_cluster --target=pkg.mod:fn --num_workers=2 \
      --kwargs_json='{"steps": 10}'
"""

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Dict, List, Optional

from tf_gba.common import exiting
from tf_gba.distribute.local_cluster import PORT_TAKEN
from tf_gba.distribute.local_cluster import START_ATTEMPTS
from tf_gba.distribute.local_cluster import free_ports
from tf_gba.distribute import server_forker
from tf_gba.distribute.server import _watch_parent  # pylint: disable=protected-access

_LOG_TAIL_CHARS = 4000


class ClusterError(RuntimeError):
  """A worker failed, or the cluster did not finish in time. `pids`: the workers' process ids;
  `exit_codes`: {index: exit code} of the workers that failed (negative: killed by that signal);
  `log_tails`: {index: the end of its log} for them."""

  def __init__(self, message: str, pids: Optional[List[int]] = None,
               exit_codes: Optional[Dict[int, int]] = None,
               log_tails: Optional[Dict[int, str]] = None):
    super().__init__(message)
    self.pids = list(pids or [])
    self.exit_codes = dict(exit_codes or {})
    self.log_tails = dict(log_tails or {})


def tf_config(addresses: List[str], index: int, task_type: str = "worker") -> Dict:
  return {"cluster": {"worker": list(addresses)}, "task": {"type": task_type, "index": index}}


def _load_target(target: str):
  module_name, sep, function_name = target.rpartition(":")
  if not sep or not module_name or not function_name:
    raise ValueError(f"target must be 'module:function' or 'file.py:function', got {target!r}")
  if module_name.endswith(".py"):
    spec = importlib.util.spec_from_file_location("_cluster_target", module_name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  else:
    module = importlib.import_module(module_name)
  return getattr(module, function_name)


def _kill_group(proc: subprocess.Popen, sig: int):
  try:
    os.killpg(proc.pid, sig)  # The worker is its group's leader (start_new_session).
  except (ProcessLookupError, PermissionError):
    pass


def _end_all(procs: List[subprocess.Popen], grace_s: float = 5.0):
  """Terminates, then kills, the process group of each worker that is still running."""
  running = [proc for proc in procs if proc.poll() is None]
  for proc in running:
    _kill_group(proc, signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  for proc in running:
    with contextlib.suppress(subprocess.TimeoutExpired):
      proc.wait(max(0.0, deadline - time.monotonic()))
  for proc in running:
    if proc.poll() is not None:
      continue
    _kill_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
      proc.wait(grace_s)


def _tail(path: str) -> str:
  try:
    with open(path, "r", errors="replace") as f:
      return f.read()[-_LOG_TAIL_CHARS:]
  except OSError:
    return "<no log>"


def _wait_all(procs, deadline: float, timeout_s: float):
  """Until every worker has exited with 0, one has failed, or the deadline: (None, []) on
  success, else (what went wrong, the indices of the failed workers)."""
  while True:
    codes = [proc.poll() for proc in procs]
    failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
    if failed:
      return f"worker(s) {failed} exited with {[codes[i] for i in failed]}", failed
    if all(code == 0 for code in codes):
      return None, []
    if time.monotonic() > deadline:
      return f"cluster did not finish within {timeout_s} s", []
    time.sleep(0.1)


def run_collective_cluster(target: str, num_workers: int = 2,
                           kwargs: Optional[Dict[str, Any]] = None, timeout_s: float = 300.0,
                           env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
                           python: Optional[str] = None,
                           log_dir: Optional[str] = None) -> List[Any]:
  """Runs `target(**kwargs)` on `num_workers` localhost workers; returns their results.

  Args:
    target: "module:function" or "path/to/file.py:function"; must be importable from `cwd`.
    num_workers: number of worker processes.
    kwargs: JSON-serialisable keyword arguments, the same for every worker (a worker can read its
      index from TF_CONFIG or from the strategy's cluster resolver).
    timeout_s: wall-clock limit for the whole cluster.
    env: extra environment variables for the workers.
    cwd: working directory of the workers (default: the current one); it is put on PYTHONPATH.
    python: interpreter (default: this one).
    log_dir: where each worker's output goes (`worker_<i>.log`); default a temporary directory,
      removed after a success.

  Returns:
    The return values, index i from worker i.

  Raises:
    ClusterError: a worker exited with an error or the cluster ran past `timeout_s`; the message
      holds the tail of each worker's log.
  """
  if num_workers < 1:
    raise ValueError(f"num_workers must be >= 1, got {num_workers}")
  cwd = os.path.abspath(cwd or os.getcwd())
  own_log_dir = log_dir is None
  log_dir = log_dir or tempfile.mkdtemp(prefix="tf_gba_cluster_")
  os.makedirs(log_dir, exist_ok=True)
  base_env = dict(os.environ)
  base_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  base_env["PYTHONPATH"] = os.pathsep.join(
      [cwd] + ([base_env["PYTHONPATH"]] if base_env.get("PYTHONPATH") else []))
  base_env.update(env or {})
  kwargs_json = json.dumps(kwargs or {})
  procs: List = []  # subprocess.Popen or server_forker.ForkedServer
  logs = [os.path.join(log_dir, f"worker_{index}.log") for index in range(num_workers)]
  results_files = [os.path.join(log_dir, f"worker_{index}.json") for index in range(num_workers)]
  try:
    deadline = time.monotonic() + timeout_s
    for attempt in range(1, START_ATTEMPTS + 1):
      # A port chosen free stays unbound until its worker's server starts; another process can
      # take it in between. A worker that could not listen has run nothing of the target's
      # training (its strategy is made first), nor have its peers, which wait for it: all start
      # again, on new ports.
      addresses = [f"127.0.0.1:{port}" for port in free_ports(num_workers)]
      procs = []
      for index in range(num_workers):
        worker_env = dict(base_env, TF_CONFIG=json.dumps(tf_config(addresses, index)))
        with contextlib.suppress(FileNotFoundError):
          os.remove(results_files[index])
        procs.append(server_forker.launch(
            f"worker:{index}", "tf_gba.distribute.collective_cluster",
            [f"--target={target}", f"--kwargs_json={kwargs_json}",
             f"--result_file={results_files[index]}"],
            logs[index], worker_env, cwd=cwd, append=False, python=python))
      failure, failed = _wait_all(procs, deadline, timeout_s)
      if failure is not None and attempt < START_ATTEMPTS and any(
          PORT_TAKEN in _tail(logs[i]) for i in failed):
        _end_all(procs)
        continue
      break
    if failure is not None:
      _end_all(procs)
      tails = "\n".join(f"--- worker {i} ({path}) ---\n{_tail(path)}"
                        for i, path in enumerate(logs))
      raise ClusterError(f"{failure}; logs kept in {log_dir}\n{tails}",
                         pids=[proc.pid for proc in procs],
                         exit_codes={i: procs[i].poll() for i in failed},
                         log_tails={i: _tail(logs[i]) for i in failed})
    results = []
    for path in results_files:
      with open(path) as f:
        results.append(json.load(f)["result"])
    if own_log_dir:
      for path in logs + results_files:
        with contextlib.suppress(OSError):
          os.remove(path)
      with contextlib.suppress(OSError):
        os.rmdir(log_dir)
    return results
  finally:
    _end_all(procs)


def _worker_main(args) -> int:
  threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
  try:
    result = _load_target(args.target)(**json.loads(args.kwargs_json))
    payload = {"result": result}
    code = 0
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    payload = {"error": traceback.format_exc()}
    code = 1
  tmp = args.result_file + ".tmp"
  with open(tmp, "w") as f:
    json.dump(payload, f)
  os.replace(tmp, args.result_file)
  # Without interpreter teardown, where TF's collective/gRPC threads can hang the exit.
  exiting.exit_now(code)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target", required=True, help="module:function or file.py:function")
  parser.add_argument("--num_workers", type=int, default=2)
  parser.add_argument("--kwargs_json", default="{}")
  parser.add_argument("--timeout_s", type=float, default=300.0)
  parser.add_argument("--result_file", default=None,
                      help="internal: set for a worker process, which writes its result here")
  args = parser.parse_args(argv)
  if args.result_file:
    return _worker_main(args)
  results = run_collective_cluster(args.target, args.num_workers, json.loads(args.kwargs_json),
                                   timeout_s=args.timeout_s)
  print(json.dumps(results, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
