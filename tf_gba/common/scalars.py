"""TensorBoard scalars written together: one function call per point instead of one op each.

Each eager `tf.summary.scalar` is an op dispatch of its own (about 1 ms of CPU each); a progress
line writes ten or more, so `ScalarWriter.write` writes them in one traced function (traced once
per set of names).
"""

from typing import Dict, Tuple

import tensorflow as tf


class ScalarWriter:
  """`tf.summary.create_file_writer(logdir)`, written to by sets of named scalars."""

  def __init__(self, logdir: str):
    self.writer = tf.summary.create_file_writer(logdir)
    self._functions: Dict[Tuple[str, ...], tf.types.experimental.GenericFunction] = {}

  def write(self, step: int, scalars: Dict[str, float]) -> None:
    """Writes each `name: value` of `scalars` at `step`, and flushes."""
    names = tuple(scalars)
    function = self._functions.get(names)
    if function is None:

      @tf.function
      def function(step, values):
        with self.writer.as_default(step=step):
          for name, value in zip(names, values):
            tf.summary.scalar(name, value)

      self._functions[names] = function
    function(tf.constant(int(step), tf.int64),
             [tf.constant(float(scalars[n]), tf.float64) for n in names])
    self.writer.flush()
