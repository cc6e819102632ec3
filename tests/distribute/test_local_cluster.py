"""LocalCluster: real server processes that never outlive their job."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tf_gba.distribute import LocalCluster
from tf_gba.distribute import server_forker

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie still answers kill(0); it has exited all the same.
  with open(f"/proc/{pid}/stat") as f:
    return f.read().split()[2] != "Z"


def _wait_dead(pids, timeout=20.0):
  deadline = time.time() + timeout
  while time.time() < deadline and any(_alive(p) for p in pids):
    time.sleep(0.2)
  return [p for p in pids if _alive(p)]


def test_servers_stop_when_the_block_raises():
  pids = []
  with pytest.raises(RuntimeError, match="training failed"):
    with LocalCluster(num_ps=1, num_workers=2) as cluster:
      pids = cluster.pids
      assert len(pids) == 3 and all(_alive(p) for p in pids)
      assert "TF_GBA_SERVER_READY" in cluster.log("ps:0")
      raise RuntimeError("training failed")
  assert _wait_dead(pids) == []


def _comm(pid: int) -> str:
  with open(f"/proc/{pid}/comm") as f:
    return f.read().strip()


@pytest.mark.parametrize("fork", ["1", "0"])
def test_servers_exit_when_the_launcher_is_killed(fork):
  """The launcher dies without any cleanup (SIGKILL); its servers notice and exit by themselves,
  whether forked from the server forker (named by their task, children of the forker) or started
  as processes of their own (TF_GBA_FORK_SERVERS=0: children of the launcher)."""
  code = ("import os, sys, time\n"
          "from tf_gba.distribute import LocalCluster\n"
          "c = LocalCluster(num_ps=1, num_workers=1).start()\n"
          "print(os.getpid(), ' '.join(map(str, c.pids)), flush=True)\n"
          "time.sleep(600)\n")
  proc = subprocess.Popen([sys.executable, "-c", code], cwd=_ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True,
                          env=dict(os.environ, TF_GBA_FORK_SERVERS=fork))
  try:
    launcher, *pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    parents = set()
    for pid in pids:
      with open(f"/proc/{pid}/stat") as f:
        parents.add(int(f.read().rsplit(")", 1)[1].split()[1]))
    if fork == "1":
      assert sorted(_comm(p) for p in pids) == ["ps:0", "worker:0"]
      assert parents != {launcher} and len(parents) == 1  # the forker
    else:
      assert parents == {launcher}
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert _wait_dead(pids) == []


def test_bad_sizes_are_refused():
  with pytest.raises(ValueError, match="num_workers"):
    LocalCluster(num_ps=1, num_workers=0)
  with pytest.raises(ValueError, match="num_ps"):
    LocalCluster(num_ps=0, num_workers=1)


_CONNECTED = """
import os, sys
import tf_gba
import tensorflow as tf
from tf_gba.distribute import LocalCluster

