"""The transfers between a worker and a parameter server in one training step, read from TF's graphs.

  python -m benchmarks.step_transfers [--mode=gba] [--trees=.] [--steps=400] [--dry_run]
                                      [binary flags ...]

A parameter server's CPU per step follows the number of tensors that cross between it and a
worker (docs/step_cost.md): each one is a `_Send`/`_Recv` pair after TF partitions the worker's
function by device, an RPC the server serves or makes. This runs a short job of the binary (1 PS,
1 worker) with TF's graph dumps on (`TF_DUMP_GRAPH_PREFIX`), reads the parameter server's
partition of the function that runs the steps, and lists its transfers: those inside the step
loop happen at every worker step, the others once per function. `--trees=new:.,old:/path` lists
each checkout's (its own binary, interleaved), for a before-and-after count.
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = ("_Send", "_Recv", "_HostSend", "_HostRecv")
# The shared data list's function (tf_gba/training/shared_input.py: `steps`) and Keras' own.
FUNCTIONS = ("__inference_steps_", "__inference_train_function_")
# Inside the step loop's frame: its body, and the control of each of its iterations (the loop's
# LoopControlInputs and LoopExecuted come once per function).
_PER_ITERATION = ("while/body/", "while/LoopCond", "while/loop_body_control")


def transfers(graph_file: str) -> List[Tuple[str, str, str, bool]]:
  """(op, direction, tensor name, in the step loop) of each transfer in a partition's graph."""
  from google.protobuf import text_format  # pylint: disable=g-import-not-at-top
  from tensorflow.core.framework import graph_pb2  # pylint: disable=g-import-not-at-top
  graph = graph_pb2.GraphDef()
  with open(graph_file) as f:
    text_format.Parse(f.read(), graph)
  out = []
  for node in graph.node:
    if node.op not in OPS:
      continue
    job = lambda key: node.attr[key].s.decode().split("/job:")[1].split("/")[0]  # pylint: disable=cell-var-from-loop
    name = re.sub(r"^edge_\d+_", "", node.attr["tensor_name"].s.decode())
    out.append((node.op, f"{job('send_device')}->{job('recv_device')}", name,
                any(part in name for part in _PER_ITERATION)))
  return out


def _partition(dump_dir: str) -> str:
  files = [f for f in glob.glob(os.path.join(dump_dir, "*after_partition_passes.pbtxt"))
           if any(os.path.basename(f).startswith(p) for p in FUNCTIONS) and "job:ps" in f]
  if not files:
    sys.exit(f"step_transfers: no parameter-server partition of the step function in {dump_dir}")
  return sorted(files, key=os.path.getsize)[-1]


def command(tree: str, mode: str, steps: int, model_dir: str, extra: List[str]) -> List[str]:
  return [sys.executable, os.path.join(tree, "examples", "train.py"), f"--mode={mode}",
          "--input=shared", f"--steps={steps}", f"--model_dir={model_dir}", "--num_ps=1",
          "--num_workers=1", "--local_batch_size=256", "--eval_examples=1024", "--export_dir=",
          *extra]


def count(tree: str, mode: str, steps: int, extra: List[str]) -> List[Tuple[str, str, str, bool]]:
  """Runs `tree`'s binary briefly with graph dumps; the step function's PS transfers."""
  work = tempfile.mkdtemp(prefix="tf_gba_transfers_")
  try:
    dump = os.path.join(work, "graphs")
    os.makedirs(dump)
    env = dict(os.environ, TF_DUMP_GRAPH_PREFIX=dump, TF_DUMP_GRAPH_NAME_FILTER="*",
               TF_DUMP_GRAPH_GROUPS="main", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([tree] + [p for p in os.environ.get(
                   "PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = command(tree, mode, steps, os.path.join(work, "m"), extra)
    run = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if run.returncode:
      sys.exit(f"step_transfers: the binary ended with exit {run.returncode}:\n"
               f"{run.stderr[-2000:]}")
    return transfers(_partition(dump))
  finally:
    shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--mode", default="gba", help="a parameter-server mode of the binary")
  p.add_argument("--steps", type=int, default=400)
  p.add_argument("--trees", default=".", help="comma-separated [name:]path of checkouts")
  p.add_argument("--dry_run", action="store_true",
                 help="check the binary's flags (its own --dry_run) and exit")
  args, extra = p.parse_known_args(argv)
  if args.steps < 1:
    p.error("--steps must be >= 1")
  trees = []
  for spec in args.trees.split(","):
    name, _, path = spec.rpartition(":")
    path = os.path.abspath(os.path.join(ROOT, path)) if path else ROOT
    if not os.path.isfile(os.path.join(path, "examples", "train.py")):
      p.error(f"--trees: {path} is no checkout of tf_gba (no examples/train.py)")
    trees.append((name or path, path))
  if args.dry_run:
    for _, path in trees:
      cmd = command(path, args.mode, args.steps, os.path.join(tempfile.gettempdir(), "m"), extra)
      print(" ".join(cmd[1:]), flush=True)
      rc = subprocess.run(cmd + ["--dry_run"], cwd=path, capture_output=True, text=True,
                          check=False).returncode
      if rc:
        p.error(f"the binary refused these flags (exit {rc}): {' '.join(cmd[2:])}")
    return 0
  rows = []
  for name, path in trees:
    found = count(path, args.mode, args.steps, extra)
    per_step = [t for t in found if t[3]]
    print(f"== {name}: {len(per_step)} transfers per worker step at the parameter "
          f"server, {len(found) - len(per_step)} per function", flush=True)
    for op, direction, tensor, _ in per_step:
      print(f"   {op:9} {direction:11} {tensor[:100]}")
    rows.append((name, len(per_step), len(found) - len(per_step)))
  print("\n| tree | transfers per worker step | per function |\n|---|---|---|")
  for name, step, function in rows:
    print(f"| {name} | {step} | {function} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
