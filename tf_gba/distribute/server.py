"""Entry point of a parameter server or worker process: a TF server with tf_gba's ops loaded.

Every process of a GBA job must load the op libraries (PS run the kernels, workers place them),
so PS and workers are started through this module rather than a bare `tf.distribute.Server`:

  python -m tf_gba.distribute.server                 # role and cluster from TF_CONFIG
  python -m tf_gba.distribute.server --cluster_spec='{"ps": [...], ...}' --job_name=ps \
      --task_index=0

It also runs the tf.data service servers of the shared data list (`tf_gba.data.data_list`):

  python -m tf_gba.distribute.server --job_name=tfdata_dispatcher --port=5050
  python -m tf_gba.distribute.server --job_name=tfdata_worker --port=5051 \
      --dispatcher_address=HOST:5050 --host=THIS_HOST

The process prints "TF_GBA_SERVER_READY <job>:<task>" once serving, and exits on its own when the
parent process that launched it (a LocalCluster) goes away, so no server outlives its job.
"""

import argparse
import json
import os
import sys
import threading
import time

from tf_gba.common import exiting

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _watch_parent(parent_pid: int) -> None:
  while True:
    if os.getppid() != parent_pid:
      # Orphaned: the launcher died without cleaning up. (Sync's collective workers, which trace
      # functions, watch their launcher with this too.)
      exiting.exit_now(0)
    time.sleep(1.0)


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--cluster_spec", default=None, help="JSON cluster spec (default: TF_CONFIG).")
  p.add_argument("--job_name", default=None, help="'ps' or 'worker' (default: TF_CONFIG).")
  p.add_argument("--task_index", type=int, default=None)
  p.add_argument("--inter_op_threads", type=int, default=0,
                 help="inter-op threads; blocking ops (Hop-BS barrier) need more than workers.")
  p.add_argument("--port", type=int, default=0,
                 help="tfdata_dispatcher / tfdata_worker: the port to serve on.")
  p.add_argument("--dispatcher_address", default=None,
                 help="tfdata_worker: host:port of the tf.data dispatcher.")
  p.add_argument("--host", default="127.0.0.1",
                 help="tfdata_worker: the address readers reach this worker at.")
  p.add_argument("--address", default=None,
                 help="tfdata_dispatcher / tfdata_worker: HOST:PORT to serve at (instead of "
                      "--host and --port).")
  p.add_argument("--exit_with_parent", action="store_true",
                 help="exit when the launching process goes away")
  return p.parse_args(argv)


def _serve_tfdata(args) -> int:
  """A tf.data service dispatcher or worker of the shared data list, until killed."""
  if args.address:
    host, sep, port = args.address.rpartition(":")
    if not sep or not host or not port.isdigit():
      print(f"--address must be HOST:PORT, got {args.address!r}.", file=sys.stderr)
      return 2
    args.host, args.port = host, int(port)
  if args.port < 1:
    print(f"--port must be given for {args.job_name}.", file=sys.stderr)
    return 2
  if args.job_name == "tfdata_worker" and not args.dispatcher_address:
    print("--dispatcher_address must be given for tfdata_worker.", file=sys.stderr)
    return 2
  if args.exit_with_parent:
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
  from tf_gba.data import data_list  # pylint: disable=g-import-not-at-top
  if args.job_name == "tfdata_dispatcher":
    server = data_list.start_dispatcher(args.port)
  else:
    server = data_list.start_worker(args.dispatcher_address, args.port, args.host)
  print(f"TF_GBA_SERVER_READY {args.job_name}:{args.port}", flush=True)
  # Sleep rather than server.join(): a join blocking in C++ would keep the parent watcher (a
  # Python thread) from running, and the server would outlive its launcher. (`server` stays
  # referenced here: the server stops when its object goes.)
  while server is not None:
    time.sleep(3600)
  return 0


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.job_name in ("tfdata_dispatcher", "tfdata_worker"):
    return _serve_tfdata(args)
  if args.cluster_spec is None:
    tf_config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    if "cluster" not in tf_config or "task" not in tf_config:
      print("No --cluster_spec and no TF_CONFIG with 'cluster' and 'task': nothing to serve.",
            file=sys.stderr)
      return 2
    cluster = tf_config["cluster"]
    job_name = args.job_name or tf_config["task"]["type"]
    task_index = args.task_index if args.task_index is not None else int(
        tf_config["task"]["index"])
  else:
    cluster = json.loads(args.cluster_spec)
    job_name, task_index = args.job_name, args.task_index
  if job_name not in ("ps", "worker"):
    print(f"job_name must be 'ps', 'worker', 'tfdata_dispatcher' or 'tfdata_worker', got "
          f"{job_name!r}.", file=sys.stderr)
    return 2
  if args.exit_with_parent:
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()

  import tf_gba  # pylint: disable=g-import-not-at-top,unused-import
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_gba.ops import loader  # pylint: disable=g-import-not-at-top

  loader.load_all()
  config = tf.compat.v1.ConfigProto()
  if args.inter_op_threads:
    config.inter_op_parallelism_threads = args.inter_op_threads
  server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job_name,
                                task_index=task_index, protocol="grpc", config=config,
                                start=True)
  print(f"TF_GBA_SERVER_READY {job_name}:{task_index}", flush=True)
  # Sleep rather than server.join(), as the tf.data servers above: a join blocking in C++ keeps
  # the parent watcher (a Python thread) from running, and the server would outlive its job.
  while server is not None:
    time.sleep(3600)
  return 0


if __name__ == "__main__":
  sys.exit(main())
