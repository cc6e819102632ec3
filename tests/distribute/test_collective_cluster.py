"""The localhost multi-worker launcher: results, TF_CONFIG, and that it always ends its workers.

The targets below run in the worker processes; they need no TensorFlow, so these tests are quick.
"""

import json
import os
import time

import pytest

from tf_gba.distribute import collective_cluster

_HERE = os.path.abspath(__file__)


def report_tf_config(extra):
  """Worker target: returns its TF_CONFIG and an argument."""
  return {"tf_config": json.loads(os.environ["TF_CONFIG"]), "extra": extra}


def fail_or_hang(fail_index, sleep_s):
  """Worker target: worker `fail_index` raises; the others hang."""
  index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
  if index == fail_index:
    time.sleep(0.5)
    raise RuntimeError(f"worker {index} fails on purpose")
  time.sleep(sleep_s)
  return index


def serve_on_my_address():
  """Worker target: starts a real server on its TF_CONFIG address, as the strategy does first."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  config = json.loads(os.environ["TF_CONFIG"])
  index = config["task"]["index"]
  tf.distribute.Server(tf.train.ClusterSpec(config["cluster"]), job_name="worker",
                       task_index=index, protocol="grpc", start=True)
  return config["cluster"]["worker"][index]


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie still answers kill(0); it has ended all the same.
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0] != "Z"
  except OSError:
    return False


def test_results_in_worker_order_with_each_workers_tf_config():
  results = collective_cluster.run_collective_cluster(
      f"{_HERE}:report_tf_config", num_workers=2, kwargs={"extra": [1, "a"]}, timeout_s=60)
  assert [r["extra"] for r in results] == [[1, "a"]] * 2
  configs = [r["tf_config"] for r in results]
  workers = configs[0]["cluster"]["worker"]
  assert len(set(workers)) == 2 and all(w.startswith("127.0.0.1:") for w in workers)
  for index, config in enumerate(configs):
    assert config == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}


def test_a_failing_worker_ends_the_cluster_at_once(tmp_path):
  begin = time.monotonic()
  with pytest.raises(collective_cluster.ClusterError, match="fails on purpose") as error:
    collective_cluster.run_collective_cluster(
        f"{_HERE}:fail_or_hang", num_workers=2, kwargs={"fail_index": 1, "sleep_s": 120},
        timeout_s=90, log_dir=str(tmp_path))
  assert time.monotonic() - begin < 60     # the hanging worker was not waited for
  assert len(error.value.pids) == 2 and not any(_alive(pid) for pid in error.value.pids)


def test_timeout_kills_hanging_workers(tmp_path):
  with pytest.raises(collective_cluster.ClusterError, match="did not finish within") as error:
    collective_cluster.run_collective_cluster(
        f"{_HERE}:fail_or_hang", num_workers=2, kwargs={"fail_index": -1, "sleep_s": 120},
        timeout_s=8, log_dir=str(tmp_path))
  assert len(error.value.pids) == 2 and not any(_alive(pid) for pid in error.value.pids)


def test_bad_target_is_refused():
  with pytest.raises(ValueError, match="module:function"):
    collective_cluster._load_target("no_function_here")  # pylint: disable=protected-access


def test_workers_start_again_on_new_ports_when_one_could_not_listen(monkeypatch, tmp_path):
  """Worker 1's port, chosen free, is taken by another listener before its server starts: that
  worker fails with TensorFlow's "Could not start gRPC server", and both start again on new
  ports."""
  import socket  # pylint: disable=g-import-not-at-top
  held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  held.bind(("", 0))
  held.listen()
  port = held.getsockname()[1]
  real = collective_cluster.free_ports
  calls = []

  def first_with_a_taken_port(n, host="127.0.0.1"):
    calls.append(n)
    ports = real(n, host)
    return ports if len(calls) > 1 else [ports[0], port]

  monkeypatch.setattr(collective_cluster, "free_ports", first_with_a_taken_port)
  try:
    addresses = collective_cluster.run_collective_cluster(
        f"{_HERE}:serve_on_my_address", num_workers=2, timeout_s=120, log_dir=str(tmp_path))
  finally:
    held.close()
  assert calls == [2, 2]
  assert len(set(addresses)) == 2 and f"127.0.0.1:{port}" not in addresses
