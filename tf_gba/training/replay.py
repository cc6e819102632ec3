"""Replay: an N-worker run reproduced exactly in one process from its timeline (SPEC section 7).

A worker's gradient depends only on the parameters it read when its step began and on its batch;
the parameter servers apply what arrives, in arrival order. Given a `Timeline` (for every worker
step i: its worker, pull time p_i, push time q_i >= p_i and token t_i, with the waits and drops of
Hop-BS and Hop-BW already in it, e.g. from `tf_gba.simulate.simulate`), `Replay.run_day` walks
the events in time order, a push before a pull at the same instant:

  * at p_i, step i takes the next batch of the data list and computes
    g_i = grad L(theta; batch_i) on the current parameters of the real Keras model, and holds it;
  * at q_i, (t_i, g_i) goes to the mode's rule through the real ops and optimizer: GBA's wrapper
    and its buffers (dense and sparse, with the decay and per-ID staleness) for gba, and the same
    wrapper with each baseline's buffer configuration (`tf_gba.distribute.modes.buffer_config_for`)
    for async (M = 1), bsp (b2), hop_bs (N) and hop_bw (N - b3 gradients of the current version,
    older ones dropped: the timeline's tokens are the versions read); sync holds the N gradients
    of one version and applies their mean with the inner optimizer. An aggregation applies the
    inner optimizer at once.

Stated approximation: a real worker reads its embedding rows during its forward pass, a little
after the dense variables, and the parameter servers take some time to apply; replay reads
everything at p_i and applies instantly.

Cost: one gradient per worker step whatever N is; memory: the gradients in flight, at most one
per worker (a worker's next pull comes after its push; `Timeline` refuses a timeline where it
does not).

This module sits in `training` (not `simulate`) because it drives the optimizers, which the
simulator's layer may not import (tests/test_import_graph.py).
"""

import dataclasses
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute import modes as modes_lib
from tf_gba.distribute import step_context
from tf_gba.ops import gba_ops
from tf_gba.optimizers.gba import GBA
from tf_gba.training import mode_registry

# Tickets below 0 are never deduplicated by the buffers: replay pushes each gradient once.
_NO_TICKET = -1


@dataclasses.dataclass
class Timeline:
  """Every worker step of a run: worker, pull time, push time, token (arrays of one length).

  Tokens count from 0 at the start of the timeline; `Replay.run_day` adds the global step the
  day starts at (the token generator after a restore or switch starts there too).
  """
  worker: np.ndarray
  pull: np.ndarray
  push: np.ndarray
  token: np.ndarray
  num_workers: int

  def __post_init__(self):
    self.worker = np.asarray(self.worker, np.int64)
    self.pull = np.asarray(self.pull, np.float64)
    self.push = np.asarray(self.push, np.float64)
    self.token = np.asarray(self.token, np.int64)
    n = self.worker.size
    if not (self.pull.size == self.push.size == self.token.size == n):
      raise ValueError(f"worker, pull, push and token must have one length, got {n}, "
                       f"{self.pull.size}, {self.push.size}, {self.token.size}.")
    if self.num_workers < 1 or (n and not 0 <= self.worker.min() <= self.worker.max()
                                < self.num_workers):
      raise ValueError(f"workers must be in [0, num_workers = {self.num_workers}).")
    if np.any(self.push < self.pull):
      i = int(np.flatnonzero(self.push < self.pull)[0])
      raise ValueError(f"step {i} pushes at {self.push[i]} before its pull at {self.pull[i]}.")
    if np.any(self.token < 0):
      raise ValueError("tokens must be >= 0.")
    # A worker runs one step at a time: its next pull is at or after its previous push.
    order = np.lexsort((self.pull, self.worker))
    same = self.worker[order][1:] == self.worker[order][:-1]
    early = same & (self.pull[order][1:] < self.push[order][:-1])
    if np.any(early):
      w = int(self.worker[order][1:][early][0])
      raise ValueError(f"worker {w} pulls a step before it pushed its previous one: a worker "
                       "holds at most one gradient.")

  def __len__(self) -> int:
    return int(self.worker.size)

  def events(self) -> List[Tuple[int, int]]:
    """(kind, step) in replay order: by time, a push (kind 0) before a pull (kind 1) at the
    same instant, then by worker."""
    n = len(self)
    times = np.concatenate([self.push, self.pull])
    kinds = np.concatenate([np.zeros(n, np.int64), np.ones(n, np.int64)])
    steps = np.concatenate([np.arange(n), np.arange(n)])
    workers = np.concatenate([self.worker, self.worker])
    order = np.lexsort((workers, kinds, times))
    return list(zip(kinds[order].tolist(), steps[order].tolist()))

  @classmethod
  def from_simulation(cls, result, num_steps: Optional[int] = None) -> "Timeline":
    """The timeline of a `tf_gba.simulate.SimResult`: its first `num_steps` worker steps in pull
    order (default: every step pushed within the simulated run)."""
    ev = result.extra["events"]
    order = np.lexsort((ev.worker, ev.start))
    if num_steps is None:
      pushed = np.zeros(ev.start.size, bool)
      pushed[result.extra["push_order"]] = True
      order = order[pushed[order]]
    else:
      if num_steps > order.size:
        raise ValueError(f"the simulation has {order.size} worker steps, fewer than "
                         f"num_steps={num_steps}: simulate more steps.")
      order = order[:num_steps]
    return cls(worker=ev.worker[order], pull=ev.start[order], push=ev.finish[order],
               token=ev.token[order], num_workers=result.num_workers)


