"""Each worker's place in its own shard of the input, kept in the checkpoint.

In the replicated modes (`shadow_*`, `asgd_nodelay`) worker i reads shard i of the data in a
seeded order that is the same in every run. A resumed run that started each shard again from
its beginning would train the batches before the checkpoint a second time and, within the steps
it has left, never reach the end of the data (on one Criteo day: its last hours). So the
checkpoint stores how many batches each worker had trained, with the day and the local batch
size they are counted in, and a resumed run (one that goes on toward an interrupted run's
target) of the same shape skips that many batches of each shard. A new run from a checkpoint
(the next day, another mode, `--steps` more after a finished run) starts every shard afresh, as
the shared data list does in the other modes. The position is a variable of the checkpoint
itself, written in the same atomic write as the parameters, so the checkpoint chosen on restore
brings its own position.
"""

from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_gba.training import resharding

_PREFIX = "shard_position"


class ShardPosition:
  """The batches each of `num_workers` shards has trained, for `day` and `batch_size`.

  `module` goes into the checkpoint (`tf.train.Checkpoint(..., shard_position=module)`); its
  variables live in this process (the coordinator), outside any strategy.
  """

  def __init__(self, num_workers: int, day: Optional[int], batch_size: int):
    self.num_workers, self.batch_size = int(num_workers), int(batch_size)
    self.day = -1 if day is None else int(day)
    self.start = np.zeros([self.num_workers], np.int64)
    self.module = tf.Module(name=_PREFIX)
    self.module.batches = tf.Variable(tf.zeros([self.num_workers], tf.int64), trainable=False,
                                      name="batches")
    self.module.day = tf.Variable(self.day, dtype=tf.int64, trainable=False, name="day")
    self.module.batch_size = tf.Variable(self.batch_size, dtype=tf.int64, trainable=False,
                                         name="batch_size")

  def restore(self, path: Optional[str], log: Callable[[str], None]) -> np.ndarray:
    """Sets `start` to the position stored in the checkpoint `path`, and returns it.

    `path`: the checkpoint an interrupted run is resumed from; None for a new run. Zeros (every
    shard from its beginning) for None, for a checkpoint with no position (another mode's) and,
    said in one line through `log`, for a position of another shape (worker count, day or local
    batch size): worker i of that run did not read this run's shard i in batches of this size.
    """
    self.start = np.zeros([self.num_workers], np.int64)
    saved = resharding.saved_module(path, _PREFIX, ("batches", "day", "batch_size"))
    if saved:
      batches, day, batch_size = saved["batches"], int(saved["day"]), int(saved["batch_size"])
      if (batches.shape == (self.num_workers,) and day == self.day
          and batch_size == self.batch_size):
        self.start = batches.astype(np.int64)
      else:
        log(f"tf_gba: the input position in {path} is of another run ({batches.shape[0]} "
            f"workers, day {day}, local batch {batch_size}); every worker's shard starts "
            "from its beginning")
    self.module.batches.assign(self.start)
    return self.start

  def skip(self, dataset: tf.data.Dataset, worker: int) -> tf.data.Dataset:
    """`dataset` (worker's shard) after the batches it trained before the checkpoint."""
    n = int(self.start[worker])
    return dataset.skip(n) if n else dataset

  def record(self, trained: Sequence[int]) -> None:
    """Before a checkpoint is written: `trained[i]` batches trained by worker i in this run.

    Count only steps that have finished: a batch in flight when the checkpoint reads the
    replicas is trained again by a resumption rather than skipped.
    """
    self.module.batches.assign(self.start + np.asarray(trained, np.int64))
