"""benchmarks.chaos's schedules and the ports a partition drops, without running a job."""

import os
import socket

from benchmarks import chaos
from benchmarks import process_tree


def test_every_kind_of_a_mode_comes_once_in_a_schedule_of_as_many_faults():
  for mode, kinds in chaos.MODE_KINDS.items():
    for seed in (0, 1, 2):
      faults = chaos.schedule(mode, seed, len(kinds), global_steps=4200)
      assert sorted(f.kind for f in faults) == sorted(kinds), (mode, seed)
      steps = [f.at for f in faults]
      assert steps == sorted(steps) and 0.06 * 4200 <= steps[0] and steps[-1] <= 0.88 * 4200
      # Drawn from the seed: the same schedule again.
      assert chaos.schedule(mode, seed, len(kinds), global_steps=4200) == faults
  assert "partition" in chaos.MODE_KINDS["gba"] and "partition" not in chaos.MODE_KINDS["sync"]
  partitions = [f for f in chaos.schedule("gba", 0, 13, 4200) if f.kind == "partition"]
  assert partitions[0].target == "job" and 10 <= partitions[0].duration_s <= 30
  # sync has workers only: its two kills in a row and its kill during a recovery (the rerun
  # command's) are of workers.
  for f in chaos.schedule("sync", 0, len(chaos.MODE_KINDS["sync"]), 4200):
    if f.kind in ("double", "during_recovery"):
      assert (f.target, f.second) == ("worker", "kill_worker"), f
    if f.kind == "double":
      assert 1.0 <= f.gap_s <= 5.0, f


def test_a_partition_drops_the_listening_and_the_connected_ports_of_a_process():
  server = socket.create_server(("127.0.0.1", 0))
  client = socket.create_connection(server.getsockname())
  accepted, _ = server.accept()
  try:
    listen_port = server.getsockname()[1]
    client_port = client.getsockname()[1]
    assert listen_port in process_tree.listening_ports(os.getpid())
    assert client_port not in process_tree.listening_ports(os.getpid())
    assert {listen_port, client_port} <= set(process_tree.local_ports(os.getpid()))
  finally:
    for s in (accepted, client, server):
      s.close()