@dataclasses.dataclass(frozen=True)
class ModeConfig:
  """A mode and its parameters, as the simulator and the real modes name them."""
  mode: str
  num_workers: int
  iota: int = 3
  num_aggregate: Optional[int] = None   # GBA's M; None: N
  bsp_aggregate: Optional[int] = None   # b2; None: the real mode's default
  hop_bw_backup: Optional[int] = None   # b3; None: the real mode's default
  sparse_normalize: str = "num_aggregate"
  decay: str = "threshold"

  def __post_init__(self):
    replayed = mode_registry.replayed_modes()  # the registry's `replayed` modes
    if self.mode not in replayed:
      raise ValueError(f"mode must be one of {replayed}, got {self.mode!r}.")
    if self.num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {self.num_workers}.")

  @property
  def m(self) -> int:
    """Gradients per global step of the mode's buffer."""
    n = self.num_workers
    if self.mode == "gba":
      return self.num_aggregate or n
    if self.mode == "async":
      return 1
    if self.mode == "bsp":
      return self.bsp_aggregate or modes_lib.default_bsp_aggregate(n)
    if self.mode == "hop_bw":
      b3 = (self.hop_bw_backup if self.hop_bw_backup is not None
            else modes_lib.default_hop_bw_backup(n))
      return n - b3
    return n  # sync, hop_bs


