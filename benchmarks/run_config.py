"""One benchmark run, in its own process: `python -m benchmarks.run_config <TrainConfig JSON>`.

Each run starts (and tears down) its own local cluster. Its servers are forks of a fork of this
process, made before it runs an op, as the binary's are (local_cluster.prefork_forker: their
forker need not import TensorFlow again). It ends without interpreter teardown, which spares the
log what TensorFlow writes about remote handles it can no longer release.

benchmarks.switching starts it through `tf_gba.distribute.server_forker.launch`: forked from a
process that has imported TensorFlow already, a run does not import it again.
"""

import json
import sys

from tf_gba.common import exiting
from tf_gba.distribute import local_cluster
from tf_gba.training import TrainConfig, run


def main(argv) -> None:
  config = TrainConfig(**json.loads(argv[0]))
  local_cluster.prefork_forker()
  run(config)
  exiting.exit_now(0)


if __name__ == "__main__":
  main(sys.argv[1:])
