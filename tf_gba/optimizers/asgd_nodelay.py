"""Asynchronous SGD without gradient delay (SPEC section 5, seed 003 Algorithms 1 and 2).

Each worker trains its own copy x of the dense parameters, starting from the last parameter-server
model it received (x_init), and keeps its model update delta = x - x_init. A master merges when
every worker has at least one local gradient: it takes every worker's update (the worker then
counts its update from where it is: x_init = x), adds their mean to the PS model, and sends the
new model back. A worker that receives it rebases: x = PS.x + (x - x_init), x_init = PS.x, and its
staleness becomes the number of local gradients not yet in the PS model. A worker whose staleness
reaches tau waits for the next PS model before its next step.

Algorithm 2 is the synchronised variant: in cycles of beta = tau / 2 local steps, at each cycle
boundary the worker waits for the PS model of the previous boundary's merge, hands in its update
(beta gradients), and continues from PS.x + update.

`AsgdWorker` / `AsgdMaster` hold the state of Algorithm 1 on TF variables (the worker's x are the
variables it trains, x_init variables of its own beside them), `Alg2Worker` that of Algorithm 2.
What runs when (threads, waits) is the runtime's business; these only do the arithmetic and the
counting, so tests can drive them with fixed gradient sequences.
"""

from typing import List, Sequence

import tensorflow as tf

from tf_gba.distribute.shadow_runtime import completed_function


def check_tau(tau: int, algorithm: int = 1) -> int:
  tau = int(tau)
  if tau < 1:
    raise ValueError(f"tau (maximal staleness) must be >= 1, got {tau}.")
  if algorithm == 2 and tau % 2:
    raise ValueError(f"Algorithm 2 runs cycles of tau / 2 steps: tau must be even, got {tau}.")
  if algorithm not in (1, 2):
    raise ValueError(f"algorithm must be 1 or 2, got {algorithm}.")
  return tau


def merge_values(ps_x: Sequence, deltas: Sequence[Sequence]) -> List:
  """PS.x + (1 / |W|) sum_w delta_w (pure)."""
  if not deltas:
    raise ValueError("a merge needs the updates of at least one worker.")
  n = float(len(deltas))
  return [tf.convert_to_tensor(p) + tf.add_n([tf.convert_to_tensor(d[k]) for d in deltas]) / n
          for k, p in enumerate(ps_x)]


def _like(var: tf.Variable, name: str) -> tf.Variable:
  with tf.device(var.device):
    return tf.Variable(tf.identity(var.read_value()), trainable=False, name=name)


class AsgdWorker:
  """One worker of Algorithm 1: its x (the variables it trains) and x_init beside them.

  Counters: `i` local gradients so far, `i_init` the value of `i` at the last hand-in,
  `staleness` local gradients past the last PS model received (tau until the first model: the
  worker must wait for it).
  """

  def __init__(self, x: Sequence[tf.Variable], tau: int, name: str = "asgd"):
    self.tau = check_tau(tau)
    self.x = list(x)
    self.x_init = [_like(v, f"{name}_x_init_{k}") for k, v in enumerate(self.x)]
    # The update handed in, kept in variables beside x: the master reads them from its own
    # function (no tensor handle passes from one remote call to another).
    self.delta = [_like(v, f"{name}_delta_{k}") for k, v in enumerate(self.x)]
    self.i = 0
    self.i_init = 0
    self.staleness = self.tau
    self.received = 0  # PS models received
    # Hand-offs between devices: each returns once its assignments are done.
    self._take = completed_function(self._take_fn)
    self._receive = completed_function(self._receive_fn)

  @property
  def must_wait(self) -> bool:
    """True when the next step has to wait for a new PS model (staleness reached tau)."""
    return self.staleness >= self.tau

  @property
  def has_update(self) -> bool:
    """At least one local gradient not handed in yet (what the master waits for)."""
    return self.i > self.i_init

  def note_step(self) -> None:
    """Counts one local gradient step (Algorithm 1 line 17); call after applying it to x."""
    if self.must_wait:
      raise RuntimeError(f"a local step at staleness {self.staleness} >= tau={self.tau}: the "
                         "worker had to wait for a new PS model first.")
    self.i += 1
    self.staleness += 1

  def _take_fn(self):
    for x, x0, d in zip(self.x, self.x_init, self.delta):
      value = x.read_value()
      d.assign(value - x0.read_value())
      x0.assign(value)

  def take_update(self) -> List[tf.Variable]:
    """Hands in delta = x - x_init and restarts the update from here (Algorithm 1 lines 21-23).

    Returns the variables holding the update (valid until the next hand-in)."""
    self._take()
    self.i_init = self.i
    return self.delta

  def _receive_fn(self, ps_x):
    for x, x0, p in zip(self.x, self.x_init, ps_x):
      p = tf.convert_to_tensor(p)
      # x = PS.x + (x - x_init), as an increment: nothing of x is lost if it moved meanwhile.
      x.assign_add(p - x0.read_value())
      x0.assign(p)

  def receive(self, ps_x: Sequence) -> None:
    """Rebases onto a new PS model (Algorithm 1 lines 8-11); `ps_x`: variables or tensors."""
    self._receive(list(ps_x))
    self.staleness = self.i - self.i_init
    self.received += 1