def alive(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split()[2] != "Z"
  except FileNotFoundError:
    return False

with LocalCluster(num_ps=1, num_workers=1) as cluster:
  tf.config.experimental_connect_to_cluster(cluster.resolver(), job_name="chief",
                                            make_master_device_default=False)
  with tf.device("/job:ps/task:0"):
    v = tf.Variable(3.0)
  double = tf.function(lambda: v * 2.0)
  with tf.device("/job:worker/task:0"):
    assert float(double()) == 6.0
# `v` and `double` live on: the servers they refer to stay until this process ends.
print("OWN", " ".join(map(str, cluster.pids)), all(alive(p) for p in cluster.pids), flush=True)
"""


def test_servers_the_process_still_refers_to_exit_with_it():
  env = dict(os.environ, PYTHONPATH=_ROOT)
  env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # TF's errors are what this is about
  proc = subprocess.run([sys.executable, "-c", _CONNECTED], cwd=_ROOT, capture_output=True,
                        text=True, timeout=300, env=env, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (line,) = [l for l in proc.stdout.splitlines() if l.startswith("OWN ")]
  *pids, alive_after_block = line.split()[1:]
  assert alive_after_block == "True"
  # Released at exit while the servers were still there: no error about them.
  for text in ("Connection refused", "Failed to remove function", "Unable to destroy"):
    assert text not in proc.stderr, proc.stderr[-3000:]
  assert _wait_dead([int(p) for p in pids]) == []


def test_a_warmed_forker_is_the_one_the_cluster_forks_from(tmp_path):
  """local_cluster.warm_forker starts the forker a LocalCluster started later in the process uses
  (--mode=auto starts it beside its first Sync stay): the cluster's servers are its children,
  and no other forker is started."""
  code = ("import os, sys\n"
          "from tf_gba.distribute import LocalCluster, local_cluster, server_forker\n"
          "local_cluster.warm_forker(sys.argv[1])\n"
          "(warm,) = [f._proc.pid for f in server_forker._FORKERS.values()]\n"
          "with LocalCluster(num_ps=1, num_workers=1) as c:\n"
          "  forkers = [f._proc.pid for f in server_forker._FORKERS.values()]\n"
          "  parents = [int(open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1])\n"
          "             for p in c.pids]\n"
          "  print(warm, ' '.join(map(str, forkers)), '|', ' '.join(map(str, parents)),\n"
          "        flush=True)\n")
  proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=_ROOT,
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, TF_GBA_FORK_SERVERS="1"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  head, parents = proc.stdout.strip().splitlines()[-1].split("|")
  warm, *forkers = [int(p) for p in head.split()]
  assert forkers == [warm]  # no second forker
  assert [int(p) for p in parents.split()] == [warm, warm]  # ps:0 and worker:0, its children
  assert (tmp_path / "server_forker.log").exists()


_PREFORKED = """
import os, sys
import tensorflow as tf
from tf_gba.distribute import LocalCluster, local_cluster, server_forker

def parent(pid):
  return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])

# Another import-time environment than this process's: not a fork of it (no forker yet).
other = dict(local_cluster.server_env(), TF_CPP_MIN_LOG_LEVEL="1")
print("OTHER", server_forker.prefork(other, sys.argv[1]))
print("FORKED", local_cluster.prefork_forker(sys.argv[1]), local_cluster.prefork_forker())
(forker,) = [f._proc.pid for f in server_forker._FORKERS.values()]
fds = sorted(int(fd) for fd in os.listdir(f"/proc/{forker}/fd"))
print("FORKER", parent(forker) == os.getpid(), len(fds), fds[:3], flush=True)
with LocalCluster(num_ps=1, num_workers=1) as c:
  print("SERVERS", [parent(p) == forker for p in c.pids], flush=True)
  strategy = tf.distribute.experimental.ParameterServerStrategy(c.resolver())
  with strategy.scope():
    v = tf.Variable(2.0)
  print("VALUE", float(v.assign_add(1.5).numpy()), flush=True)
# The strategy set the eager client's streaming switch in this process's environment; the next
# cluster's servers still come from the same forker.
print("STREAMING", os.environ.get("TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE"), flush=True)
with LocalCluster(num_ps=1, num_workers=1) as c:
  print("AGAIN", [parent(p) == forker for p in c.pids], len(server_forker._FORKERS), flush=True)
