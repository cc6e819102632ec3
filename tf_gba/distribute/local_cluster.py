"""A real multi-process parameter-server cluster on 127.0.0.1, for laptops, tests and demos.

Each PS and worker is a separate process running `tf_gba.distribute.server` with the op
libraries loaded (forked from one process that has imported TensorFlow already:
`tf_gba.distribute.server_forker`); this process becomes the coordinator ("chief"). The cluster
is always torn down: on leaving the `with` block (also by an exception or Ctrl-C), at interpreter exit, and the servers
exit by themselves if this process dies.

One exception to "on leaving the `with` block": while this process's TensorFlow context still
refers to the servers (a strategy connected to them; its model, functions and tensors live on in
the script), the parameter servers and workers stay up until this process ends (or the next
LocalCluster starts, or `stop(force=True)`). The interpreter releases those remote functions and
tensors only as it exits, one RPC each; with the servers gone, TensorFlow's runtime would log a
"Failed to remove function remotely ... Connection refused" block for each (over 500 lines for a
10-step `fit`).
"""

import atexit
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from tf_gba.distribute import server_forker


# Below: ports of well-known services some machines run.
_LOWEST_PORT = 10000
_PORT_STRIPES = 16       # stripes of the port range, one per pid modulo 16 (see free_ports)
_PORT_STRIPE_WIDTH = 64  # ports in each block of a stripe
# Starts of a cluster's servers (and of run_collective_cluster's workers), each on new ports,
# while one could not listen on its chosen port (see LocalCluster._wait_ready_or_move).
START_ATTEMPTS = 3
PORT_TAKEN = "Could not start gRPC server"  # TensorFlow's error when a server cannot listen


class _PortTaken(RuntimeError):
  """A parameter server or worker could not listen on the port chosen for it."""


def _ephemeral_port_range() -> Tuple[int, int]:
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
      low, high = (int(v) for v in f.read().split())
    return low, high
  except (OSError, ValueError):
    return 32768, 60999  # Linux's default


