"""GBA's token and dense-buffer decisions, as the simulator takes them.

The rules of `GBA>TokenGeneratorFetch` and `GBA>DenseBufferPush` (custom_ops/gba/cc/kernels/
token_generator_op.cc, dense_buffer_op.cc and buffer_core.h), on token and step numbers only, not
on gradient values: which token a fetch gets, each push's staleness and weight, whether it takes
one of the M places of the global batch, which push completes a global step and the divisor of
that aggregate, and the buffer's statistics. tests/distribute/test_simulate.py replays a recorded event
sequence through the real ops and through this module and compares every decision.

Both the one-event methods (`fetch`, `push`) and the vectorised ones (`fetch_many`, `push_many`,
used by the simulator for millions of pushes) are here; a test checks they agree.
"""

import dataclasses
from typing import List

import numpy as np

from tf_gba.ops.gba_ops import BufferConfig


class TokenLogic:
  """The token generator: the i-th fetch (i = 0, 1, ...) gets floor(i / M)."""

  def __init__(self, num_aggregate: int, initial_count: int = 0):
    if num_aggregate < 1:
      raise ValueError(f"num_aggregate (M) must be >= 1, got {num_aggregate}.")
    self.num_aggregate = int(num_aggregate)
    self.count = int(initial_count)

  def fetch(self):
    """Returns (token, ticket) like `TokenGenerator.fetch`."""
    ticket = self.count
    self.count += 1
    return ticket // self.num_aggregate, ticket

  def fetch_many(self, n: int) -> np.ndarray:
    """Tokens of the next n fetches, in fetch order."""
    tickets = self.count + np.arange(n, dtype=np.int64)
    self.count += int(n)
    return tickets // self.num_aggregate


@dataclasses.dataclass
class PushDecisions:
  """What the buffer decided for a sequence of pushes (arrays in push order)."""
  staleness: np.ndarray     # step at push - token (may be negative; statistics clip at 0)
  weight: np.ndarray        # decay f(s); 0 means dropped
  counted: np.ndarray       # took one of the M places of a global batch
  aggregation: np.ndarray   # the global step this push is part of; -1 when not counted
  ready: np.ndarray         # this push completed a global batch
  step_after: np.ndarray    # the buffer's global step after the push (the op's 3rd output)
  divisors: List[int]       # per completed aggregation, in order: what its sum was divided by


class DenseBufferLogic:
  """The decisions of one dense buffer created with `config` at `initial_step`."""

  def __init__(self, config: BufferConfig, initial_step: int = 0):
    self.config = config
    self.step = int(initial_step)
    self.entries = 0          # places taken in the current global batch
    self.kept = 0             # of those, with a non-zero weight (divisor of normalize="kept")
    self.pushes = 0
    self.aggregations = 0
    self.dropped = 0
    self.staleness_sum = 0
    self.staleness_max = 0
    self.histogram = np.zeros(config.histogram_bins, np.int64)

  def weights(self, staleness: np.ndarray) -> np.ndarray:
    """Eq. 1: 1 up to iota; beyond it 0 (threshold) or alpha**(s - iota) (exponential)."""
    s = np.asarray(staleness, np.int64)
    iota = self.config.staleness_threshold
    if self.config.decay == "threshold":
      return np.where(s <= iota, 1.0, 0.0)
    # The op's decay_alpha attribute is a float32: decide with that value, not the Python float.
    alpha = float(np.float32(self.config.decay_alpha))
    return np.where(s <= iota, 1.0, np.power(alpha, np.maximum(s - iota, 0)))

  def _record(self, staleness: np.ndarray, weight: np.ndarray) -> None:
    s = np.maximum(staleness, 0)
    self.staleness_sum += int(s.sum())
    if s.size:
      self.staleness_max = max(self.staleness_max, int(s.max()))
    bins = self.config.histogram_bins
    self.histogram += np.bincount(np.minimum(s, bins - 1), minlength=bins)
    self.dropped += int(np.count_nonzero(weight == 0.0))
    self.pushes += int(s.size)

  def _divisor(self) -> int:
    if self.config.normalize == "num_aggregate":
      return int(self.config.num_aggregate)
    return max(1, self.kept)

  def push(self, token: int):
    """One push: returns (staleness, weight, counted, ready, step_after, divisor or None)."""
    d = self.push_many(np.array([token], np.int64))
    return (int(d.staleness[0]), float(d.weight[0]), bool(d.counted[0]), bool(d.ready[0]),
            int(d.step_after[0]), d.divisors[0] if d.divisors else None)

  def push_many(self, tokens: np.ndarray) -> PushDecisions:
    """Pushes `tokens` in order, as consecutive `GBA>DenseBufferPush` calls would."""
    tokens = np.asarray(tokens, np.int64)
    n = tokens.size
    out = PushDecisions(staleness=np.empty(n, np.int64), weight=np.empty(n),
                        counted=np.empty(n, bool), aggregation=np.empty(n, np.int64),
                        ready=np.zeros(n, bool), step_after=np.empty(n, np.int64), divisors=[])
    m = int(self.config.num_aggregate)
    count_dropped = self.config.count_dropped
    if count_dropped and self.config.normalize == "num_aggregate" and n:
      # Every push takes a place: the j-th push of this call is part of global step
      # step + (entries + j) // M, whatever is decided about it; no loop needed.
      pos = self.entries + np.arange(n, dtype=np.int64)
      agg = self.step + pos // m
      s = agg - tokens
      w = self.weights(s)
      self._record(s, w)
      ready = (pos + 1) % m == 0
      out.staleness[:] = s
      out.weight[:] = w
      out.counted[:] = True
      out.aggregation[:] = agg
      out.ready[:] = ready
      out.step_after[:] = agg + ready
      done = int(np.count_nonzero(ready))
      out.divisors.extend([m] * done)
      self.step += done
      self.aggregations += done
      self.entries = int((self.entries + n) % m)
      # Pushes after the last completed batch carry over; their kept count too.
      last_ready = int(np.flatnonzero(ready)[-1]) if done else -1
      self.kept = (self.kept if done == 0 else 0) + int(
          np.count_nonzero(w[last_ready + 1:] != 0.0))
      return out
    i = 0
    while i < n:
      need = m - self.entries
      # The global step cannot change before the batch is full: every push up to the one that
      # fills it is judged at the current step, so a whole segment is decided at once.
      window = need
      while True:
        end = min(n, i + window)
        s = self.step - tokens[i:end]
        w = self.weights(s)
        counts = np.ones(end - i, bool) if count_dropped else (w != 0.0)
        taken = np.cumsum(counts)
        if taken.size and taken[-1] >= need:
          last = int(np.searchsorted(taken, need))  # first index where the batch is full
          end = i + last + 1
          s, w, counts = s[:last + 1], w[:last + 1], counts[:last + 1]
          full = True
          break
        if end == n:
          full = False
          break
        window *= 2
      self._record(s, w)
      seg = slice(i, end)
      out.staleness[seg] = s
      out.weight[seg] = w
      out.counted[seg] = counts
      out.aggregation[seg] = np.where(counts, self.step, -1)
      out.step_after[seg] = self.step
      self.entries += int(counts.sum())
      self.kept += int(np.count_nonzero(w != 0.0))
      if full:
        out.divisors.append(self._divisor())
        out.ready[end - 1] = True
        self.entries = 0
        self.kept = 0
        self.step += 1
        self.aggregations += 1
        out.step_after[end - 1] = self.step
      i = end
    return out

  @property
  def mean_staleness(self) -> float:
    return self.staleness_sum / max(1, int(self.histogram.sum()))