# This process has run TensorFlow now: a fork of it would be no clean forker.
server_forker._FORKERS.clear()
print("AFTER_OPS", local_cluster.prefork_forker(), flush=True)
"""


def test_a_preforked_forker_is_a_fork_of_the_process_and_serves_its_clusters(tmp_path):
  """local_cluster.prefork_forker (the training binary's job calls it after importing
  TensorFlow): the forker is a fork of this process holding only its protocol pipes besides
  stdin, stdout and stderr (not the caller's files: a server holding the caller's stdout pipe
  would keep its reader waiting), the LocalCluster's servers are its children and work, and so
  are those of a cluster started after a ParameterServerStrategy connected; a second call, one
  for another import-time environment, or one after TensorFlow ran an op here forks nothing."""
  proc = subprocess.run([sys.executable, "-c", _PREFORKED, str(tmp_path)], cwd=_ROOT,
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, TF_GBA_FORK_SERVERS="1", PYTHONPATH=_ROOT))
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = dict(l.split(" ", 1) for l in proc.stdout.splitlines() if " " in l)
  assert lines["OTHER"] == "False"
  assert lines["FORKED"] == "True False"
  assert lines["FORKER"] == "True 5 [0, 1, 2]"
  assert lines["SERVERS"] == "[True, True]"
  assert lines["VALUE"] == "3.5"
  assert lines["STREAMING"] == "False"
  assert lines["AGAIN"] == "[True, True] 1"
  assert lines["AFTER_OPS"] == "False"
  assert (tmp_path / "server_forker.log").exists()


def test_a_fork_has_none_of_its_parents_forkers_and_no_lock_held(monkeypatch):
  """`prefork` forks while it holds its environment's lock. A process forked from that forker
  (the binary's job, forked by its supervisor when that is itself a fork: tests/script_process.py)
  waited forever for the lock in its own `prefork`; and a parent's forkers are not the child's
  (their pipes are the parent's)."""
  # pylint: disable=protected-access
  forkers, locks = {}, {}
  monkeypatch.setattr(server_forker, "_FORKERS", forkers)
  monkeypatch.setattr(server_forker, "_KEY_LOCKS", locks)
  env = {"TF_CPP_MIN_LOG_LEVEL": "9"}
  key, lock = server_forker._key_lock(env)
  forkers[key] = object()
  with lock:
    pid = os.fork()
    if pid == 0:
      code = 1
      try:
        if not forkers and not locks:
          code = 0 if server_forker._key_lock(env)[1].acquire(timeout=5) else 2
      finally:
        os._exit(code)
  _, status = os.waitpid(pid, 0)
  assert os.waitstatus_to_exitcode(status) == 0
  assert forkers and locks  # the parent's own are untouched


def test_one_forker_starting_does_not_hold_up_another_environments(monkeypatch, tmp_path):
  """Starting a forker takes seconds (its TensorFlow import): a cluster of another environment
  (--mode=auto's Sync workers while the parameter servers' forker warms) does not wait for it;
  one of the same environment does, and gets that forker rather than a second."""
  started, release = threading.Event(), threading.Event()

  class SlowForker:
    def __init__(self, env):
      self.env = env
      if env["TF_CPP_MIN_LOG_LEVEL"] == "3":
        started.set()
        release.wait(30)

    @classmethod
    def start(cls, env, log_path):
      del log_path
      return cls(env)

    def alive(self):
      return True

  monkeypatch.setattr(server_forker, "Forker", SlowForker)
  monkeypatch.setattr(server_forker, "_FORKERS", {})
  monkeypatch.setattr(server_forker, "_KEY_LOCKS", {})
  slow_env, other_env = {"TF_CPP_MIN_LOG_LEVEL": "3"}, {"TF_CPP_MIN_LOG_LEVEL": "2"}
  results = {"slow": [], "other": [], "same": []}

  def get(name, env):
    results[name].append(server_forker.for_env(env, str(tmp_path)))

  slow = threading.Thread(target=get, args=("slow", slow_env), daemon=True)
  slow.start()
  assert started.wait(10)
  other = threading.Thread(target=get, args=("other", other_env), daemon=True)
  other.start()
  other.join(5)
  assert len(results["other"]) == 1 and results["other"][0].env == other_env
  same = threading.Thread(target=get, args=("same", dict(slow_env)), daemon=True)
  same.start()
  same.join(0.5)
  assert results["same"] == [] and results["slow"] == []  # waiting for the one starting
  release.set()
  slow.join(10)
  same.join(10)
  assert results["same"][0] is results["slow"][0]


def test_free_ports_are_outside_the_ephemeral_range_and_free(monkeypatch):
  """Ports a client connection could take as its local port would race the server's bind."""
  import socket  # pylint: disable=g-import-not-at-top
  from tf_gba.distribute import local_cluster  # pylint: disable=g-import-not-at-top
  low, high = local_cluster._ephemeral_port_range()  # pylint: disable=protected-access
  ports = local_cluster.free_ports(40)
  assert len(set(ports)) == 40
  assert all(p < low or p > high for p in ports), ports
  # A port held by a listener is not offered: with 41 candidates and 40 asked for, every free one
  # is taken (and the kernel's choice fills in for any other process's), never the held one.
  monkeypatch.setattr(local_cluster, "_LOWEST_PORT", low - 3000)
  monkeypatch.setattr(local_cluster, "_ephemeral_port_range", lambda: (low - 3000 + 41, high))
  # The held port is the first of the 41 this test can bind: another process (a server of a test
  # running alongside) may hold any given one.
  held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  for held_port in range(low - 3000, low - 3000 + 41):
    try:
      held.bind(("", held_port))
      break
    except OSError:
      continue
  else:
    raise AssertionError(f"every port of {low - 3000}..{low - 3000 + 40} is taken")
  held.listen()
  try:
    ports = local_cluster.free_ports(40)
    assert len(set(ports)) == 40 and held_port not in ports, (held_port, ports)
  finally:
    held.close()


def test_processes_with_other_pids_choose_disjoint_free_ports(monkeypatch):
  """Two processes choosing at once must not both choose one port before either server binds."""
  from tf_gba.distribute import local_cluster  # pylint: disable=g-import-not-at-top
  chosen = {}
  for pid in (3, 4, 19):  # 19 is 3's stripe again: 16 stripes of 64-port blocks
    monkeypatch.setattr(local_cluster.os, "getpid", lambda pid=pid: pid)
    chosen[pid] = local_cluster.free_ports(30)
    assert all((port // 64) % 16 == pid % 16 for port in chosen[pid]), (pid, chosen[pid])
  assert not set(chosen[3]) & set(chosen[4])


def _listening_socket():
  """A port held by another process's listener, as a server started between free_ports and our
  server's bind holds it (no SO_REUSEPORT, so gRPC cannot share it)."""
  import socket  # pylint: disable=g-import-not-at-top
  held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  held.bind(("", 0))
  held.listen()
  return held, held.getsockname()[1]


def test_servers_move_to_new_ports_when_one_was_taken_before_it_listened(monkeypatch):
  """The first choice gives a parameter server a port another listener took after it was chosen:
  that server cannot start, and all of them start again on new ports."""
  from tf_gba.distribute import local_cluster  # pylint: disable=g-import-not-at-top
  held, port = _listening_socket()
  real = local_cluster.free_ports
  calls = []

  def first_with_a_taken_port(n, host="127.0.0.1"):
    ports = real(n, host)
    calls.append(n)
    return ports if len(calls) > 1 else [ports[0], port] + ports[2:]  # ps:0 is index 1

  monkeypatch.setattr(local_cluster, "free_ports", first_with_a_taken_port)
  try:
    with LocalCluster(num_ps=1, num_workers=2, log_dir=None) as cluster:
      assert len(calls) == 2, calls  # the cluster's ports, then new ones for the second start
      addresses = [a for job in ("chief", "ps", "worker") for a in cluster.cluster_spec[job]]
      assert f"127.0.0.1:{port}" not in addresses and len(set(addresses)) == 4
      assert len(cluster.pids) == 3 and all(_alive(p) for p in cluster.pids)
      # Each server's log is its own start's, ready on its new address.
      assert "TF_GBA_SERVER_READY ps:0" in cluster.log("ps:0")
      assert "Could not start gRPC server" not in cluster.log("ps:0")
      pids = cluster.pids
    assert _wait_dead(pids) == []
  finally:
    held.close()


def test_a_port_taken_at_every_start_ends_in_one_error(monkeypatch):
  from tf_gba.distribute import local_cluster  # pylint: disable=g-import-not-at-top
  held, port = _listening_socket()
  real = local_cluster.free_ports

  def always_taken(n, host="127.0.0.1"):
    ports = real(n, host)
    return [ports[0], port] + ports[2:]  # ps:0's, at every choice

  monkeypatch.setattr(local_cluster, "free_ports", always_taken)
  try:
    with pytest.raises(RuntimeError, match=r"(?s)^Server ps:0 exited with code 1 while starting.*"
                       r"Could not start gRPC server.*\(3 starts, each on other ports\)$"):
      LocalCluster(num_ps=1, num_workers=1).start()
  finally:
    held.close()
