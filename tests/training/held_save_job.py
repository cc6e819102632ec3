"""The training binary, run unsupervised, whose Nth periodic checkpoint save finds its parameter
servers stopped (SIGSTOP): a save held by servers that live and do not answer, as a stalled link
or a partitioned coordinator holds it (measured by the chaos drill: a 25 s partition of the
coordinator that began during a save). Run as its own process by
tests/training/test_save_watch.py:

  python held_save_job.py <held save: 1, 2, ...> <file for the stopped pids> <train.py flags>

The stopped servers' pids go to the file, so that the test can let them go on (they end once
they see their job gone).
"""

import os
import runpy
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # as the binary sets it, before TensorFlow

from benchmarks import process_tree  # noqa: E402
from tf_gba.training import runner  # noqa: E402

_TRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "examples", "train.py")


def main() -> None:
  held_at, pids_file, flags = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
  save = runner._Job.save_checkpoint  # pylint: disable=protected-access
  periodic_saves = []

  def save_checkpoint(job, periodic: bool = False) -> str:
    if periodic:
      periodic_saves.append(1)
      if len(periodic_saves) == held_at:
        stopped = [pid for name, pid in process_tree.servers(os.getpid()).items()
                   if name.startswith("ps:")]
        with open(pids_file, "w") as f:
          f.write(" ".join(map(str, stopped)))
        for pid in stopped:
          os.kill(pid, signal.SIGSTOP)
    return save(job, periodic=periodic)

  runner._Job.save_checkpoint = save_checkpoint  # pylint: disable=protected-access
  sys.argv = [_TRAIN] + flags
  runpy.run_path(_TRAIN, run_name="__main__")


if __name__ == "__main__":
  main()
