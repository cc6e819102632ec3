"""The processes of a running training binary, found from /proc: by parent, by role, by port.

Shared by the fault drills (tests/e2e/test_fault_drills.py) and the chaos drill
(benchmarks/chaos.py). A local cluster's server carries its task as its process name ("ps:0",
"worker:1", "tfdata_worker:0", tf_gba.distribute.server_forker), or, started as
`python -m tf_gba.distribute.server` (TF_GBA_FORK_SERVERS=0), in its arguments. Linux only.
"""

import os
import re
from typing import List, Optional


def children(pid: int) -> List[int]:
  out = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
      continue
    if ppid == pid:
      out.append(int(entry))
  return out


def descendants(pid: int) -> List[int]:
  found, todo = [], [pid]
  while todo:
    for child in children(todo.pop()):
      found.append(child)
      todo.append(child)
  return found


def cmdline(pid: int) -> str:
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return f.read().replace(b"\0", b" ").decode()
  except OSError:
    return ""


def comm(pid: int) -> str:
  try:
    with open(f"/proc/{pid}/comm") as f:
      return f.read().strip()
  except OSError:
    return ""


def task(pid: int) -> Optional[str]:
  """The task a local cluster's server process serves ("ps:0", "tfdata_worker:1",
  "tfdata_dispatcher:0"), else None. A server started as `python -m tf_gba.distribute.server`
  names its tf.data worker "tfdata_worker:?" (they are numbered by port), and its dispatcher
  "tfdata_dispatcher:?"."""
  name = comm(pid)
  if re.fullmatch(r"(ps|worker|tfdata_worker):\d+", name):
    return name
  if name == "tfdata_dispatch":
    return "tfdata_dispatcher:0"  # the local cluster's one dispatcher, cut to /proc's 15 bytes
  cmd = cmdline(pid).split()
  if "tf_gba.distribute.server" not in cmd or "--job_name" not in cmd:
    return None
  job = cmd[cmd.index("--job_name") + 1]
  if job in ("tfdata_worker", "tfdata_dispatcher"):
    return f"{job}:?"
  return f"{job}:{cmd[cmd.index('--task_index') + 1]}" if "--task_index" in cmd else None


def servers(root_pid: int) -> dict:
  """{task: pid} of the servers below `root_pid`."""
  out = {}
  for pid in descendants(root_pid):
    name = task(pid)
    if name is not None and alive(pid):
      out[name] = pid
  return out


def job_process(root_pid: int) -> Optional[int]:
  """The job a binary's supervisor runs: the train.py process below it (run, or forked)."""
  for pid in descendants(root_pid):
    if "examples/train.py" in cmdline(pid) or comm(pid) == "train.py":
      return pid
  return None


def alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def listening_ports(pid: int) -> List[int]:
  """The TCP ports `pid` listens on, in its network namespace: its sockets' inodes matched
  against the namespace's tables of listening sockets (/proc/<pid>/net/tcp, tcp6)."""
  return _local_ports(pid, listening_only=True)


def local_ports(pid: int) -> List[int]:
  """The local TCP ports of every socket of `pid`: those it listens on and those of the
  connections it opened (a client's ephemeral ports)."""
  return _local_ports(pid, listening_only=False)


def _local_ports(pid: int, listening_only: bool) -> List[int]:
  inodes = set()
  try:
    for fd in os.listdir(f"/proc/{pid}/fd"):
      try:
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
      except OSError:
        continue
      if link.startswith("socket:["):
        inodes.add(link[8:-1])
  except OSError:
    return []
  ports = set()
  for table in ("tcp", "tcp6"):
    try:
      with open(f"/proc/{pid}/net/{table}") as f:
        next(f)
        for line in f:
          fields = line.split()
          if (fields[3] == "0A" or not listening_only) and fields[9] in inodes:  # 0A: LISTEN
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    except (OSError, StopIteration):
      continue
  return sorted(ports)