class _FlatFunction:
  """`fn` on a nest of tensors (IndexedSlices included), called through concrete functions whose
  inputs are the nest's tensors, flat: one per shape and dtype signature.

  Why: a `tf.function` matches its nested arguments in Python on every call, which costs more
  than running the function here (about 5 ms against 0.5 ms for a push of DeepFM's gradients);
  replay calls one for every gradient and every push. A concrete function of flat tensors skips
  that matching. Past `max_signatures` signatures (batches of ever new shapes) it falls back to
  one `tf.function` that relaxes shapes, as `reduce_retracing` does, so traces stay bounded.

  Every call passes the nest of the first (replay: one data set's features, one model's
  gradients); only the leaves' shapes and dtypes are compared, since checking the whole nest on
  every call costs as much as the matching this avoids.
  """

  def __init__(self, fn: Callable, max_signatures: int = 4):
    self._fn = fn
    self._max = max_signatures
    self._structure = None
    self._concrete: Dict[tuple, Callable] = {}
    self._fallback = tf.function(fn, reduce_retracing=True)

  def __call__(self, *args):
    if self._structure is None:
      self._structure = args
    flat = [t if isinstance(t, tf.Tensor) else tf.convert_to_tensor(t)  # NumPy batches
            for t in tf.nest.flatten(args, expand_composites=True)]
    key = tuple((t.dtype, tuple(t.shape)) for t in flat)
    call = self._concrete.get(key)
    if call is None:
      if len(self._concrete) >= self._max:
        return self._fallback(*args)
      structure = self._structure

      def flat_fn(*tensors):
        return self._fn(*tf.nest.pack_sequence_as(structure, list(tensors),
                                                   expand_composites=True))

      concrete = tf.function(flat_fn).get_concrete_function(
          *[tf.TensorSpec(t.shape, t.dtype) for t in flat])
      if hasattr(concrete, "_call_flat"):
        # TensorFlow's own entry for inputs already flat: the key above matched every input's
        # shape and dtype, and the public call would check each again (about 1 ms a call for a
        # model's ~50 inputs). The public call where a TensorFlow version lacks it.
        def call(flat, c=concrete, captured=concrete.captured_inputs):
          return c._call_flat(flat, captured)  # pylint: disable=protected-access
      else:
        def call(flat, c=concrete):
          return c(*flat)
      self._concrete[key] = call
    return call(flat)


class _ModeGBA(GBA):
  """GBA's wrapper with a baseline's buffers (the real modes' `buffer_config_for`)."""

  def __init__(self, inner, mode: str, **kwargs):
    super().__init__(inner, **kwargs)
    self._replay_mode = mode

  def buffer_config(self) -> gba_ops.BufferConfig:
    return modes_lib.buffer_config_for(self._replay_mode, super().buffer_config(),
                                       self.num_aggregate)


def _sum_rows(grads: List) -> object:
  """Sum of one variable's gradients from several workers (IndexedSlices concatenated; the
  optimizer sums duplicate rows, as it does for an all-reduced IndexedSlices)."""
  if isinstance(grads[0], tf.IndexedSlices):
    return tf.IndexedSlices(tf.concat([g.values for g in grads], 0),
                            tf.concat([g.indices for g in grads], 0), grads[0].dense_shape)
  return tf.add_n(grads)


class _SyncRule:
  """Sync: the N gradients of one version; their mean applied by the inner optimizer."""

  def __init__(self, inner, variables, num_workers: int):
    self._inner = inner
    self._variables = variables
    self._n = num_workers
    self._held: Dict[int, List] = {}
    self._apply = tf.function(self._apply_mean, reduce_retracing=True)
    self.pushes = 0

  def _apply_mean(self, grads):
    scale = 1.0 / self._n
    mean = [tf.IndexedSlices(g.values * scale, g.indices, g.dense_shape)
            if isinstance(g, tf.IndexedSlices) else g * scale for g in grads]
    self._inner.apply_gradients(zip(mean, self._variables))

  def push(self, token: int, grads) -> None:
    self.pushes += 1
    held = self._held.setdefault(token, [])
    held.append(grads)
    if len(held) == self._n:
      del self._held[token]
      self._apply([_sum_rows(list(g)) for g in zip(*held)])

  def stats(self) -> dict:
    return {"pushes": self.pushes, "mean_staleness": 0.0, "max_staleness": 0,
            "dropped_batches": 0, "staleness_histogram": [], "pending": sum(
                len(v) for v in self._held.values())}


