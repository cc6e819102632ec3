"""What the job did about a slow interval, said in one line at the progress line that ends it.

A stalled link or a slow server shows as an interval between two progress lines that took far
longer than the usual one. A synchronous job waits for its slowest worker; GBA's other workers go
on, and the stalled worker's gradients, pushed when its link is back, are judged by their
staleness. The job says which it did, so that a user reading the log need not infer it. (A stall
past --stall_timeout_s restarts the job instead: recovery.Stalled says so.)

Which worker held an interval up is judged first by how long the coordinator waited for each
worker's functions (`function_times`): a worker whose link is cut, or whose steps are stuck, has
one function that took about as long as the stall, while the others' took their usual time; when
a parameter server, the data list or every link is slow, every worker's did. Step counts alone
cannot tell: a progress line waits up to `NO_ANSWER_S` for each worker's counters, so over a short
stall the others make no more steps than the stalled one (measured, when a line waited for every
worker however long: a worker link dropped for 12 s, 38 steps in 17 s, counted as every worker
held up).

A worker that does not answer a progress line's read within `NO_ANSWER_S` (its link cut, its
process stopped) is not waited for: the line goes on without its counts, the other workers go on
until the next checkpoint, which waits for every step scheduled (so that a fault loses at most
one checkpoint interval), and `SilentWorkers` says so in one line, and again when it answers.
"""

import statistics
from typing import List, Optional, Sequence

# An interval is slow when its seconds per step are this many times the median of the last
# intervals', and it lost at least MIN_EXTRA_S to it: a busy machine's jitter (measured here:
# intervals within 1.5x of each other on a quiet machine, 2x on a loaded one) says nothing.
SLOW_FACTOR = 3.0
MIN_EXTRA_S = 5.0
# The usual interval: the median of these many last ones (the first one, with tracing, excluded).
HISTORY = 10
# A worker that made fewer than this share of the mean steps of the interval was the slow one.
BEHIND_SHARE = 0.5
# A function that took at least this share of the interval's lost seconds was held up.
HELD_SHARE = 0.5
# Seconds a progress line waits for a worker's counters before it goes on without them. A read
# takes milliseconds; a loaded 2-core machine has taken over a second to answer.
NO_ANSWER_S = 3.0


