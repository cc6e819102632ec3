"""Straggler profiles: real, reproducible slowdowns inside each worker's step.

A profile is chosen by a string (the training binary's `--stragglers` flag):

  none                      no slowdown
  timed                     no slowdown, but every step is timed (its own seconds counted, as
                            under a profile): what `--mode=auto` runs without one, so that it
                            measures each worker's step time
  persistent:3              worker 0 runs 3x slower; `persistent:3@0,2` workers 0 and 2
  transient:0.2:4           every step of every worker is 4x slower with probability 0.2
  trace:/path/trace.json    {"window_seconds": 5, "workers": {"1": [1, 3, 3, 1]}}: worker 1 is
                            1x, 3x, 3x, then 1x slower in consecutive 5 s windows (the last
                            factor holds afterwards)
  transient:0.1:3+persistent:2@1   several at once; factors multiply
  compute:40+transient:0.2:4       every step takes at least 40 ms (before its slowdown)

A slowdown of s sleeps (s - 1) x the step's own measured time on the worker itself
(`GBA>StepEnd`). Where the step sleeps is the placement (`DELAY_PLACEMENTS`, the binary's
`--straggler_delay`):

  after_push    at the end of the step, after its gradient was pushed: the worker is slow to
                take its next batch (a slow input reader, a busy host between steps). Its
                gradients arrive on time, so they are no staler than a fast worker's.
  before_push   between computing the gradient and pushing it: a slow machine, whose gradient
                arrives late and was computed on parameters that others have moved on since, so
                it is stale. Needs the GBA optimizer's push (`tf_gba.optimizers.GBA`).

Transient draws hash (seed, worker, step): the same seed gives the same slow steps.

`compute:<ms>` emulates workers on machines of their own: a step whose own compute took less than
ms milliseconds is padded (sleeping) to ms, and the slowdown then stretches that. On a small
machine running many worker processes, the real compute time is mostly time spent waiting for
a shared core, and a sleeping straggler hands its core to the others; with a compute floor well
above the real compute time, throughput shows how each mode waits for slow workers instead.
"""

import json
import os
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from tf_gba.common import autograph
from tf_gba.ops import loader

WORKER_DEVICE = "/job:worker/replica:0/task:{}/device:CPU:0"

AFTER_PUSH = "after_push"
BEFORE_PUSH = "before_push"
DELAY_PLACEMENTS = (AFTER_PUSH, BEFORE_PUSH)

# The canonical profile that slows nothing but times every step (`timed_step_start`).
TIMED = "timed"


def check_placement(placement: str) -> str:
  """`placement` if it is one of `DELAY_PLACEMENTS`; else ValueError naming the flag."""
  if placement not in DELAY_PLACEMENTS:
    raise ValueError(f"--straggler_delay must be one of {', '.join(DELAY_PLACEMENTS)}, got "
                     f"{placement!r}.")
  return placement


