"""Which steps of a scheduled function have run: a function run again after a worker failure
skips them.

ParameterServerStrategy's coordinator runs a function again on another worker when the worker
running it fails, with the same arguments. A function of k worker steps (`--steps_per_execution`)
whose worker died after j of them had pushed their gradients would train those j again: j more
tokens, j more gradients, j more batches, past the run's target (k = 20: the fault drills trained
10-14 global steps past `--steps`). Each function is scheduled with a number of its own; after
each step's push it records on a parameter server (which outlives the worker) how many of its
steps are done, and a run of the same number starts after them. The record rides with the step's
gradients and is written on the server right after their pushes (`ride_mark`), so a worker that
dies once it has sent them loses nothing; one that dies between a push and a record it sends on
its own (gradients on more than one server, or an optimizer that packs none) leaves one step to
be trained again, as a failed one-step function does.

Numbers are kept in `SLOTS` slots (number modulo SLOTS, with the number itself, so a slot reused
by a later function is not mistaken for this one's): a re-run whose slot was reused since runs
all its steps, as it would without the ledger. SLOTS is far above the functions a run has in
flight (the binary's pipelining holds two logging intervals).
"""

import itertools
import threading

import tensorflow as tf

from tf_gba.distribute import step_context

SLOTS = 4096


class RerunLedger:
  """Create under the strategy's scope: the ledger is a parameter server's variable.

  Not tracked by checkpoints: it describes the functions of one process of the coordinator, and a
  restarted job numbers its functions afresh.
  """

  def __init__(self):
    # [slot] -> (function number, steps done); -1: never used.
    self._done = tf.Variable(tf.fill([SLOTS, 2], tf.constant(-1, tf.int64)), trainable=False,
                             name="rerun_ledger")
    self._numbers = itertools.count()
    self._lock = threading.Lock()

  def next_number(self) -> tf.Tensor:
    """A number for the next scheduled function (on the coordinator)."""
    with self._lock:
      return tf.constant(next(self._numbers), tf.int64)

  def start(self, number) -> tf.Tensor:
    """In the function: the steps a previous run of `number` completed (0 on a first run), and
    the slot claimed for this run."""
    number = tf.cast(number, tf.int64)
    slot = number % SLOTS
    row = tf.gather(self._done, slot)
    done = tf.where(tf.equal(row[0], number), row[1], tf.constant(0, tf.int64))
    claimed = self._done.scatter_update(
        tf.IndexedSlices(tf.stack([number, done])[tf.newaxis], slot[tf.newaxis]))
    with tf.control_dependencies([claimed.op]):
      return tf.identity(done)

  def mark(self, number, steps_done) -> tf.Operation:
    """In the function, after a step's push: `steps_done` of `number`'s steps have run."""
    # One transfer to the parameter server per step: slot, number and count as one tensor (each
    # of the worker's tensors the update used travelled on its own), gathered there, not sliced
    # (Grappler rewrites a slice of a stack into the stacked tensor, which then travels alone).
    # The caller's control dependencies stay on the worker: `sent` carries them; on the server's
    # ops each would be a transfer too.
    sent = self._row(number, steps_done)
    with tf.control_dependencies(None), tf.device(self._done.device):
      return self._write(sent)

  def ride_mark(self, number, steps_done) -> None:
    """In the step (inside the strategy's `run`): marks it done once its gradients are pushed.

    The mark rides with the step's gradients where the optimizer packs them (GBA, every gradient
    to the ledger's server), and is written there after the pushes: no transfer of its own, and
    none back. Otherwise it is sent on its own once the optimizer's pushes are done.
    """
    row = tf.reshape(tf.bitcast(self._row(number, steps_done), tf.float32), [-1])
    step_context.ride(self._done.device, row,
                      lambda there: self._write(tf.bitcast(tf.reshape(there, [3, 2]), tf.int64)),
                      after_pushes=True)

  @staticmethod
  def _row(number, steps_done) -> tf.Tensor:
    number = tf.cast(number, tf.int64)
    return tf.stack([number % SLOTS, number, tf.cast(steps_done, tf.int64)])

  def _write(self, sent) -> tf.Operation:
    """On the ledger's server: `sent` (slot, number, steps done) into its slot."""
    return self._done.scatter_update(
        tf.IndexedSlices(tf.gather(sent, [[1, 2]]), tf.gather(sent, [0]))).op

  def read(self, number) -> int:
    """Steps `number` completed, as recorded (-1: its slot holds another function's)."""
    row = self._done.numpy()[int(number) % SLOTS]
    return int(row[1]) if int(row[0]) == int(number) else -1
