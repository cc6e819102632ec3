"""CPU-seconds of a process tree by role, read from /proc while it runs.

`ProcessTreeCpu(root_pid)` samples, every `interval` seconds, the user + system time of every
process descended from `root_pid` (`/proc/<pid>/stat`, fields 14 and 15), and keeps each process's
last reading: a process's CPU counts up to the last sample before it exited, so a sample
interval well below a run's length loses a negligible share. Processes are grouped into roles by
the name the local cluster gives its servers (`/proc/<pid>/comm`: "ps:0", "worker:1",
"tfdata_worker:0", see tf_gba.distribute.server_forker) and the coordinator's script name.

Linux only. The list of a process's descendants is taken from the whole of /proc once a second;
between those walks only the processes already known are read, so the sampler itself costs
about 1 % of one core.
"""

import collections
import os
import threading
import time
from typing import Dict, Optional

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def role_of(name: str, root_name: str) -> str:
  """The role of a process from its /proc name: "coordinator" (the root's name: the binary runs
  its job in a child of the process started, `tf_gba.common.exiting`), "ps", "worker",
  "tfdata_worker", "tfdata_dispatcher", or "other" (the server forker, helper processes)."""
  if name == root_name:
    return "coordinator"
  if name.startswith("tfdata_dispatch"):
    return "tfdata_dispatcher"  # "tfdata_dispatcher:0", cut to /proc's 15 bytes
  task = name.partition(":")[0]
  if task in ("ps", "worker", "tfdata_worker", "chief", "evaluator"):
    return task
  return "other"


def _stat(pid: int):
  """(name, ppid, CPU seconds) of `pid`, or None once it has gone."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      text = f.read().decode("utf-8", "replace")
  except OSError:
    return None
  # The name is in parentheses and may itself hold spaces or parentheses.
  name = text[text.index("(") + 1:text.rindex(")")]
  fields = text[text.rindex(")") + 2:].split()
  return name, int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


class ProcessTreeCpu:
  """Samples a process tree's CPU by process until `stop()` (or the `with` block's end).

  Args:
    root_pid: the tree's root (its own CPU counts as the coordinator's).
    interval: seconds between samples.
  """

  def __init__(self, root_pid: int, interval: float = 0.1):
    self.root_pid = int(root_pid)
    self.interval = float(interval)
    self._last: Dict[int, tuple] = {}  # pid -> (name, CPU seconds) at its last reading
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  def _descendants(self) -> set:
    children = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
      if entry.isdigit():
        st = _stat(int(entry))
        if st is not None:
          children[st[1]].append(int(entry))
    found, todo = set(), [self.root_pid]
    while todo:
      pid = todo.pop()
      if pid not in found:
        found.add(pid)
        todo.extend(children.get(pid, ()))
    return found

  def sample(self, pids=None) -> None:
    for pid in (pids if pids is not None else self._descendants()):
      st = _stat(pid)
      if st is not None:
        # A forked server renames itself after the fork: the newest name is the one that says.
        self._last[pid] = (st[0], st[2])

  def _loop(self) -> None:
    next_walk = 0.0
    pids = set()
    while not self._stop.is_set():
      now = time.monotonic()
      if now >= next_walk:
        pids = self._descendants() | pids
        next_walk = now + 1.0
      self.sample(pids)
      self._stop.wait(self.interval)

  def start(self) -> "ProcessTreeCpu":
    self._thread = threading.Thread(target=self._loop, daemon=True, name="process_tree_cpu")
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()

  def __enter__(self) -> "ProcessTreeCpu":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  def by_process(self) -> Dict[str, float]:
    """CPU seconds of each process seen, keyed "name[pid]"."""
    return {f"{name}[{pid}]": cpu for pid, (name, cpu) in sorted(self._last.items())}

  def by_role(self) -> Dict[str, float]:
    """CPU seconds summed by role (`role_of`); each role present at least once is listed."""
    out = collections.Counter()
    root_name = self._last.get(self.root_pid, ("",))[0]
    for name, cpu in self._last.values():
      out[role_of(name, root_name)] += cpu
    return dict(out)