def free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
  """`n` distinct ports free now, for servers to listen on later.

  Chosen below the kernel's ephemeral range: a port from `bind(0)` is free only until the next
  outgoing connection (every gRPC channel opens some) takes it as its local port, which made a
  server fail to start now and then. Ports outside that range are never handed to clients.
  """
  low, _ = _ephemeral_port_range()
  candidates = list(range(_LOWEST_PORT, low))
  rng = random.SystemRandom()
  rng.shuffle(candidates)
  # This process's stripe of the range first (still in random order), then the rest. A port
  # chosen here stays free until its server binds it, a second or more later; another process
  # choosing in that window (parallel jobs or test processes on one machine) could choose the
  # same port, and one of the two servers would then fail to start ("Could not start gRPC
  # server"). Processes whose pids differ modulo the stripe count choose from disjoint ports.
  stripe = os.getpid() % _PORT_STRIPES
  candidates.sort(key=lambda port: (port // _PORT_STRIPE_WIDTH) % _PORT_STRIPES != stripe)
  socks, ports = [], []
  try:
    for port in candidates:
      if len(ports) == n:
        break
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      try:
        # gRPC servers listen on every interface: the port must be free there, not on host alone.
        s.bind(("", port))
      except OSError:
        s.close()
        continue
      socks.append(s)
      ports.append(port)
    while len(ports) < n:  # no room below the ephemeral range: fall back to the kernel's choice
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind((host, 0))
      socks.append(s)
      ports.append(s.getsockname()[1])
  finally:
    for s in socks:
      s.close()
  return ports


# Server processes of stopped clusters that this process's context still referred to: they exit
# with this process (their parent watch), or when the next cluster starts.
_LINGERING: List[subprocess.Popen] = []


def _terminate(procs) -> None:
  """SIGTERM to each process group, SIGKILL to those still there after 10 s; waits for all."""
  for proc in procs:
    if proc.poll() is None:
      try:
        os.killpg(proc.pid, signal.SIGTERM)
      except ProcessLookupError:
        pass
  deadline = time.time() + 10
  for proc in procs:
    try:
      proc.wait(timeout=max(0.1, deadline - time.time()))
    except subprocess.TimeoutExpired:
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      proc.wait()


def stop_lingering_servers() -> int:
  """Stops the servers that stopped clusters left to exit with this process; returns how many.

  TensorFlow then logs about the remote functions and tensors of theirs this process still holds,
  when it releases them.
  """
  procs = list(_LINGERING)
  _LINGERING.clear()
  _terminate(procs)
  return len(procs)


def server_env(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
  """The environment of a LocalCluster's servers (`env`: the cluster's own additions)."""
  out = dict(os.environ)
  out.update(env or {})
  out.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  out["CUDA_VISIBLE_DEVICES"] = out.get("TF_GBA_SERVER_GPUS", "")
  out.pop("TF_CONFIG", None)
  return out


def warm_forker(log_dir: str, env: Optional[Dict[str, str]] = None) -> None:
  """Starts now the server forker a LocalCluster with `env` started later in this process would
  start (`server_forker`: a TensorFlow import, seconds), so that its servers start without that
  wait; nothing if forking is off. `log_dir`: where the forker's log goes."""
  if server_forker.enabled():
    os.makedirs(log_dir, exist_ok=True)
    server_forker.for_env(server_env(env), log_dir)


def prefork_forker(log_dir: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> bool:
  """Makes a fork of this process the server forker a LocalCluster with `env` started later in
  this process will use (`server_forker.prefork`): for a process that has imported TensorFlow and
  tf_gba itself and has run no TensorFlow op yet. Saves the forker's own TensorFlow import.
  `log_dir`: where the forker's log goes. Returns whether it forked."""
  if log_dir:
    os.makedirs(log_dir, exist_ok=True)
  return server_forker.prefork(server_env(env), log_dir)


class LocalCluster:
  """Starts `num_ps` parameter servers and `num_workers` workers as local processes.

  Args:
    num_ps: parameter server processes.
    num_workers: worker processes.
    host: address the servers bind to (loopback unless told otherwise).
    start_timeout: seconds to wait for every server to report ready.
    env: extra environment for the server processes (e.g. straggler settings).
    inter_op_threads: inter-op threads per server (0: num_workers + 2).
    log_dir: where each server's log (`ps_0.log`, ...) goes; kept. None: a temporary directory,
      deleted when the cluster stops unless `keep_logs` or the cluster stops on an exception.
    keep_logs: keep the temporary log directory.
    restart_workers: start a worker or a tf.data worker again, at its address, when its process
      dies: the coordinator (ParameterServerStrategy) then runs the dead worker's closures there
      again, and the readers of the data list, which keep asking a lost tf.data worker's address
      (with growing back-off, which slows every read), find a tf.data worker there again.
    num_tfdata_workers: tf.data service workers for the shared data list
      (`tf_gba.data.data_list`), each a process of its own; with any, a dispatcher too
      ("tfdata_dispatcher:0", whose address is `tfdata_dispatcher`). Own processes rather than
      threads of this process or of the training workers: a tf.data worker can then fail (or be
      killed) alone, and the dispatcher's share of the data list's work (a request per batch,
      about 0.2 ms of CPU) is not the coordinator's, as on a real cluster.
  """

  def __init__(self, num_ps: int = 1, num_workers: int = 2, host: str = "127.0.0.1",
               start_timeout: float = 120.0, env: Optional[Dict[str, str]] = None,
               inter_op_threads: int = 0, log_dir: Optional[str] = None,
               keep_logs: bool = False, restart_workers: bool = False,
               num_tfdata_workers: int = 0):
    if num_ps < 1:
      raise ValueError(f"num_ps must be >= 1, got {num_ps}.")
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}.")
    self.num_ps, self.num_workers, self.host = num_ps, num_workers, host
    self._start_timeout = start_timeout
    self._env = dict(env or {})
    self._inter_op = inter_op_threads or num_workers + 2
    if num_tfdata_workers < 0:
      raise ValueError(f"num_tfdata_workers must be >= 0, got {num_tfdata_workers}.")
    self.num_tfdata_workers = num_tfdata_workers
    self.tfdata_dispatcher: Optional[str] = None
    self._procs: Dict[str, subprocess.Popen] = {}
    self._logs: Dict[str, str] = {}
    if log_dir:
      os.makedirs(log_dir, exist_ok=True)
    self._logdir = log_dir or tempfile.mkdtemp(prefix="tf_gba_cluster_")
    self._delete_logs = not (log_dir or keep_logs)
    ports = free_ports(num_ps + num_workers + 1 + (num_tfdata_workers + 1 if num_tfdata_workers
                                                   else 0), host)
    self._tfdata_ports = ports[num_ps + num_workers + 1:]
    self.cluster_spec = self._spec(ports[:num_ps + num_workers + 1])
    self._started = False
    self._stopping = False
    self._restart_workers = restart_workers
    # Servers started again after their process died, per job.
    self.restarts = {"ps": 0, "worker": 0, "tfdata_worker": 0}
    self.restarted_tasks = set()  # "worker:0", ...: the tasks started again

  # ---- lifecycle ---------------------------------------------------------------------------------
  def start(self) -> "LocalCluster":
    if self._started:
      return self
    self._started = True
    # A new cluster replaces the connection to an earlier one: its servers need not wait anymore.
    stop_lingering_servers()
    atexit.register(self.stop)
    try:
      for job in ("ps", "worker"):
        for i in range(len(self.cluster_spec[job])):
          self._spawn(job, i)
      if self.num_tfdata_workers:
        self.tfdata_dispatcher = f"{self.host}:{self._tfdata_ports[0]}"
        self._spawn("tfdata_dispatcher", 0)
        for i in range(self.num_tfdata_workers):
          self._spawn("tfdata_worker", i)
      self._wait_ready_or_move()
      if self._restart_workers:
        threading.Thread(target=self._monitor, daemon=True, name="LocalCluster-monitor").start()
    except BaseException:
      self.stop(keep_logs=True)
      raise
    return self

  def _spawn(self, job: str, index: int) -> None:
    name = f"{job}:{index}"
    env = server_env(self._env)
    log = os.path.join(self._logdir, f"{job}_{index}.log")
    self._logs[name] = log
    if job == "tfdata_dispatcher":
      argv = ["--job_name", job, "--port", str(self._tfdata_ports[0]), "--exit_with_parent"]
    elif job == "tfdata_worker":
      argv = ["--job_name", job, "--dispatcher_address", self.tfdata_dispatcher,
              "--host", self.host, "--port", str(self._tfdata_ports[1 + index]),
              "--exit_with_parent"]
    else:
      argv = ["--cluster_spec", json.dumps(self.cluster_spec), "--job_name", job,
              "--task_index", str(index), "--inter_op_threads", str(self._inter_op),
              "--exit_with_parent"]
    # A session of its own, so Ctrl-C in a terminal reaches only us; we stop the servers.
    # Appended to: a restarted server's log follows the one of the process it replaces.
    self._procs[name] = server_forker.launch(name, "tf_gba.distribute.server", argv, log, env)

  def _spec(self, ports: List[int]) -> Dict[str, List[str]]:
    addr = [f"{self.host}:{p}" for p in ports]
    return {"chief": [addr[0]], "ps": addr[1:1 + self.num_ps], "worker": addr[1 + self.num_ps:]}

  def _wait_ready_or_move(self) -> None:
    """Waits for every server; when a parameter server or worker could not listen on its port,
    moves all of them to new ports and waits again (at most START_ATTEMPTS starts).

    A port chosen free (free_ports) stays unbound until its server starts, a second or so later;
    another process on the machine can take it in between (seen about once in a test suite's
    run, which starts over a hundred clusters beside each other). Every server's address is in
    every other's cluster spec, so all of them move."""
    for attempt in range(1, START_ATTEMPTS + 1):
      try:
        return self._wait_ready()
      except _PortTaken as e:
        if attempt == START_ATTEMPTS:
          raise RuntimeError(f"{e} ({attempt} starts, each on other ports)") from None
        names = [n for n in self._procs if n.split(":")[0] in ("ps", "worker")]
        _terminate([self._procs.pop(n) for n in names])
        for name in names:
          os.remove(self._logs.pop(name))  # a new start's log: its ready line must be its own
        self.cluster_spec = self._spec(free_ports(self.num_ps + self.num_workers + 1, self.host))
        for name in names:
          job, index = name.split(":")
          self._spawn(job, int(index))

  def _wait_ready(self) -> None:
    deadline = time.time() + self._start_timeout
    pending = set(self._procs)
    while pending:
      for name in list(pending):
        proc = self._procs[name]
        log = self.log(name)
        if "TF_GBA_SERVER_READY" in log:
          pending.discard(name)
          continue
        if proc.poll() is not None:
          # Read again: a server that wrote its error and exited after the read above left it
          # out (a port conflict then read as another failure, and no new start was tried).
          log = self.log(name)
          error = (_PortTaken if name.split(":")[0] in ("ps", "worker") and PORT_TAKEN in log
                   else RuntimeError)
          raise error(f"Server {name} exited with code {proc.returncode} while starting. "
                      f"Its log:\n{log[-4000:]}")
      if time.time() > deadline:
        raise TimeoutError(f"Servers {sorted(pending)} not ready after {self._start_timeout}s; "
                           f"logs in {self._logdir}.")
      time.sleep(0.2)

  def _monitor(self) -> None:
    while not self._stopping:
      for name, proc in list(self._procs.items()):
        job, index = name.split(":")
        if job in ("worker", "tfdata_worker") and proc.poll() is not None and not self._stopping:
          self._spawn(job, int(index))
          self.restarts[job] += 1
          self.restarted_tasks.add(name)
      time.sleep(0.5)

  def dead(self, job: str = "ps") -> List[str]:
    """The servers of `job` whose process has exited ("ps:0", ...)."""
    return [name for name, proc in self._procs.items()
            if name.startswith(job + ":") and proc.poll() is not None]

  def stop(self, keep_logs: bool = False, force: bool = False) -> None:
    """Stops every server; deletes a temporary log directory unless `keep_logs`.

    While this process's context refers to the servers (see the module docstring), they are left
    to exit with this process instead, unless `force`.
    """
    self._stopping = True
    procs = list(self._procs.values())
    if not force and self._context_refers_to_servers():
      _LINGERING.extend(p for p in procs if p.poll() is None and p not in _LINGERING)
    else:
      _terminate(procs)
    if self._delete_logs and not keep_logs:
      shutil.rmtree(self._logdir, ignore_errors=True)
      self._delete_logs = False

  def _context_refers_to_servers(self) -> bool:
    """Whether this process's eager context has servers of this cluster as its remote tasks."""
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    if not context.context_safe() or context.context().get_server_def() is None:
      return False
    ours = {addr for job in ("ps", "worker") for addr in self.cluster_spec[job]}
    server_def = context.context().get_server_def()
    return any(addr in ours for job in server_def.cluster.job for addr in job.tasks.values())

  @property
  def log_dir(self) -> str:
    return self._logdir

  def kill(self, job: str, index: int) -> None:
    """Kills one server abruptly (failure tests); job "tfdata_worker" for a tf.data worker."""
    proc = self._procs[f"{job}:{index}"]
    if proc.poll() is None:
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    proc.wait()

  def __enter__(self) -> "LocalCluster":
    return self.start()

  def __exit__(self, exc_type, *_) -> None:
    # On an exception the servers' logs may say why: they stay.
    self.stop(keep_logs=exc_type is not None)

  # ---- access ------------------------------------------------------------------------------------
  @property
  def pids(self) -> List[int]:
    return [p.pid for p in self._procs.values()]

  def log(self, name: str) -> str:
    with open(self._logs[name], "rb") as f:
      return f.read().decode("utf-8", "replace")

  def resolver(self) -> tf.distribute.cluster_resolver.SimpleClusterResolver:
    """Cluster resolver for the coordinator (this process, task "chief":0)."""
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(self.cluster_spec), task_type="chief", task_id=0,
        rpc_layer="grpc")

  def tf_config(self, job: str, index: int) -> str:
    return json.dumps({"cluster": self.cluster_spec, "task": {"type": job, "index": index}})