class _BufferRule:
  """GBA and the buffered baselines: each push through the real wrapper and its buffers."""

  def __init__(self, inner, variables, config: ModeConfig, previous: "Optional[_BufferRule]"):
    kwargs = dict(num_aggregate=config.m, staleness_threshold=config.iota, decay=config.decay,
                  sparse_normalize=config.sparse_normalize)
    if config.mode == "gba":
      self.optimizer = GBA(inner, **kwargs)
    else:
      self.optimizer = _ModeGBA(inner, config.mode, **kwargs)
    self._variables = variables
    self.optimizer.build(variables)
    if previous is not None and previous.mode == config.mode:
      # A day restarting from the previous day's checkpoint: the embedding rows keep their
      # tags; gradients pending in an unfinished global batch are not saved (gba_ops).
      old = previous.optimizer.gba_state()["buffers"]
      step = int(inner.iterations.numpy())
      for entry in old.values():
        if entry["sparse"]:
          _, tags = entry["buffer"].export_state()
          self.optimizer.buffer(entry["variable"], sparse=True).import_state(step, tags)
    self.mode = config.mode
    self._apply = _FlatFunction(self._push)

  def _push(self, token, grads):
    info = step_context.StepInfo(token=token, ticket=tf.constant(_NO_TICKET, tf.int64))
    with step_context.scope(info):
      self.optimizer.apply_gradients(zip(grads, self._variables))

  def push(self, token: int, grads) -> None:
    self._apply(tf.constant(token, tf.int64), list(grads))

  def stats(self) -> dict:
    s = self.optimizer.stats()
    dense = s["dense"] or {}
    sparse = s["sparse"] or {}
    return {"pushes": dense.get("pushes", 0), "mean_staleness": dense.get("mean_staleness", 0.0),
            "max_staleness": dense.get("staleness_max", 0),
            "dropped_batches": dense.get("dropped", 0),
            "staleness_histogram": dense.get("histogram", []),
            "pending": dense.get("pending", 0),
            "sparse_dropped_rows": sparse.get("dropped", 0)}


def binary_crossentropy(labels, probs):
  return keras.losses.BinaryCrossentropy()(labels, probs)


class Replay:
  """Replays timelines on one Keras model and one inner optimizer, day after day.

  Args:
    model: a Keras model taking a batch's features and returning what `loss` reads.
    inner: the inner optimizer (tf_keras, e.g. Adam), shared by every mode as a switch shares
      it through the checkpoint: its slots and `iterations` carry from day to day.
    loss: loss(labels, outputs) -> scalar (default: binary cross-entropy on probabilities).
  """

  def __init__(self, model: keras.Model, inner: keras.optimizers.Optimizer,
               loss: Callable = binary_crossentropy):
    self.model = model
    self.inner = inner
    self.variables = list(model.trainable_variables)
    inner.build(self.variables)
    self._loss = loss
    self._grad = _FlatFunction(self._gradients)
    self._rule = None

  def _gradients(self, features, labels):
    with tf.GradientTape() as tape:
      loss = self._loss(labels, self.model(features, training=True))
    return tape.gradient(loss, self.variables)

  @property
  def global_step(self) -> int:
    return int(self.inner.iterations.numpy())

  def run_day(self, config: ModeConfig, timeline: Timeline,
              batches: Iterator) -> dict:
    """Replays `timeline` in `config.mode` on the batches of `batches` (the data list: step i
    takes the next one at its pull). Returns the day's statistics."""
    if timeline.num_workers != config.num_workers:
      raise ValueError(f"the timeline has {timeline.num_workers} workers, the mode "
                       f"{config.num_workers}.")
    start_step = self.global_step
    if config.mode == "sync":
      rule = _SyncRule(self.inner, self.variables, config.num_workers)
    else:
      previous = self._rule if isinstance(self._rule, _BufferRule) else None
      rule = _BufferRule(self.inner, self.variables, config, previous)
    self._rule = rule
    held: Dict[int, list] = {}
    max_held = 0
    batches_read = 0
    for kind, i in timeline.events():
      if kind == 1:
        features, labels = next(batches)
        batches_read += 1
        held[i] = self._grad(features, labels)
        max_held = max(max_held, len(held))
      else:
        rule.push(start_step + int(timeline.token[i]), held.pop(i))
    out = rule.stats()
    out.update(mode=config.mode, batches=batches_read, global_steps=self.global_step - start_step,
               max_held=max_held)
    return out
