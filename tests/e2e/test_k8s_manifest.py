"""examples/k8s/tfjob.yaml: a TFJob whose every role runs the project's binary or server."""

import json
import os

from absl import flags

from tests import train_binary
from tf_gba.distribute import server
from tf_gba.training import TrainConfig

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BINARY = [".venv/bin/python", "examples/train.py"]
_SERVER = [".venv/bin/python", "-m", "tf_gba.distribute.server"]


def _load_manifest():
  # JSON-compatible YAML: only whole-line comments to drop.
  with open(os.path.join(_ROOT, "examples", "k8s", "tfjob.yaml")) as f:
    text = "".join(line for line in f if not line.lstrip().startswith("#"))
  return json.loads(text)


def _binary_flags():
  train_binary.load("tf_gba_train_binary_k8s")
  return flags.FLAGS


def test_manifest_is_a_tfjob_with_chief_ps_and_workers():
  job = _load_manifest()
  assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "TFJob"
  assert set(job["spec"]["tfReplicaSpecs"]) == {"Chief", "PS", "Worker"}


def test_every_role_runs_the_binary_or_the_server_with_flags_that_exist():
  replicas = _load_manifest()["spec"]["tfReplicaSpecs"]
  for role, spec in replicas.items():
    (container,) = spec["template"]["spec"]["containers"]
    # The operator's default container name and port: it sets TF_CONFIG from them.
    assert container["name"] == "tensorflow"
    assert {"containerPort": 2222, "name": "tfjob-port"} in container["ports"]
    command, args = container["command"], container.get("args", [])
    if role == "Chief":
      assert command == _BINARY
      assert os.path.exists(os.path.join(_ROOT, command[1]))
      fl = _binary_flags()
      for arg in args:
        name = arg[2:].split("=", 1)[0]
        assert arg.startswith("--") and name in fl, f"{role}: no flag {arg}"
      try:
        fl(["train.py", *args])  # parses every value
        assert fl.num_workers == replicas["Worker"]["replicas"]
        config = TrainConfig(mode=fl.mode, model=fl.model, num_workers=fl.num_workers,
                             steps=fl.steps, checkpoint_every_steps=fl.checkpoint_every_steps,
                             keep_checkpoints=fl.keep_checkpoints)
        config.validate()
      finally:
        fl.unparse_flags()
    else:
      assert command == _SERVER
      assert os.path.exists(os.path.join(_ROOT, "tf_gba", "distribute", "server.py"))
      server.parse_args(args)  # the server's own flags (none needed: TF_CONFIG gives the role)
    # Volumes mounted exist in the pod.
    volumes = {v["name"] for v in spec["template"]["spec"].get("volumes", [])}
    assert {m["name"] for m in container.get("volumeMounts", [])} <= volumes