class SlowIntervalWatch:
  """Fed each progress line's time and step counts; returns the line to print, or None."""

  def __init__(self, waits_for_every_worker: bool):
    self._sync = waits_for_every_worker
    self._rates: List[float] = []  # seconds per step of the last intervals
    self._last = None  # (time, steps, per-worker steps) at the last line

  def interval(self, now: float, steps: int, per_worker: Optional[Sequence[int]] = None,
               function_s: Optional[Sequence[float]] = None,
               checkpoint_s: float = 0.0) -> Optional[str]:
    """`steps`: worker steps finished so far; `per_worker`: each worker's (None: not known);
    `function_s`: each worker's longest function since the last line (None: not known);
    `checkpoint_s`: the seconds the coordinator spent writing checkpoints since the last line."""
    last, self._last = self._last, (now, steps, list(per_worker) if per_worker else None)
    if last is None or steps <= last[1]:
      return None
    seconds, made = now - last[0], steps - last[1]
    rate = seconds / made
    usual = statistics.median(self._rates) if len(self._rates) >= 2 else None
    self._rates = (self._rates + [rate])[-HISTORY:]
    lost = seconds - usual * made if usual is not None else 0.0
    if usual is None or rate < SLOW_FACTOR * usual or lost < MIN_EXTRA_S:
      return None
    head = (f"tf_gba: the last {made} steps took {seconds:.0f} s, {rate / usual:.0f}x the usual "
            f"({usual * made:.1f} s)")
    if self._sync:
      return f"{head}: waited for the slowest worker (sync: every step waits for every worker)."
    made_each = None
    if per_worker and last[2] and len(last[2]) == len(per_worker):
      made_each = [max(0, b - a) for a, b in zip(last[2], per_worker)]
    held = None
    if function_s and (made_each is None or len(function_s) == len(made_each)):
      held = [i for i, s in enumerate(function_s) if s >= HELD_SHARE * lost]
    if held is not None and 0 < len(held) < len(function_s):
      return self._one_held_up(head, held, function_s, made_each)
    behind = []
    if made_each is not None and held is None:
      mean = sum(made_each) / len(made_each)
      behind = [i for i, n in enumerate(made_each) if n < BEHIND_SHARE * mean]
    if behind and len(behind) < len(per_worker):
      names = ", ".join(f"worker:{i}" for i in behind)
      slow = sum(made_each[i] for i in behind)
      return (f"{head}: {names} made {slow} of them; worked around it: the other workers made "
              "the rest (its late gradients are judged by their staleness).")
    if held == []:
      if checkpoint_s >= HELD_SHARE * lost:
        # TensorFlow traces each checkpoint's save anew where the variables span several
        # servers and registers it with every server, which waits for a stalled link
        # (docs/fault_tolerance.md).
        cause = (f"a checkpoint held the coordinator {checkpoint_s:.0f} s (its save is registered "
                 "with every server, which waits for a stalled link, a worker's or a server's)")
      else:
        cause = ("the coordinator was held up (a checkpoint, a read of the servers, a busy "
                 "machine)")
      return (f"{head}: no worker's function took long (at most {max(function_s):.1f} s): "
              f"{cause}; waited for it (--stall_timeout_s restarts the job past a limit).")
    took = ""
    if held:
      lo, hi = f"{min(function_s):.0f}", f"{max(function_s):.0f}"
      took = f" (each one's longest function {lo if lo == hi else lo + '-' + hi} s)"
    return (f"{head}: every worker was held up{took} (a parameter server, the data list or every "
            "link slow); waited for it (--stall_timeout_s restarts the job past a limit).")

  @staticmethod
  def _one_held_up(head: str, held: List[int], function_s: Sequence[float],
                   made_each: Optional[List[int]]) -> str:
    """Some workers' functions were long, the others' not: those held the interval up."""
    names = ", ".join(f"worker:{i}" for i in held)
    others = max(s for i, s in enumerate(function_s) if i not in held)
    longest = max(function_s[i] for i in held)
    count = ""
    if made_each is not None:
      count = f" made {sum(made_each[i] for i in held)} of them and"
    return (f"{head}: {names}{count} held it up (a function of {longest:.0f} s, the others' at "
            f"most {others:.1f} s); worked around it: the other workers made their steps (a "
            f"progress line waits up to {NO_ANSWER_S:.0f} s for a worker's counters; its late "
            "gradients are judged by their staleness).")


class SilentWorkers:
  """Says when workers stop answering a progress line's reads, and when they answer again.

  Fed each progress line's workers that did not answer (`no_answer`), how long each worker's
  function has run (`GBAStrategy.running_seconds`) and the global step; returns the lines to
  print. A worker stops answering when its link or its process stalls: its function, which
  started before, has run about as long.
  """

  def __init__(self):
    self._since = {}  # worker -> (time its silence began, the global step then)

  @property
  def silent(self) -> List[int]:
    return sorted(self._since)

  def update(self, now: float, no_answer: Sequence[int], running_s: Optional[Sequence[float]],
             global_step: int) -> List[str]:
    lines = []
    new = [i for i in no_answer if i not in self._since]
    if new:
      running = list(running_s or [])
      ran = {i: running[i] if i < len(running) else 0.0 for i in new}
      others = [s for i, s in enumerate(running) if i not in no_answer]
      for i in new:
        self._since[i] = (now - ran[i], global_step)
      names = ", ".join(f"worker:{i}" for i in new)
      took = f"its function has run {max(ran.values()):.0f} s"
      if others:
        took += f", the others' at most {max(others):.1f} s"
      lines.append(
          f"tf_gba: {names} did not answer in {NO_ANSWER_S:.0f} s ({took}: its link or its "
          "process stalled); worked around it until the next checkpoint, which waits for it: the "
          "other workers go on, and its late gradients will be judged by their staleness.")
    back = [i for i in sorted(self._since) if i not in no_answer]
    for i in back:
      began, step = self._since.pop(i)
      lines.append(f"tf_gba: worker:{i} answers again after {now - began:.0f} s; "
                   f"{max(0, global_step - step)} global steps were made without it.")
    return lines
