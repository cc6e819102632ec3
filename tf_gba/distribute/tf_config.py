"""TF_CONFIG read and checked before anything starts, and a chief's wait for its servers.

TensorFlow reads TF_CONFIG where a strategy or server is created and fails there with a traceback
(`json.decoder.JSONDecodeError`, "Task 5 was not defined in job worker"), or waits in silence for
servers that are not up. `parse` checks it first and raises `TFConfigError`, one line naming the
field at fault; `wait_for_servers` tells who the chief is waiting for, every few seconds, and gives
up after a time limit.

Imports nothing beyond the standard library (the binary reads it before TensorFlow is loaded).

Example:

  cfg = tf_config.parse(os.environ["TF_CONFIG"])    # raises TFConfigError
  cfg.task_type, cfg.task_index, cfg.count("worker")
  tf_config.wait_for_servers(cfg.addresses(("ps", "worker")), timeout_s=600, log=print)
"""

import dataclasses
import json
import socket
import time
from typing import Callable, Dict, List, Sequence, Tuple

# Task types the training binary runs: the chief coordinates, ps and worker serve.
TASK_TYPES = ("chief", "ps", "worker")
# Seconds between the chief's lines while it waits for its servers.
WAIT_LINE_EVERY_S = 5.0


class TFConfigError(ValueError):
  """A malformed or inconsistent TF_CONFIG; the message names the field."""


class ServersUnreachable(RuntimeError):
  """The cluster's servers did not all answer within the time limit."""


@dataclasses.dataclass(frozen=True)
class TFConfig:
  cluster: Dict[str, List[str]]
  task_type: str
  task_index: int

  def count(self, job: str) -> int:
    return len(self.cluster.get(job, []))

  def addresses(self, jobs: Sequence[str]) -> List[Tuple[str, str]]:
    """(task name "job:index", "host:port") of every task of `jobs`."""
    return [(f"{job}:{i}", address) for job in jobs
            for i, address in enumerate(self.cluster.get(job, []))]


def _check_address(field: str, address) -> None:
  if not isinstance(address, str):
    raise TFConfigError(f"TF_CONFIG {field} must be a \"host:port\" string, got {address!r}.")
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise TFConfigError(f"TF_CONFIG {field} must be \"host:port\" with a port in 1-65535, got "
                        f"{address!r}.")


def parse(text: str) -> TFConfig:
  """TF_CONFIG's cluster and task, checked as the training binary needs them.

  Raises:
    TFConfigError: one line naming the field at fault.
  """
  try:
    value = json.loads(text)
  except ValueError as e:
    raise TFConfigError(
        f"TF_CONFIG is not valid JSON ({e}); expected "
        "{\"cluster\": {...}, \"task\": {\"type\": ..., \"index\": ...}}.") from None
  if not isinstance(value, dict):
    raise TFConfigError(f"TF_CONFIG must be a JSON object with \"cluster\" and \"task\", got "
                        f"{type(value).__name__}.")
  cluster = value.get("cluster")
  if not isinstance(cluster, dict) or not cluster:
    raise TFConfigError("TF_CONFIG \"cluster\" is missing or empty: give an object mapping "
                        "each job (chief, ps, worker) to its list of \"host:port\".")
  seen = {}
  for job, tasks in cluster.items():
    if isinstance(tasks, dict):  # TF also takes {index: address}
      if not all(str(k).isdigit() for k in tasks):
        raise TFConfigError(f"TF_CONFIG cluster.{job} must list addresses, got keys "
                            f"{sorted(tasks)}.")
      tasks = [tasks[k] for k in sorted(tasks, key=int)]
    if not isinstance(tasks, list) or not tasks:
      raise TFConfigError(f"TF_CONFIG cluster.{job} must be a non-empty list of \"host:port\", "
                          f"got {tasks!r}.")
    for i, address in enumerate(tasks):
      _check_address(f"cluster.{job}[{i}]", address)
      if address in seen:
        raise TFConfigError(f"TF_CONFIG cluster.{job}[{i}] is {address}, the address of "
                            f"{seen[address]} too: give each task its own port.")
      seen[address] = f"{job}[{i}]"
    cluster[job] = list(tasks)
  task = value.get("task")
  if not isinstance(task, dict):
    raise TFConfigError("TF_CONFIG \"task\" is missing: give this process's "
                        "{\"type\": \"chief\"|\"ps\"|\"worker\", \"index\": N}.")
  task_type = task.get("type")
  if task_type not in TASK_TYPES:
    raise TFConfigError(f"TF_CONFIG task.type must be one of {', '.join(TASK_TYPES)}, got "
                        f"{task_type!r}.")
  if task_type not in cluster:
    raise TFConfigError(f"TF_CONFIG task.type is {task_type!r}, a job that cluster does not "
                        f"list (it lists {', '.join(cluster)}).")
  index = task.get("index", 0)
  if isinstance(index, str) and index.isdigit():
    index = int(index)
  if isinstance(index, bool) or not isinstance(index, int) or index < 0:
    raise TFConfigError(f"TF_CONFIG task.index must be an integer >= 0, got {index!r}.")
  if index >= len(cluster[task_type]):
    raise TFConfigError(f"TF_CONFIG task.index is {index}, but cluster.{task_type} lists "
                        f"{len(cluster[task_type])} task(s) (indices 0 to "
                        f"{len(cluster[task_type]) - 1}).")
  if task_type == "chief" and len(cluster["chief"]) != 1:
    raise TFConfigError(f"TF_CONFIG cluster.chief must list one task, got "
                        f"{len(cluster['chief'])}.")
  return TFConfig(cluster, task_type, index)


def check_for_parameter_servers(cfg: TFConfig) -> None:
  """The chief of a parameter-server job needs at least one ps and one worker task."""
  for job in ("ps", "worker"):
    if not cfg.count(job):
      raise TFConfigError(f"TF_CONFIG cluster.{job} is missing: a parameter-server job needs "
                          f"at least one {job} task.")


def _reachable(address: str, timeout_s: float) -> bool:
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
      return True
  except OSError:
    return False


def wait_for_servers(tasks: Sequence[Tuple[str, str]], timeout_s: float,
                     log: Callable[[str], None], flag: str = "--cluster_wait_s") -> float:
  """Returns once every (name, "host:port") in `tasks` accepts a connection; says which are
  awaited every WAIT_LINE_EVERY_S seconds; returns the seconds waited.

  Raises:
    ServersUnreachable: some did not answer within `timeout_s` (its message names them).
  """
  start = time.monotonic()
  next_line = start + WAIT_LINE_EVERY_S
  waiting = list(tasks)
  while True:
    waiting = [(name, address) for name, address in waiting if not _reachable(address, 1.0)]
    now = time.monotonic()
    if not waiting:
      return now - start
    names = ", ".join(f"{name} at {address}" for name, address in waiting)
    if now - start >= timeout_s:
      raise ServersUnreachable(
          f"gave up after {timeout_s:g} s ({flag}) waiting for {names}: start those tasks (or "
          "fix their addresses in TF_CONFIG), then rerun.")
    if now >= next_line:
      log(f"tf_gba: waiting for {names} ({now - start:.0f} s of {flag}={timeout_s:g})")
      next_line = now + WAIT_LINE_EVERY_S
    time.sleep(min(0.5, max(0.0, timeout_s - (now - start))))