class AsgdMaster:
  """The PS model of Algorithm 1 (variables on the parameter servers) and its merges."""

  def __init__(self, ps_x: Sequence[tf.Variable]):
    self.ps_x = list(ps_x)
    self.version = 0
    self._merge = completed_function(self._merge_fn)

  def _merge_fn(self, deltas):
    n = float(len(deltas))
    for k, p in enumerate(self.ps_x):
      p.assign_add(tf.add_n([tf.convert_to_tensor(d[k]) for d in deltas]) / n)

  def merge(self, deltas: Sequence[Sequence]) -> None:
    """PS.x += mean of the workers' updates (lists of variables or tensors, one per worker)."""
    if not deltas:
      raise ValueError("a merge needs the updates of at least one worker.")
    self._merge([list(ds) for ds in deltas])
    self.version += 1


class Alg2Worker:
  """One worker of Algorithm 2: cycles of beta = tau / 2 local steps.

  At a cycle boundary (i % beta == 0) call `boundary(ps_x)` with the PS model of the previous
  boundary's merge (the initial model at i = 0); it returns the update handed in and sets
  x = x_init = PS.x + update.
  """

  def __init__(self, x: Sequence[tf.Variable], tau: int, name: str = "asgd2"):
    self.tau = check_tau(tau, algorithm=2)
    self.beta = self.tau // 2
    self.x = list(x)
    self.x_init = [_like(v, f"{name}_x_init_{k}") for k, v in enumerate(self.x)]
    self.delta = [_like(v, f"{name}_delta_{k}") for k, v in enumerate(self.x)]
    self.i = 0
    self.cycle = -1  # boundaries passed - 1
    self._boundary = completed_function(self._boundary_fn)

  @property
  def at_boundary(self) -> bool:
    return self.i % self.beta == 0 and self.cycle < self.i // self.beta

  @property
  def staleness(self) -> int:
    """Local gradients in x past the last PS model received."""
    into = self.i - max(self.cycle, 0) * self.beta
    return into + (self.beta if self.cycle >= 1 else 0)

  def _boundary_fn(self, ps_x):
    for x, x0, dv, p in zip(self.x, self.x_init, self.delta, ps_x):
      p = tf.convert_to_tensor(p)
      value = x.read_value()
      d = value - x0.read_value()
      dv.assign(d)
      x.assign_add(p + d - value)  # x = PS.x + delta, keeping anything that moved x meanwhile
      x0.assign(p + d)

  def boundary(self, ps_x: Sequence) -> List[tf.Variable]:
    """Returns the variables holding the update handed in (valid until the next boundary)."""
    if not self.at_boundary:
      raise RuntimeError(f"step {self.i} is not a cycle boundary (beta={self.beta}).")
    self.cycle = self.i // self.beta
    self._boundary(list(ps_x))
    return self.delta

  def note_step(self) -> None:
    if self.at_boundary:
      raise RuntimeError(f"step {self.i} is a cycle boundary: call boundary() first.")
    self.i += 1