def _factor(text: str, what: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise ValueError(f"{what}: {text!r} is not a number.") from None
  if value < 1.0:
    raise ValueError(f"{what}: a slowdown factor must be >= 1, got {value}.")
  return value


def parse(spec: str) -> str:
  """Turns a user's profile string into the op's canonical form; raises ValueError if bad."""
  spec = (spec or "none").strip()
  if spec in ("none", TIMED):
    return spec
  parts: List[str] = []
  for item in spec.split("+"):
    kind, _, rest = item.strip().partition(":")
    if kind == "persistent":
      factor, _, workers = rest.partition("@")
      f = _factor(factor, f"straggler profile {item!r}")
      try:
        ids = [int(w) for w in workers.split(",")] if workers else [0]
      except ValueError:
        raise ValueError(f"straggler profile {item!r}: workers after '@' must be integers, "
                         "e.g. persistent:3@0,2") from None
      parts.append("persistent;" + ",".join(f"{w}={f}" for w in ids))
    elif kind == "transient":
      fields = rest.split(":")
      if len(fields) != 2:
        raise ValueError(f"straggler profile {item!r}: expected transient:<p>:<factor>, "
                         "e.g. transient:0.2:4")
      p = float(fields[0])
      if not 0.0 <= p <= 1.0:
        raise ValueError(f"straggler profile {item!r}: probability must be in [0, 1].")
      parts.append(f"transient;{p};{_factor(fields[1], item)}")
    elif kind == "compute":
      try:
        ms = float(rest)
      except ValueError:
        ms = -1.0
      if not ms > 0:
        raise ValueError(f"straggler profile {item!r}: expected compute:<milliseconds> with a "
                         "positive number, e.g. compute:40")
      parts.append(f"compute;{ms}")
    elif kind == "trace":
      if not os.path.exists(rest):
        raise ValueError(f"straggler trace file {rest!r} does not exist.")
      with open(rest) as f:
        trace = json.load(f)
      window = float(trace.get("window_seconds", 0))
      workers: Dict[str, List[float]] = trace.get("workers", {})
      if window <= 0 or not isinstance(workers, dict):
        raise ValueError(f"straggler trace {rest!r}: needs a positive 'window_seconds' and a "
                         "'workers' object mapping worker index to a list of factors.")
      entries = []
      for w, factors in workers.items():
        fs = [_factor(str(x), f"trace {rest!r} worker {w}") for x in factors]
        entries.append(f"{int(w)}=" + ":".join(str(x) for x in fs))
      parts.append(f"trace;{window};" + ",".join(entries))
    else:
      raise ValueError(f"Unknown straggler profile {item!r}; expected none, timed (alone), "
                       "persistent:<factor>[@workers], transient:<p>:<factor>, trace:<file.json> "
                       "or compute:<ms> (join several with '+').")
  return "+".join(parts)


def named_workers(spec: str) -> List[int]:
  """The worker indices a profile names (persistent:<f>@w,..., a trace's workers)."""
  out = set()
  for part in parse(spec).split("+"):
    fields = part.split(";")
    if fields[0] == "persistent":
      out.update(int(e.partition("=")[0]) for e in fields[1].split(",") if e)
    elif fields[0] == "trace":
      out.update(int(e.partition("=")[0]) for e in fields[2].split(",") if e)
  return sorted(out)


@autograph.framework_function
def _ops():
  return loader.load_op_library("gba")


def step_begin():
  return _ops().gba_step_begin()


def step_end(start_ns, profile: str, seed: int):
  # `timed` is the op's empty profile: factor 1, no compute floor, the step only measured.
  return _ops().gba_step_end(start_ns, profile="none" if profile == TIMED else profile, seed=seed)


def timed(profile: str) -> str:
  """`profile` (canonical) with every step timed: `timed` for `none`, else itself (a profile's
  steps are timed already)."""
  return TIMED if profile == "none" else profile


@autograph.framework_function
def timed_step_start(profile: str):
  """Where a step starts: its start time under a straggler profile (`profile` canonical, from
  `parse`); None without one, so that such a step carries no timing or delay op."""
  return None if profile == "none" else step_begin()


@autograph.framework_function
def timed_step_end(start, profile: str, seed: int):
  """Where a step ends (after `timed_step_start`): under a profile the straggler delay, slept and
  counted (`GBA>StepEnd`); without one only the step count (`GBA>StepCount`, what the per-worker
  step statistics read). Either output orders what must follow the step."""
  if start is None:
    return _ops().gba_step_count()
  return step_end(start, profile, seed)


_ALL_WORKER_STATS = {}  # num_workers -> function reading every worker's counters at once
# Seconds a read of one worker's counters is waited for once the read of all of them went
# unanswered (`worker_step_stats` with a deadline).
_ALONE_S = 0.5


def _read_all_worker_stats(num_workers: int) -> Optional[np.ndarray]:
  """Every worker's counters as rows of one array, read by one function call (one round trip
  per worker instead of two, all at once); None where a worker cannot be reached."""
  read = _ALL_WORKER_STATS.get(num_workers)
  if read is None:

    @tf.function
    def read():
      rows = []
      for i in range(num_workers):
        with tf.device(WORKER_DEVICE.format(i)):
          rows.append(_ops().gba_worker_step_stats())
      return tf.stack(rows)

    read = _ALL_WORKER_STATS[num_workers] = read
  try:
    return read().numpy()
  except tf.errors.OpError:
    return None


def _read_one_worker(i: int) -> Optional[List[int]]:
  """Worker i's counters alone, or None where it fails (a worker restarted after its process
  died is not a device of this eager context any more: the training closures reach it through
  the coordinator, and the dead process's counters are gone with it)."""
  try:
    with tf.device(WORKER_DEVICE.format(i)):
      return [int(x) for x in _ops().gba_worker_step_stats().numpy()]
  except tf.errors.OpError:
    return None


def worker_step_stats(num_workers: int, calls=None) -> List[dict]:
  """Reads each worker process's step counters (eagerly, from the coordinator).

  `calls`: a `tf_gba.common.bounded_calls.BoundedCalls`, to wait for each worker only up to its
  deadline; a worker that did not answer by then (its link stalled) is marked `unreachable` and
  `no_answer`. Without it, a read waits for every worker however long it takes.
  """
  rows: List[Optional[List[int]]] = [None] * num_workers
  no_answer = [False] * num_workers
  if calls is None:
    together = _read_all_worker_stats(num_workers)
  elif calls.in_flight("all"):
    together = None  # a worker did not answer the last read of all of them: one at a time
  else:
    answered, together = calls.call("all", lambda: _read_all_worker_stats(num_workers))
    together = together if answered else None
  if together is not None:
    rows = [[int(x) for x in together[i]] for i in range(num_workers)]
  elif calls is None:
    rows = [_read_one_worker(i) for i in range(num_workers)]  # a restarted one fails alone
  else:
    # Something did not answer the read of all of them: each alone, briefly, names which.
    answers = calls.call_many({i: (lambda i=i: _read_one_worker(i)) for i in range(num_workers)},
                              deadline_s=min(calls.deadline_s, _ALONE_S))
    for i, (answered, row) in answers.items():
      rows[i], no_answer[i] = row, not answered
  out = []
  for i, stats in enumerate(rows):
    if stats is None:
      # Zeros, marked: the worker failed (restarted) or did not answer in time.
      out.append({"worker": i, "steps": 0, "busy_seconds": 0.0, "delay_seconds": 0.0,
                  "first_step_unix": 0.0, "unreachable": True, "no_answer": no_answer[i],
                  "position_step": None, "position_elapsed_ns": None,
                  "max_step_seconds": 0.0})
      continue
    steps, busy, delay, first = stats[:4]
    out.append({"worker": i, "steps": steps, "busy_seconds": busy * 1e-9,
                "delay_seconds": delay * 1e-9, "first_step_unix": first * 1e-9,
                # Where the worker is in its straggler sequence (resumptions included).
                "position_step": stats[4], "position_elapsed_ns": stats[5],
                # The longest timed step, own time plus delay (0 where no step was timed).
                "max_step_seconds": stats[6] * 1e-9})
  return out


def in_step_seconds(stats: dict) -> float:
  """Seconds a worker spent inside its steps, from its step counters (`worker_step_stats`): its
  own compute and the injected delay."""
  return stats["busy_seconds"] + stats["delay_seconds"]


def set_positions(steps, elapsed_ns) -> None:
  """Sets each worker's straggler position (from the coordinator, eagerly): worker i's next step
  draws as step steps[i], and its trace clock reads elapsed_ns[i] (a resumed run's checkpoint)."""
  for i, (step, elapsed) in enumerate(zip(steps, elapsed_ns)):
    with tf.device(WORKER_DEVICE.format(i)):
      _ops().gba_set_step_position(tf.constant(int(step), tf.int64),
                                   tf.constant(int(elapsed), tf.int64))


def slowdown_factors(workers, steps, elapsed_seconds, profile: str, seed: int):
  """The factors `step_end` applies to step steps[i] of worker workers[i], started
  elapsed_seconds[i] after that worker's first step, without sleeping; and the profile's compute
  floor in seconds (0 if none). `profile` is canonical (from `parse`). For the cluster simulator."""
  factors, floor = _ops().gba_straggler_factors(
      tf.constant(workers, tf.int64), tf.constant(steps, tf.int64),
      tf.constant(elapsed_seconds, tf.float64), profile="none" if profile == TIMED else profile,
      seed=seed)
  return factors.numpy(), float(floor.numpy())
