"""Who can reach a local run's servers: nobody from another host, by default.

The test builds its own two-host network: two network namespaces, "machine" and "outside", joined
by a veth pair (192.0.2.1 and 192.0.2.2, a documentation range). The training binary runs in
"machine"; while it trains, the test connects from "outside" to each server port through
machine's non-loopback address. The machine's own namespace and addresses are never touched.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from benchmarks import process_tree
from tests.e2e import test_fault_drills as drills

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MACHINE, _OUTSIDE = "192.0.2.1", "192.0.2.2"


def _can_build_namespaces():
  if not sys.platform.startswith("linux") or os.geteuid() != 0:
    return False
  return all(shutil.which(t) for t in ("ip", "unshare", "nsenter"))


class _TwoHosts:
  """Two network namespaces, each held by a sleeping process, joined by a veth pair."""

  def __init__(self):
    self.holders = [subprocess.Popen(["unshare", "--net", "sleep", "3600"]) for _ in range(2)]
    time.sleep(0.5)
    self.machine, self.outside = (p.pid for p in self.holders)
    name = f"tg{os.getpid() % 100000}"
    subprocess.run(["ip", "link", "add", f"{name}m", "netns", str(self.machine), "type", "veth",
                    "peer", "name", f"{name}o", "netns", str(self.outside)], check=True)
    for pid, dev, addr in ((self.machine, f"{name}m", _MACHINE),
                           (self.outside, f"{name}o", _OUTSIDE)):
      self.ns(pid, ["ip", "addr", "add", f"{addr}/30", "dev", dev], check=True)
      self.ns(pid, ["ip", "link", "set", dev, "up"], check=True)
      self.ns(pid, ["ip", "link", "set", "lo", "up"], check=True)

  @staticmethod
  def ns(pid, cmd, **kwargs):
    return subprocess.run(["nsenter", "-t", str(pid), "-n", *cmd], capture_output=True,
                          text=True, timeout=60, **kwargs)

  def connect_from_outside(self, port):
    code = ("import socket\n"
            f"s = socket.socket(); s.settimeout(5)\n"
            f"print(s.connect_ex(({_MACHINE!r}, {port})))\n")
    return int(self.ns(self.outside, [sys.executable, "-c", code], check=True).stdout)

  def close(self):
    for p in self.holders:  # the namespaces, and the veth pair with them, go with their holders
      p.kill()
      p.wait()


def _ports_of_servers(root_pid):
  """The ports the run's parameter servers, workers and tf.data servers listen on."""
  ports = set()
  for pid in process_tree.descendants(root_pid):
    if process_tree.task(pid) is not None:
      ports |= set(process_tree.listening_ports(pid))
  return sorted(ports)


def _probe_during_run(hosts, tmp_path, *flags):
  model_dir = str(tmp_path / "m")
  cmd = ["nsenter", "-t", str(hosts.machine), "-n", *drills._command("gba", model_dir),  # pylint: disable=protected-access
         "--steps=4000", *flags]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=drills._env(model_dir), cwd=_ROOT)  # pylint: disable=protected-access
  try:
    deadline = time.time() + 300
    while time.time() < deadline:
      line = proc.stdout.readline()
      if not line or line.startswith("step "):
        break
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    ports = _ports_of_servers(proc.pid)
    assert len(ports) == 6  # 1 PS + 2 workers + the tf.data dispatcher and 2 tf.data workers
    return {port: hosts.connect_from_outside(port) for port in ports}, proc
  finally:
    drills._kill_tree(proc.pid)  # pylint: disable=protected-access
    proc.wait()


@pytest.mark.skipif(not _can_build_namespaces(),
                    reason="needs root, ip, unshare and nsenter to build the test's own network")
def test_servers_are_unreachable_from_another_host(tmp_path):
  hosts = _TwoHosts()
  try:
    # Without the private network the servers answer on the machine's address: the probe works.
    exposed, proc = _probe_during_run(hosts, tmp_path / "a", "--noprivate_network")
    assert set(exposed.values()) == {0}, exposed
    assert "no private network: --noprivate_network" in proc.stderr.read()
    # By default: refused on every port.
    private, _ = _probe_during_run(hosts, tmp_path / "b")
    assert all(code != 0 for code in private.values()), private
  finally:
    hosts.close()
