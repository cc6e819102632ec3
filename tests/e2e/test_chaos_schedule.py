"""benchmarks.chaos's schedules and the ports a partition drops, without running a job."""

import os
import socket
import types

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


def _exactly_once(data_list, global_step=12000, start=9210):
  drill = types.SimpleNamespace(finished=True, hung=None, interval=100, rcs=[0], records=[],
                                progress=[], t0=0.0, stall_limit_s=20.0)
  summary = {"target_global_step": 12000, "global_step": global_step, "num_aggregate": 2,
             "start_global_step": start, "pushes": (global_step - start) * 2, "eval_auc": 0.6,
             "steps_per_execution": 10, "steps_redone": 0, "batches_reread": 0,
             "data_list": dict(data_list, duplicates=0, lost=None)}
  return chaos.verdict(drill, summary, 24000, None)["exactly_once"]


def test_exactly_once_holds_the_counts_to_the_pushes_within_a_restarted_workers_interval():
  # The last run resumed at global step 9210 (18,420 batches restored) and pushed 5,580.
  counted = {"restored_batches": 18420, "uncounted_batches": 0}
  assert _exactly_once(dict(counted, batches=5580))["ok"]
  # A worker restarted in place lost the count of 7 batches it trained before it died: within
  # one progress interval (20) and one function (10).
  check = _exactly_once(dict(counted, batches=5573, uncounted_by_restarted_workers=7,
                             workers_restarted_in_run=1))
  assert check["ok"], check
  assert "uncounted by 1 worker(s) restarted in the last run 7 (at most 30)" in check["detail"]
  # The same 7 without a restarted worker, or more than a restarted worker can lose, is a
  # miscount; so is a worker's whole count lost (the restarted worker's 1,109 batches before
  # its death, credited to nobody: what the plain counters read at the end reported).
  assert not _exactly_once(dict(counted, batches=5573, uncounted_by_restarted_workers=7,
                                workers_restarted_in_run=0))["ok"]
  assert not _exactly_once(dict(counted, batches=4471, uncounted_by_restarted_workers=1109,
                                workers_restarted_in_run=1))["ok"]
  assert not _exactly_once(dict(counted, batches=4471))["ok"]
  # Counted more than pushed: counted twice.
  assert not _exactly_once(dict(counted, batches=5582, uncounted_by_restarted_workers=-2,
                                workers_restarted_in_run=1))["ok"]


def test_a_kill_of_servers_restarted_in_place_waits_for_no_restart_of_the_job():
  # The workers and tf.data workers of a parameter-server job come back in place: the drill goes
  # on at the job's next progress lines. Anything else killed (a server whose loss restarts the
  # job, the job, the command; any sync worker) is followed by a restart to wait for.
  def in_place(mode, *did):
    drill = types.SimpleNamespace(cmd=["train.py", f"--mode={mode}"])
    in_place_of = chaos.Drill._restarted_in_place  # pylint: disable=protected-access
    return in_place_of(drill, {"did": list(did)})
  assert in_place("gba", "SIGKILL tfdata_worker:0 (pid 22609)", "+2.2 s: SIGKILL worker:0 (pid 7)")
  assert in_place("gba", "SIGKILL worker:1 (pid 5)")
  assert not in_place("gba", "SIGKILL tfdata_dispatcher:0 (pid 3)",
                      "+1.0 s: SIGKILL worker:0 (pid 7)")
  assert not in_place("gba", "SIGKILL worker:1 (pid 5)", "+2.0 s: SIGKILL ps:0 (pid 6)")
  assert not in_place("gba", "SIGKILL job (pid 1687)", "+3.0 s: SIGKILL coordinator (pid 32510)")
  assert not in_place("gba", "no worker to kill")
  assert not in_place("sync", "SIGKILL worker:0 (pid 22334)")
