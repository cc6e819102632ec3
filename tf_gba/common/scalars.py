"""TensorBoard scalars written together: one function call per point instead of one op each.

Each eager `tf.summary.scalar` is an op dispatch of its own (about 1 ms of CPU each); a progress
line writes ten or more, so `ScalarWriter.write` writes them in one traced function (traced once
per set of names), their values passed as one tensor. The file is flushed at most every
`flush_s` seconds (and by `flush()`): at a progress line a second, a flush per line cost the
coordinator more than the line's scalars.
"""

import time
from typing import Dict, Tuple

import tensorflow as tf

FLUSH_S = 10.0


class ScalarWriter:
  """`tf.summary.create_file_writer(logdir)`, written to by sets of named scalars."""

  def __init__(self, logdir: str, flush_s: float = FLUSH_S):
    self.writer = tf.summary.create_file_writer(logdir)
    self._functions: Dict[Tuple[str, ...], tf.types.experimental.GenericFunction] = {}
    self._flush_s = float(flush_s)
    # Flushed once now: an eager op's first run registers a function of it on every server of
    # the cluster, and a first flush that came while a worker's link was stalled waited for that
    # link (measured: the coordinator held up until the stall limit restarted the job).
    self.flush()

  def write(self, step: int, scalars: Dict[str, float], flush: bool = False) -> None:
    """Writes each `name: value` of `scalars` at `step`; flushes when `flush` or when `flush_s`
    have passed since the last flush."""
    names = tuple(scalars)
    function = self._functions.get(names)
    if function is None:

      @tf.function
      def function(step, values):
        with self.writer.as_default(step=step):
          for i, name in enumerate(names):
            tf.summary.scalar(name, values[i])

      self._functions[names] = function
    function(tf.constant(int(step), tf.int64),
             tf.constant([float(scalars[n]) for n in names], tf.float64))
    if flush or time.monotonic() - self._flushed >= self._flush_s:
      self.flush()

  def flush(self) -> None:
    self.writer.flush()
    self._flushed = time.monotonic()
