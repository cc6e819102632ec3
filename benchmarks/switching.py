"""AUC after switching modes, QPS, staleness and drops: the paper's evaluation in one command.

  python -m benchmarks.switching [--data=synthetic] [--days=4] [--seeds=2]
                                 [--modes=sync,gba,async,bsp,hop_bs,hop_bw]
                                 [--stragglers=transient] [--base_days=1] [--steps_per_day=auto]
                                 [--input=shared] [--out=runs/bench_switching]
  python -m benchmarks.switching --data=movielens100k:/path/to/ml-100k --days=4 --seeds=2
  python -m benchmarks.switching --data=criteo:/path/to/criteo_sample --days=4   # pseudo-days
  python -m benchmarks.switching --sweep --num_workers=8 --stragglers=dedicated

Protocol (SPEC section 1, "Switching" and "What the paper measures"):

* The data is split into `--days` consecutive days (`num_days` of the synthetic, MovieLens and
  Criteo sources; MovieLens is split by time, Criteo into pseudo-days of consecutive rows in file
  order). Day `d`'s model is evaluated on day `d + 1`: every example
  of it, its train rows and then its eval rows (the next day is never trained on before that).
* Direction "sync -> mode" (the paper's Table 6.4): a base model is trained with `sync` on days
  `0 .. base_days - 1`; from its checkpoint, each mode trains day by day on days
  `base_days .. days - 2`, one run per day, each run continuing the previous day's checkpoint.
* Direction "mode -> sync" (Table 6.8): a base is trained in each mode on the base days, then
  continued with `sync` on the same days. `sync -> sync` is the same chain in both directions, so
  it runs once.
* Every run is `tf_gba.training.runner.run(TrainConfig(...))` in a fresh process (each starts its
  own local cluster: 1 PS and `--num_workers` workers, or the sync job's worker processes), with
  the same hyper-parameters in every mode: learning rate, optimizer (Adam), local batch,
  iota, straggler profile. Every run of a day trains the same number of worker steps, i.e.
  processes the same number of examples (`steps` counts local batches in every mode; a sync
  global step is one local batch on each worker); by default one pass over the day's train rows.
* `--input`: the parameter-server modes' input, `shared` (one data list that every worker
  pulls its next batch from; with the automatic day length each run is exactly one pass over the
  day, every batch trained once, and Sync trains the same pass rounded up to whole global steps,
  at most num_workers - 1 local batches more) or `sharded` (each worker repeats a static shard,
  for `steps_per_day` worker steps).
* Seeds vary the model initialisation, the input order and the straggler draws; the data stays
  the same. Tables give mean +- sample std over seeds; differences are paired per seed.
* A day too short for the workers is refused before any run starts (`short_day`): one pass over
  a day must take at least MIN_GLOBAL_STEPS global steps of num_workers x local batch, a
  `--steps_per_day` day must hold one global batch of rows. One line on stderr names the
  `--local_batch_size` that fits; exit code 2.

QPS (Table 5.2) is each "sync -> mode" run's global QPS, measured by the runner after the first
of four logging intervals (start-up and tracing excluded), averaged over the days of a seed.
Staleness and drops (Table 5.3) are the dense buffer's counters over the same runs: mean staleness
weighted by pushes, the max, and the number of dropped batches (Hop-BW: gradients of an older
version it ignored).

A source with a single day cannot follow the next-day protocol: the base and the switched run
then both train on day 0 (two passes) and the switched run is evaluated on day 0's held-out eval
split. The output says so; use it as a smoke run.

`--gba_local_batch_size` (Ba) changes the cluster's shape for GBA as the paper does (Table 5.1):
Sync runs N workers x local batch B, GBA runs Na = M = N x B / Ba workers x Ba (or
`--gba_num_workers`), keeping Sync's global batch, learning rate and optimizer; the checkpoint
moves across the switch whatever the shapes. GBA's runs then take N x B / Ba times as many worker
steps per day (rounded up to whole logging intervals), so every run of a day still sees about the
same number of examples.

`--sweep` runs each baseline at every setting of its own parameter (the paper "enumerates the
specialized hyper-parameters of each training mode and records ... its best AUC"): Hop-BS
b1 in {1, 2, 4}, BSP b2 in {N/8, N/4, N/2}, Hop-BW b3 in {1, N/8, N/4} (rounded, at least 1,
repeats dropped). A setting is a mode of its own in every table, named e.g. `bsp@2`; the sweep
table reports each baseline at its best average AUC and lists the others. A setting can also be
given directly in `--modes` (e.g. `--modes=sync,gba,bsp@2`). `gba@per_id` is GBA with the paper's
per-ID embedding divisor c(id) (`--sparse_normalize=per_id`) in place of the default M, a row of
its own beside `gba`: the divisor's ablation.

Writes `results.md`, `results.json`, `auc_per_day.png`, `qps.png` and `staleness_histogram.png`
to `--out`, and the runs themselves (checkpoints, summaries, logs) under `--out/runs`. Exits with
status 1 if a run failed (the tables then mark that mode; the error and log are in the output);
`--resume` then runs only what is missing.
"""

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

import benchmarks  # pylint: disable=g-bad-import-order
# The straggler profiles by name, shared with the QPS benchmark ("dedicated": the transient
# profile on a 100 ms compute floor per step).
from benchmarks.mode_qps import PROFILES  # pylint: disable=g-bad-import-order
from tf_gba.distribute import server_forker  # pylint: disable=g-bad-import-order
from tf_gba.training import mode_registry  # pylint: disable=g-bad-import-order

# Before TensorFlow loads (make_protocol reads the data here): no GPU probing, no INFO lines.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The modes compared by default (training/mode_registry.py: `compared`).
ALL_MODES = mode_registry.names(compared=True)
# Accepted in --modes besides ALL_MODES (not run by default): the other parameter-server modes,
# e.g. the paper's separately tuned Async.
EXTRA_MODES = tuple(m for m in mode_registry.names(mode_registry.PARAMETER_SERVER, compared=False))
# Each baseline's own parameter (a TrainConfig field), swept by --sweep.
SWEPT = {m.name: m.parameter for m in mode_registry.all_modes() if m.parameter}
# Named variants of a mode, run as rows of their own beside it (not swept): "gba@per_id" is GBA
# with the paper's per-ID embedding divisor c(id) instead of the default M (SPEC "Embeddings").
VARIANTS = {"gba": ("sparse_normalize", ("per_id",))}
# Sources whose examples carry a day (a `num_days` option); the others have one day.
DAY_SOURCES = ("synthetic", "movielens100k", "criteo")
# The synthetic default: small days so that the plain command finishes in about half an hour on
# two CPU cores, with the library's drift of the planted truth from one day to the next.
SYNTHETIC_OPTIONS = "num_examples=32768,drift=0.1"
# Logging intervals per run: the runner measures QPS after the first one.
INTERVALS = 4
# The fewest global steps (of Sync's global batch, num_workers x local batch) a day may take when
# it is one pass over its train rows. Below it a day ends before the model has learnt what the
# next day's AUC could tell apart: at N = 128 and local batch 256, the default synthetic day of
# 32,768 rows is one global step and replay's next-day AUC was 0.45-0.48, below chance. The floor
# of --steps_per_day's rounding (INTERVALS x num_workers worker steps), so a day is never shorter
# however its length is set.
MIN_GLOBAL_STEPS = INTERVALS
DIRECTIONS = ("from_sync", "to_sync")
TITLES = {"from_sync": "sync -> mode (base trained with sync, then each mode; Table 6.4)",
          "to_sync": "mode -> sync (base trained in each mode, then sync; Table 6.8)"}


@dataclasses.dataclass
class Protocol:
  """The days and sizes every run of one invocation shares."""
  data_options: str         # passed to every run (with num_days for a day-split source)
  num_days: int             # days of the split (1: a one-day source)
  base_days: List[int]      # days the base models train on
  train_days: List[int]     # days each mode trains on after the switch
  eval_days: List[int]      # the day each of them is evaluated on (the same day: one-day source)
  next_day: bool            # False for a one-day source: eval split of the same day
  train_rows: int           # train rows of the first day
  eval_examples: int        # examples each run is evaluated on
  steps_per_day: int        # worker steps (local batches) per run, in every mode
  # One pass over the day's train rows in whole global steps (num_workers local batches each):
  # what Sync trains when the parameter-server modes take one pass through the shared data list.
  pass_steps: int = 0
  # Local batches of one pass through the shared data list when a day is one pass over its train
  # rows (the shared list and no --steps_per_day); 0 when every mode runs steps_per_day.
  one_pass_batches: int = 0


class RunFailed(Exception):
  """A training run exited with an error; carries the log's tail."""


# ------------------------------------------------------------------------------------------------
# The protocol: days, sizes and the runs' configurations.

def _source_kind(data: str) -> str:
  return data.partition(":")[0].strip().lower()


def _count_rows(data: str, options: dict, split: str, day: int) -> int:
  """Examples of one split of one day, counted by reading them as the runs will."""
  return _count_rows_of(data, tuple(sorted(options.items())), split, day)


@functools.lru_cache(maxsize=None)
def _count_rows_of(data: str, options: Tuple[Tuple[str, object], ...], split: str,
                   day: int) -> int:
  # Once per process: building the reader's pipeline costs seconds (its tracing), and a process
  # that checks several command lines (--dry_run) asks for the same counts again.
  from tf_gba import data as data_lib  # pylint: disable=g-import-not-at-top
  ds = data_lib.make_dataset(data, split=split, day=day, batch_size=1 << 16, shuffle_seed=None,
                             **dict(options))
  return int(sum(int(y.shape[0]) for _, y in ds))


def make_protocol(args: argparse.Namespace) -> Protocol:
  """Splits the data into days and sizes the runs."""
  from tf_gba.training.config import TrainConfig  # pylint: disable=g-import-not-at-top
  options = args.data_options
  if options is None:
    options = SYNTHETIC_OPTIONS if _source_kind(args.data) == "synthetic" else ""
  has_days = _source_kind(args.data) in DAY_SOURCES
  if has_days:
    if args.days < args.base_days + 2:
      raise ValueError(f"--days={args.days}: need at least --base_days + 2 = "
                       f"{args.base_days + 2} days (the base days, a day after the switch and "
                       "the next day to evaluate it on).")
    options = ",".join(filter(None, [options, f"num_days={args.days}"]))
  kwargs = TrainConfig(data=args.data, data_options=options).data_kwargs()
  from tf_gba import data as data_lib  # pylint: disable=g-import-not-at-top
  num_days = data_lib.data_info(args.data, **kwargs).num_days
  if num_days == 1:
    print(f"{args.data}: one day only; smoke protocol: base and switched runs both train on "
          "day 0, the switched run is evaluated on day 0's eval split (not the next day).",
          flush=True)
    base, train, evals = [0], [0], [0]
  else:
    base = list(range(args.base_days))
    train = list(range(args.base_days, num_days - 1))
    evals = [d + 1 for d in train]
  train_rows = _count_rows(args.data, kwargs, "train", 0)
  # Enough to take all of the largest evaluation day (train and eval rows; one-day source: the
  # eval split only).
  splits = ("eval",) if num_days == 1 else ("train", "eval")
  eval_examples = max(sum(_count_rows(args.data, kwargs, split, d) for split in splits)
                      for d in set(evals))
  # Worker steps must split into INTERVALS logging intervals in every mode; a sync interval is
  # counted in global steps (num_workers local batches each).
  quantum = INTERVALS * args.num_workers
  one_pass = math.ceil(train_rows / args.local_batch_size)
  steps = args.steps_per_day or one_pass
  steps = max(quantum, quantum * math.ceil(steps / quantum))
  pass_steps = args.num_workers * math.ceil(one_pass / args.num_workers)
  return Protocol(data_options=options, num_days=num_days, base_days=base, train_days=train,
                  eval_days=evals, next_day=num_days > 1, train_rows=train_rows,
                  eval_examples=eval_examples, steps_per_day=steps, pass_steps=pass_steps,
                  one_pass_batches=one_pass if _one_pass_days(args) else 0)


def short_day(train_rows: int, num_workers: int, local_batch: int,
              steps_per_day: int) -> Optional[Tuple[str, int]]:
  """Why a day of `train_rows` rows cannot give a meaningful next-day AUC at num_workers x
  local_batch, and the largest global batch that can; None when it can.

  A day that is one pass over its rows (no --steps_per_day) must take MIN_GLOBAL_STEPS global
  steps; a day of --steps_per_day worker steps (at least that many global steps by its rounding)
  must hold one global batch, or every global step trains the day's rows more than once.
  """
  global_batch = num_workers * local_batch
  need = global_batch if steps_per_day else MIN_GLOBAL_STEPS * global_batch
  if train_rows >= need:
    return None
  shape = f"{num_workers} workers x local batch {local_batch} = {global_batch:,}"
  if steps_per_day:
    why = (f"a global batch of {shape} examples is larger than a day's {train_rows:,} train "
           "rows: every global step would train the day more than once")
  else:
    steps = train_rows / global_batch
    why = (f"a day of {train_rows:,} train rows is {steps:.2g} global step"
           f"{'' if steps == 1 else 's'} of {shape} examples, fewer than {MIN_GLOBAL_STEPS}: its "
           "next-day AUC cannot mean anything")
  return why, train_rows if steps_per_day else train_rows // MIN_GLOBAL_STEPS


# Where a day too short for the workers is lengthened (`short_day`'s refusal).
LONGER_DAYS = ("longer days (--data_options=num_examples=... for synthetic data, fewer --days for "
               "the others)")


def _day_text(p: dict, local_batch: int) -> str:
  """How long a day is, as results.md states it."""
  if not p.get("one_pass_batches"):
    return (f"{p['steps_per_day']} worker steps per day ({p['steps_per_day'] * local_batch:,} "
            f"examples; a day has {p['train_rows']:,} train rows)")
  text = (f"one pass over each day's {p['train_rows']:,} train rows: the parameter-server modes "
          f"{p['one_pass_batches']} local batches through the shared data list")
  if p.get("pass_steps"):
    text += f", Sync {p['pass_steps']} (the pass in whole global steps)"
  return text


def split_setting(name: str) -> Tuple[str, Optional[object]]:
  """"bsp@2" -> ("bsp", 2); "gba@per_id" -> ("gba", "per_id"); "gba" -> ("gba", None)."""
  mode, sep, value = name.partition("@")
  if not sep:
    return mode, None
  if mode in VARIANTS and value in VARIANTS[mode][1]:
    return mode, value
  if mode not in SWEPT or not value.isdigit():
    variants = [f"{m}@{v}" for m, (_, values) in VARIANTS.items() for v in values]
    raise ValueError(f"{name!r}: a setting is <mode>@<integer> for a mode in {sorted(SWEPT)}, "
                     f"or one of {variants}.")
  return mode, int(value)


def setting_field(mode: str) -> str:
  """The TrainConfig field a setting of `mode` sets (bsp: bsp_aggregate; gba: sparse_normalize)."""
  return SWEPT[mode] if mode in SWEPT else VARIANTS[mode][0]


def sweep_grid(num_workers: int) -> Dict[str, List[int]]:
  """The settings --sweep runs: b1, b2 and b3 over the paper-style grid for N workers."""
  n = num_workers
  frac = lambda x: max(1, round(x))  # pylint: disable=unnecessary-lambda-assignment
  grid = {"hop_bs": [1, 2, 4], "bsp": [frac(n / 8), frac(n / 4), frac(n / 2)],
          "hop_bw": [1, frac(n / 8), frac(n / 4)]}
  # Hop-BW needs N - b3 >= 1 gradients per step.
  grid["hop_bw"] = [b for b in grid["hop_bw"] if b < n]
  return {mode: sorted(set(values)) for mode, values in grid.items()}


def expand_modes(modes: Sequence[str], sweep: bool, num_workers: int) -> List[str]:
  """The modes to run: with `sweep`, each swept baseline becomes one mode per setting."""
  grid = sweep_grid(num_workers)
  out = []
  for mode in modes:
    if sweep and mode in grid:
      out += [f"{mode}@{v}" for v in grid[mode]]
    else:
      out.append(mode)
  return out


def best_settings(rows: List[dict]) -> List[dict]:
  """Per swept baseline, its settings by mean average AUC, best first (rows: an auc_table)."""
  out = []
  for mode in SWEPT:
    settings = [r for r in rows if split_setting(r["mode"])[0] == mode
                and r["average_auc"]["mean"] is not None]
    if not settings:
      continue
    ranked = sorted(settings, key=lambda r: -r["average_auc"]["mean"])
    out.append({"baseline": mode, "parameter": SWEPT[mode], "best": ranked[0]["mode"],
                "settings": [{"mode": r["mode"], "average_auc": r["average_auc"],
                              "delta_vs_gba": (r["delta_vs_gba"] or {}).get("average"),
                              "delta_vs_sync": (r["delta_vs_sync"] or {}).get("average")}
                             for r in ranked]})
  return out


def _one_pass_days(args: argparse.Namespace) -> bool:
  """Whether a day is one pass over its train rows (the shared data list, no --steps_per_day)."""
  return args.input == "shared" and not args.steps_per_day


def run_config(args: argparse.Namespace, protocol: Protocol, mode: str, seed: int, day: int,
               eval_day: Optional[int], model_dir: str) -> dict:
  """The TrainConfig (as a dict) of one run: the same hyper-parameters in every mode.

  `mode` may name a baseline's setting ("bsp@2"): the mode with that parameter.
  """
  mode, setting = split_setting(mode)
  extra = {setting_field(mode): setting} if setting is not None else {}
  steps = protocol.steps_per_day
  num_workers, local_batch = args.num_workers, args.local_batch_size
  if mode == "gba" and getattr(args, "gba_local_batch_size", None):
    # The paper's shape for GBA: Sync's global batch G = N x B over M = G / Ba local batches.
    global_batch = args.num_workers * args.local_batch_size
    local_batch = args.gba_local_batch_size
    num_workers = args.gba_num_workers or global_batch // local_batch
    extra["global_batch_size"] = global_batch
    steps = INTERVALS * math.ceil(steps * args.local_batch_size / (local_batch * INTERVALS))
  if mode == "sync" and protocol.one_pass_batches and protocol.pass_steps:
    # As many rows as the parameter-server modes' one pass, not whole logging intervals of them
    # (which added up to 4 x N - 1 local batches: 9% more rows on MovieLens-100K at 8 x 128);
    # the last logging interval is then short.
    steps = protocol.pass_steps
  # Logging intervals: worker steps in the parameter-server modes, global steps in sync.
  log_every = max(1, steps // INTERVALS // (num_workers if mode == "sync" else 1))
  # Only modes that read the shared data list (the registry's --input users) have a day mode.
  if mode_registry.reads_input(mode) and protocol.one_pass_batches:
    steps = None  # one pass over the day through the shared data list, however long it takes
  return dict(
      input=args.input,
      mode=mode, model=args.model, data=args.data, data_options=protocol.data_options,
      embedding=getattr(args, "embedding", "vocab"), num_ps=1, num_workers=num_workers, local_batch_size=local_batch,
      learning_rate=args.learning_rate, staleness_threshold=args.staleness_threshold,
      stragglers=PROFILES.get(args.stragglers, args.stragglers), straggler_seed=seed, seed=seed,
      straggler_delay=getattr(args, "straggler_delay", "after_push"), steps=steps,
      log_every=log_every, eval_examples=protocol.eval_examples, day=day,
      eval_day=eval_day if protocol.next_day else None, model_dir=model_dir, **extra)


# ------------------------------------------------------------------------------------------------
# Running: one process per run, each continuing a copy of the previous run's checkpoint.

def _latest_checkpoint(model_dir: str) -> str:
  """The prefix ("ckpt-8") the checkpoint state file of `model_dir` names as the latest."""
  with open(os.path.join(model_dir, "checkpoint")) as f:
    for line in f:
      key, _, value = line.partition(":")
      if key.strip() == "model_checkpoint_path":
        return os.path.basename(value.strip().strip('"'))
  raise RunFailed(f"{model_dir}/checkpoint names no model_checkpoint_path.")


def continue_from(previous: str, model_dir: str) -> None:
  """Makes `model_dir` a fresh directory holding only the latest checkpoint of `previous`.

  Only that checkpoint is copied, with a state file naming it alone: the next run restores it
  whatever the mode that wrote it, and cannot mistake an older one for it.
  """
  prefix = _latest_checkpoint(previous)
  os.makedirs(model_dir)
  for name in os.listdir(previous):
    if name.startswith(prefix + "."):
      shutil.copy2(os.path.join(previous, name), model_dir)
  with open(os.path.join(model_dir, "checkpoint"), "w") as f:
    f.write(f'model_checkpoint_path: "{prefix}"\nall_model_checkpoint_paths: "{prefix}"\n')


def _error_tail(log: str, limit: int = 4000) -> Tuple[str, str]:
  """(the last exception line, the last traceback) of a run's log (or the log's end)."""
  start = log.rfind("Traceback (most recent call last)")
  # From the traceback on (TF's connection errors at teardown follow it), else the log's end.
  tail = log[start:start + limit] if start >= 0 else log[-limit:]
  raised = [l.strip() for l in tail.splitlines() if re.match(r"\s*[\w.]+(Error|Exception)\b", l)]
  return (raised[-1] if raised else "no exception in the log"), tail


def run_one(config: dict, log_path: str, timeout_s: float) -> dict:
  """Runs one TrainConfig in a process of its own (benchmarks/run_config.py); returns its summary.

  Raises:
    RunFailed: the run exited with an error or timed out; the message holds the traceback.
  """
  env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  # A fork of this process's server forker (benchmarks/run_config.py), which has imported
  # TensorFlow once for every run of the invocation; a process of its own with forking off.
  proc = server_forker.launch("run_config", "benchmarks.run_config", [json.dumps(config)],
                              log_path, env, cwd=ROOT, append=False)
  try:
    code = proc.wait(timeout_s)
  except subprocess.TimeoutExpired:
    try:
      os.killpg(proc.pid, signal.SIGKILL)  # its own session: the run and the servers it forked
    except ProcessLookupError:
      pass
    proc.wait()
    code = "timeout"
  summary_path = os.path.join(config["model_dir"], "summary.json")
  if code != 0 or not os.path.exists(summary_path):
    with open(log_path, errors="replace") as f:
      raised, tail = _error_tail(f.read())
    raise RunFailed(f"{raised[:300]} (exit status {code}, limit {timeout_s:.0f} s; log "
                    f"{log_path})\n{tail}")
  with open(summary_path) as f:
    return json.load(f)


_CONFIG_FILE = "bench_config.json"


def _finished(model_dir: str, config: dict) -> Optional[dict]:
  """The summary of a run already done in `model_dir` with this very config, else None.

  The model_dir recorded is not compared: an --out directory copied or moved elsewhere (to add
  modes to a finished evaluation under a new name) is resumed too. A field at TrainConfig's
  default counts as absent, so a run recorded before the field existed (and so run with its
  default behaviour) matches a config that leaves it at the default."""
  try:
    with open(os.path.join(model_dir, _CONFIG_FILE)) as f:
      same = _comparable(json.load(f)) == _comparable(config)
    with open(os.path.join(model_dir, "summary.json")) as f:
      return json.load(f) if same else None
  except (OSError, ValueError):
    return None


def _comparable(config: dict) -> dict:
  from tf_gba.training.config import TrainConfig  # pylint: disable=g-import-not-at-top
  defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)
              if f.default is not dataclasses.MISSING}
  return {k: v for k, v in config.items()
          if k != "model_dir" and not (k in defaults and v == defaults[k])}


_KEPT = ("eval_auc", "eval_logloss", "eval_examples", "global_qps", "wall_seconds", "steps",
         "examples", "global_step", "start_global_step", "pushes", "mean_staleness",
         "max_staleness", "staleness_histogram", "dropped_batches", "ignored_gradients",
         "blocked_seconds", "final_train_loss")


class Runner:
  """Runs and records the chains of one invocation."""

  def __init__(self, args: argparse.Namespace, protocol: Protocol):
    self.args = args
    self.protocol = protocol
    self.records: List[dict] = []
    self.root = os.path.join(args.out, "runs")

  def run(self, chain: str, mode: str, seed: int, day: int, eval_day: int, previous,
          direction: str, **extra):
    """Runs one day of a chain after `previous`; returns its model_dir.

    `previous` is the model_dir of the chain's previous day, None to start from scratch, or
    False if an earlier day of the chain failed: this day is then recorded as skipped. Returns
    False (and records the failure) if this run fails.
    """
    record = {"direction": direction, "mode": mode, "seed": seed, "day": day,
              "eval_day": eval_day if self.protocol.next_day else None, **extra}
    model_dir = os.path.join(self.root, f"seed{seed}", chain, f"day{day}")
    if previous is False:  # An earlier day of this chain failed.
      self.records.append({**record, "status": "skipped", "model_dir": model_dir})
      return False
    config = run_config(self.args, self.protocol, mode, seed, day, eval_day, model_dir)
    t0 = time.time()
    summary = _finished(model_dir, config) if self.args.resume else None
    if summary is None:
      shutil.rmtree(model_dir, ignore_errors=True)
      if previous:
        continue_from(previous, model_dir)
      else:
        os.makedirs(model_dir)
      with open(os.path.join(model_dir, _CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
      try:
        summary = run_one(config, os.path.join(model_dir, "run.log"), self.args.run_timeout)
      except RunFailed as e:
        self.records.append({**record, "status": "failed", "model_dir": model_dir,
                             "config": config, "error": str(e)})
        print(f"  FAILED {chain} day {day} seed {seed}: {str(e).splitlines()[0]}", flush=True)
        return False
    else:
      record["resumed"] = True
    self.records.append({**record, "status": "ok", "model_dir": model_dir,
                         "process_seconds": time.time() - t0,
                         **{k: summary.get(k) for k in _KEPT}})
    target = (f"day {eval_day}" if self.protocol.next_day else f"the eval split of day {day}")
    print(f"  {chain:20s} seed {seed} day {day} -> {target}: "
          f"AUC {summary['eval_auc']:.4f}  logloss {summary['eval_logloss']:.4f}  "
          f"QPS {summary['global_qps']:,.0f}  staleness {summary['mean_staleness']:.2f}/"
          f"{summary['max_staleness']}  dropped {summary['dropped_batches']}  "
          f"({time.time() - t0:.0f} s)", flush=True)
    return model_dir

  def seed(self, seed: int, modes: Sequence[str]) -> None:
    """Every chain of one seed, the days interleaved over modes (slow drifts hit all alike)."""
    p = self.protocol
    bases = {}
    # --from_sync_only (shadow modes' runs): no base in the other modes, no mode -> sync chains.
    only_from_sync = getattr(self.args, "from_sync_only", False)
    for mode in ["sync"] + [m for m in modes if m != "sync" and not only_from_sync]:
      previous = None
      for day in p.base_days:
        previous = self.run(f"base_{mode}", mode, seed, day, day + 1, previous, "base",
                            base_mode=mode)
      bases[mode] = previous
    heads = {("from_sync", m): bases["sync"] for m in modes}
    heads.update({("to_sync", m): bases[m] for m in modes if m != "sync" and m in bases})
    for day, eval_day in zip(p.train_days, p.eval_days):
      for mode in modes:
        heads[("from_sync", mode)] = self.run(
            f"from_sync/{mode}", mode, seed, day, eval_day, heads[("from_sync", mode)],
            "from_sync", base_mode="sync")
        if mode != "sync" and ("to_sync", mode) in heads:
          heads[("to_sync", mode)] = self.run(
              f"to_sync/{mode}", "sync", seed, day, eval_day, heads[("to_sync", mode)],
              "to_sync", base_mode=mode)
    # sync -> sync is one chain; it is the "sync" row of both directions.
    for r in [r for r in self.records if r["direction"] == "from_sync" and r["mode"] == "sync"
              and r["seed"] == seed]:
      self.records.append({**r, "direction": "to_sync", "base_mode": "sync",
                           "shared_with": "from_sync"})


# ------------------------------------------------------------------------------------------------
# Tables.

def mean_std(values: Sequence[float]) -> dict:
  """Mean and sample standard deviation (None for fewer than two values)."""
  vals = [float(v) for v in values]
  if not vals:
    return {"mean": None, "std": None, "n": 0, "values": []}
  return {"mean": float(np.mean(vals)), "std": float(np.std(vals, ddof=1)) if len(vals) > 1
          else None, "n": len(vals), "values": vals}


def _chains(records: List[dict], direction: str, mode: str, seeds: Sequence[int],
            num_days: int) -> Dict[int, List[dict]]:
  """seed -> the chain's runs in day order, for the seeds whose chain completed every day."""
  out = {}
  for seed in seeds:
    runs = sorted((r for r in records if r["direction"] == direction and r["row"] == mode
                   and r["seed"] == seed), key=lambda r: r["day"])
    if len(runs) == num_days and all(r["status"] == "ok" for r in runs):
      out[seed] = runs
  return out


def auc_table(records: List[dict], direction: str, modes: Sequence[str], seeds: Sequence[int],
              num_days: int) -> List[dict]:
  """Tables 6.4 / 6.8: first-day, last-day and average AUC per mode, and paired differences."""
  per_seed = {}  # mode -> seed -> {"first", "last", "average", "logloss", "days"}
  for mode in modes:
    per_seed[mode] = {}
    for seed, runs in _chains(records, direction, mode, seeds, num_days).items():
      aucs = [r["eval_auc"] for r in runs]
      per_seed[mode][seed] = {"first": aucs[0], "last": aucs[-1], "average": float(np.mean(aucs)),
                              "logloss": float(np.mean([r["eval_logloss"] for r in runs])),
                              "days": aucs}
  rows = []
  for mode in modes:
    mine = per_seed[mode]
    row = {"mode": mode, "seeds": sorted(mine),
           "first_day_auc": mean_std([v["first"] for v in mine.values()]),
           "last_day_auc": mean_std([v["last"] for v in mine.values()]),
           "average_auc": mean_std([v["average"] for v in mine.values()]),
           "average_logloss": mean_std([v["logloss"] for v in mine.values()]),
           "per_day_auc": [mean_std([v["days"][i] for v in mine.values()])
                           for i in range(num_days)]}
    for ref in ("sync", "gba"):
      theirs = per_seed.get(ref, {})
      both = [s for s in mine if s in theirs]
      row[f"delta_vs_{ref}"] = (None if ref not in per_seed else {
          key: mean_std([mine[s][key] - theirs[s][key] for s in both])
          for key in ("first", "last", "average")})
    rows.append(row)
  return rows


def qps_table(records: List[dict], modes: Sequence[str], seeds: Sequence[int],
              num_days: int) -> List[dict]:
  """Table 5.2: global QPS per mode (mean over a seed's days), and paired ratios."""
  per_seed = {m: {s: float(np.mean([r["global_qps"] for r in runs])) for s, runs in
                  _chains(records, "from_sync", m, seeds, num_days).items()} for m in modes}
  rows = []
  for mode in modes:
    row = {"mode": mode, "seeds": sorted(per_seed[mode]),
           "global_qps": mean_std(list(per_seed[mode].values()))}
    for ref in ("sync", "async"):
      theirs = per_seed.get(ref, {})
      row[f"vs_{ref}"] = (None if ref not in per_seed else mean_std(
          [per_seed[mode][s] / theirs[s] for s in per_seed[mode] if s in theirs]))
    rows.append(row)
  return rows


def staleness_table(records: List[dict], modes: Sequence[str], seeds: Sequence[int],
                    num_days: int) -> List[dict]:
  """Table 5.3: dense staleness (mean weighted by pushes, max) and dropped batches per mode."""
  rows = []
  for mode in modes:
    chains = _chains(records, "from_sync", mode, seeds, num_days)
    means, maxes, drops, pushes = [], [], [], []
    histogram = np.zeros(0, np.int64)
    for runs in chains.values():
      n = sum(r["pushes"] for r in runs)
      means.append(sum(r["mean_staleness"] * r["pushes"] for r in runs) / max(n, 1))
      maxes.append(max(r["max_staleness"] for r in runs))
      drops.append(sum(r["dropped_batches"] for r in runs))
      pushes.append(n)
      for r in runs:
        h = np.asarray(r["staleness_histogram"] or [], np.int64)
        size = max(len(h), len(histogram))
        histogram = np.pad(histogram, (0, size - len(histogram))) + np.pad(h, (0, size - len(h)))
    rows.append({"mode": mode, "seeds": sorted(chains), "mean_staleness": mean_std(means),
                 "max_staleness": mean_std(maxes), "dropped_batches": mean_std(drops),
                 "pushes": mean_std(pushes),
                 "dropped_fraction": mean_std([d / max(p, 1) for d, p in zip(drops, pushes)]),
                 # Summed over seeds and days; empty for sync (no buffers: staleness 0).
                 "staleness_histogram": [int(x) for x in histogram]})
  return rows


def build_tables(records: List[dict], modes: Sequence[str], seeds: Sequence[int],
                 protocol: Protocol) -> dict:
  for r in records:
    # The row a run belongs to: the switched mode ("to_sync": the base's mode).
    r["row"] = r["base_mode"] if r["direction"] == "to_sync" else r["mode"]
  n = len(protocol.train_days)
  auc = {d: auc_table(records, d, modes, seeds, n) for d in DIRECTIONS}
  return {"auc": auc,
          "qps": qps_table(records, modes, seeds, n),
          "staleness": staleness_table(records, modes, seeds, n),
          "sweep": {d: best_settings(auc[d]) for d in DIRECTIONS}}


# ------------------------------------------------------------------------------------------------
# Markdown.

def fmt(stat: Optional[dict], digits: int = 4, signed: bool = False) -> str:
  """"mean ± std" of a mean_std dict ("mean" alone for one seed, "-" for none)."""
  if not stat or stat["mean"] is None:
    return "-"
  text = f"{stat['mean']:{'+' if signed else ''},.{digits}f}"
  if stat["std"] is not None:
    text += f" ± {stat['std']:,.{digits}f}"
  return text


def _table(header: Sequence[str], rows: List[List[str]]) -> List[str]:
  return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] +
          ["| " + " | ".join(r) + " |" for r in rows])


def _auc_lines(rows: List[dict], direction: str, protocol: Protocol) -> List[str]:
  first_col = "mode" if direction == "from_sync" else "base mode"
  summary, per_day = [], []
  for row in rows:
    vs_gba, vs_sync = row["delta_vs_gba"] or {}, row["delta_vs_sync"] or {}
    summary.append([row["mode"], str(len(row["seeds"])), fmt(row["first_day_auc"]),
                    fmt(row["last_day_auc"]), fmt(row["average_auc"]),
                    fmt(vs_gba.get("first"), signed=True), fmt(vs_gba.get("last"), signed=True),
                    fmt(vs_gba.get("average"), signed=True),
                    fmt(vs_sync.get("average"), signed=True), fmt(row["average_logloss"])])
    per_day.append([row["mode"]] + [fmt(s) for s in row["per_day_auc"]])
  lines = [f"## AUC after switching: {TITLES[direction]}", ""]
  lines += _table([first_col, "seeds", "first-day AUC", "last-day AUC", "average AUC",
                   "Δ first vs GBA", "Δ last vs GBA", "Δ average vs GBA", "Δ average vs sync",
                   "average logloss"], summary)
  lines += ["", "AUC of each day's model on the next day:" if protocol.next_day else
            "AUC of each day's model:", ""]
  lines += _table([first_col] + [f"day {t} -> {e}" if protocol.next_day else
                                 f"day {t} (its eval split)"
                                 for t, e in zip(protocol.train_days, protocol.eval_days)],
                  per_day)
  return lines + [""]


def markdown(results: dict) -> str:
  """The tables of `results` as Markdown."""
  p, a = results["protocol"], results["args"]
  resumed = sum(1 for r in results["runs"] if r.get("resumed") and not r.get("shared_with"))
  eval_what = ("every example (train and eval rows) of the next day" if p["next_day"] else
               "the held-out eval split of the same day (one-day source: smoke protocol, not "
               "the next-day protocol)")
  lines = [
      "# Switching benchmark", "",
      f"Data `{a['data']}` (options `{p['data_options']}`), {p['num_days']} day(s); base days "
      f"{p['base_days']}, then the switched mode trains on days {p['train_days']}, each model "
      f"evaluated on {eval_what} ({p['eval_examples']:,} examples at most).",
      f"Every run: {a['model']} ({a.get('embedding', 'vocab')} embeddings), 1 PS (parameter-server modes), {a['num_workers']} workers, local "
      f"batch {a['local_batch_size']}, Adam lr {a['learning_rate']:g}, iota "
      f"{a['staleness_threshold']}, stragglers `{results['stragglers']}` (slowdown "
      f"{a.get('straggler_delay', 'after_push').replace('_', ' ')} in the parameter-server modes), input "
      f"`{a.get('input', 'sharded')}`, "
      + _day_text(p, a["local_batch_size"])
      + f". Seeds {results['seeds']}: mean ± "
      "sample std over seeds; differences paired per seed. Wall time "
      f"{results['wall_seconds'] / 60:.1f} min" + (
          f" ({resumed} runs reused from an earlier invocation, --resume)." if resumed else "."),
      ""]
  for direction in DIRECTIONS:
    lines += _auc_lines(results["tables"]["auc"][direction], direction,
                        Protocol(**results["protocol"]))
  rows = [[r["mode"], str(len(r["seeds"])), fmt(r["global_qps"], 0), fmt(r["vs_sync"], 2),
           fmt(r["vs_async"], 2)] for r in results["tables"]["qps"]]
  lines += ["## Global QPS under the straggler profile (Table 5.2)", "",
            "Runs after switching from sync; measured after the first logging interval, mean "
            "over each seed's days.", ""]
  lines += _table(["mode", "seeds", "global QPS", "vs sync", "vs async"], rows) + [""]
  rows = [[r["mode"], str(len(r["seeds"])), fmt(r["mean_staleness"], 2),
           fmt(r["max_staleness"], 1), fmt(r["dropped_batches"], 1),
           fmt(r["dropped_fraction"], 4), fmt(r["pushes"], 0)]
          for r in results["tables"]["staleness"]]
  lines += ["## Dense staleness and dropped batches (Table 5.3)", "",
            "Same runs; per seed summed over its days (staleness: mean weighted by pushes). "
            "sync has no buffers: staleness 0, nothing dropped. hop_bw's dropped batches are "
            "the gradients of an older version it ignored.", ""]
  lines += _table(["mode", "seeds", "mean staleness", "max staleness", "dropped batches",
                   "dropped / pushes", "pushes"], rows) + [""]
  sweep = results["tables"].get("sweep", {})
  if any(sweep.get(d) for d in DIRECTIONS):
    lines += ["## Each baseline at its best setting (sweep)", "",
              "Best average AUC of each baseline's settings, per direction; the others follow, "
              "best first (Δ: paired mean over seeds).", ""]
    rows = []
    for direction in DIRECTIONS:
      for entry in sweep.get(direction, []):
        best, *others = entry["settings"]
        rows.append([direction, entry["baseline"], f"{entry['parameter']} = "
                     f"{split_setting(best['mode'])[1]}", fmt(best["average_auc"]),
                     fmt(best["delta_vs_gba"], signed=True),
                     fmt(best["delta_vs_sync"], signed=True),
                     "; ".join(f"{o['mode']}: {fmt(o['average_auc'])}" for o in others) or "-"])
    lines += _table(["direction", "baseline", "best setting", "average AUC", "Δ vs GBA",
                     "Δ vs sync", "other settings (average AUC)"], rows) + [""]
  failed = [r for r in results["runs"] if r["status"] == "failed"]
  if failed:
    lines += ["## Failed runs", ""]
    for r in failed:
      lines += [f"- {r['direction']} mode {r['mode']} (base {r['base_mode']}) seed {r['seed']} "
                f"day {r['day']}: `{r['error'].splitlines()[0]}`; its later days were skipped. "
                "Traceback in results.json and the run's log."]
    lines.append("")
  return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Plots.

def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def plot_auc(results: dict, path: str) -> None:
  plt = _pyplot()
  p = results["protocol"]
  fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  for ax, direction in zip(axes, DIRECTIONS):
    for row in results["tables"]["auc"][direction]:
      days = [(e, s) for e, s in zip(p["eval_days"], row["per_day_auc"]) if s["mean"] is not None]
      if not days:
        continue
      ax.errorbar([e for e, _ in days], [s["mean"] for _, s in days],
                  yerr=[s["std"] or 0.0 for _, s in days], marker="o", capsize=3,
                  label=row["mode"] if direction == "from_sync" else f"{row['mode']} -> sync")
    ax.set_title(TITLES[direction].split(" (")[0], fontsize=10)
    ax.set_xlabel("evaluated on day" if p["next_day"] else "day (same-day eval split)")
    ax.set_xticks(sorted(set(p["eval_days"])))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  axes[0].set_ylabel("AUC (mean ± std over seeds)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_qps(results: dict, path: str) -> None:
  plt = _pyplot()
  rows = [r for r in results["tables"]["qps"] if r["global_qps"]["mean"] is not None]
  fig, ax = plt.subplots(figsize=(6.5, 3.8))
  ax.bar([r["mode"] for r in rows], [r["global_qps"]["mean"] for r in rows],
         yerr=[r["global_qps"]["std"] or 0.0 for r in rows], capsize=4, color="tab:blue")
  ax.set_ylabel("global QPS (examples/s)")
  ax.set_title(f"Global QPS, stragglers {results['stragglers']}", fontsize=9)
  ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_staleness(results: dict, path: str) -> None:
  plt = _pyplot()
  rows = [r for r in results["tables"]["staleness"] if sum(r["staleness_histogram"]) > 0]
  fig, ax = plt.subplots(figsize=(7.5, 3.8))
  bins = max([len(r["staleness_histogram"]) for r in rows] + [1])
  # The buffers' last bin collects every staleness >= bins - 1: show only the occupied range.
  used = max([max(np.nonzero(r["staleness_histogram"])[0]) for r in rows] + [0]) + 1
  width = 0.8 / max(len(rows), 1)
  for i, r in enumerate(rows):
    h = np.asarray(r["staleness_histogram"], np.float64)
    ax.bar(np.arange(used) + (i - (len(rows) - 1) / 2) * width, (h / h.sum())[:used], width,
           label=r["mode"])
  ax.set_xticks(range(used))
  ax.set_xticklabels([str(s) if s < bins - 1 else f">={s}" for s in range(used)])
  ax.set_xlabel("dense staleness (global steps)")
  ax.set_ylabel("fraction of pushes")
  ax.set_title("Staleness of the pushes after switching from sync (sync: always 0)", fontsize=9)
  ax.grid(axis="y", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# ------------------------------------------------------------------------------------------------
# Command line.

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  p = benchmarks.ArgumentParser(description=__doc__.splitlines()[0],
                                program="benchmarks.switching")
  p.add_argument("--data", default="synthetic",
                 help="'synthetic', 'movielens100k:<dir>' or 'criteo:<file or dir>' (pseudo-days)")
  p.add_argument("--data_options", default=None,
                 help=f"options of the source, key=value,... (synthetic default "
                      f"{SYNTHETIC_OPTIONS!r}); num_days comes from --days")
  p.add_argument("--days", type=int, default=4,
                 help="days the data is split into (>= base_days + 2; ignored for a one-day "
                      "source)")
  p.add_argument("--base_days", type=int, default=1, help="days the base models train on")
  p.add_argument("--seeds", type=int, default=2, help="seeds 0 .. seeds - 1")
  p.add_argument("--modes", default=",".join(ALL_MODES))
  p.add_argument("--stragglers", default="transient",
                 help=f"names {sorted(PROFILES)} or a profile string, applied to every run")
  p.add_argument("--straggler_delay", default="after_push", choices=["after_push", "before_push"],
                 help="parameter-server modes: where a straggler sleeps (before_push: a slow "
                      "machine's gradients arrive late and stale)")
  p.add_argument("--steps_per_day", type=int, default=0,
                 help="worker steps per run (0: one pass over a day's train rows); rounded up "
                      f"to a multiple of {INTERVALS} x num_workers")
  p.add_argument("--input", default="shared", choices=["shared", "sharded"],
                 help="parameter-server modes' input: the shared data list or static shards")
  p.add_argument("--model", default="deepfm")
  p.add_argument("--embedding", default="vocab", choices=["vocab", "hash"],
                 help="the models' embeddings (examples/train.py --embedding): with hash, every "
                      "run keeps an expandable hash table, carried across each switch")
  p.add_argument("--num_workers", type=int, default=4)
  p.add_argument("--local_batch_size", type=int, default=256)
  # Above TrainConfig's 0.001: at the default synthetic size (32 global steps a day) a model at
  # 0.001 is still near its initialisation after the base day (AUC about 0.5).
  p.add_argument("--learning_rate", type=float, default=0.003)
  p.add_argument("--staleness_threshold", type=int, default=3)
  p.add_argument("--run_timeout", type=float, default=1800.0, help="seconds per run")
  p.add_argument("--gba_local_batch_size", type=int, default=None,
                 help="GBA's local batch Ba (default: --local_batch_size): GBA then runs "
                      "M = num_workers x local_batch_size / Ba workers, keeping Sync's global "
                      "batch")
  p.add_argument("--gba_num_workers", type=int, default=None,
                 help="GBA's workers with --gba_local_batch_size (default: M)")
  p.add_argument("--sweep", action="store_true",
                 help="run bsp, hop_bs and hop_bw at every setting of b2, b1, b3 (see above) and "
                      "report each at its best average AUC")
  p.add_argument("--from_sync_only", action="store_true",
                 help="only the sync -> mode direction (shadow modes: docs/shadow_sync.md)")
  p.add_argument("--resume", action="store_true",
                 help="keep the runs already finished under --out with the same configuration "
                      "(e.g. after an interruption or a failed run) and run only the others")
  p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_switching"))
  p.add_argument("--dry_run", action="store_true",
                 help="check the flags, the data and every mode's run configuration, print one "
                      "line and exit without training")
  args = p.parse_args(argv)
  args.modes_list = [m.strip() for m in args.modes.split(",") if m.strip()]
  try:
    unknown = sorted({split_setting(m)[0] for m in args.modes_list} -
                     set(ALL_MODES + EXTRA_MODES))
  except ValueError as e:
    p.error(f"--modes: {e}")
  if unknown or not args.modes_list:
    p.error(f"--modes: expected some of {ALL_MODES + EXTRA_MODES} (or <mode>@<setting>), got "
            f"{args.modes!r}")
  if args.seeds < 1 or args.base_days < 1 or args.num_workers < 2:
    p.error("need --seeds >= 1, --base_days >= 1 and --num_workers >= 2")
  if args.local_batch_size < 1:
    p.error(f"--local_batch_size must be >= 1, got {args.local_batch_size}.")
  if args.steps_per_day < 0:
    p.error(f"--steps_per_day must be >= 0 (0: one pass over a day), got {args.steps_per_day}.")
  args.modes_list = expand_modes(args.modes_list, args.sweep, args.num_workers)
  if args.embedding == "hash":
    hosts = set(mode_registry.hash_embedding_modes())
    refused = sorted({split_setting(m)[0] for m in args.modes_list} - hosts)
    if refused:
      p.error(f"--embedding=hash: {', '.join(refused)} cannot host a hash table (modes that can: "
              f"{', '.join(sorted(hosts))}); pass --modes with those only.")
  if args.gba_local_batch_size is not None:
    global_batch = args.num_workers * args.local_batch_size
    if args.gba_local_batch_size < 1 or global_batch % args.gba_local_batch_size:
      p.error(f"--gba_local_batch_size={args.gba_local_batch_size} must divide Sync's global "
              f"batch num_workers x local_batch_size = {global_batch}.")
  if args.gba_num_workers is not None and (args.gba_local_batch_size is None or
                                           args.gba_num_workers < 1):
    p.error("--gba_num_workers needs --gba_local_batch_size and must be >= 1.")
  args.out = os.path.abspath(args.out)
  return args


def write(results: dict, out: str) -> List[str]:
  """Writes results.md, results.json and the plots; returns their paths."""
  os.makedirs(out, exist_ok=True)
  paths = [os.path.join(out, "results.md"), os.path.join(out, "results.json")]
  with open(paths[0], "w") as f:
    f.write(markdown(results))
  with open(paths[1], "w") as f:
    json.dump(results, f, indent=2)
  for name, plot in (("auc_per_day.png", plot_auc), ("qps.png", plot_qps),
                     ("staleness_histogram.png", plot_staleness)):
    paths.append(os.path.join(out, name))
    plot(results, paths[-1])
  return paths


def _dry_run(args: argparse.Namespace, protocol: Protocol) -> dict:
  """--dry_run: each mode's first switched run configured and validated as the binary would."""
  from tf_gba.training.config import TrainConfig  # pylint: disable=g-import-not-at-top
  for mode in args.modes_list:
    config = run_config(args, protocol, mode, 0, protocol.train_days[0], protocol.eval_days[0],
                        os.path.join(args.out, "dry_run"))
    try:
      TrainConfig(**config).validate()
    except ValueError as e:
      sys.exit(f"benchmarks.switching: {mode}: {e}")
  print(f"benchmarks.switching: dry run: flags, data and the runs of {len(args.modes_list)} "
        f"modes valid ({protocol.num_days} days, {protocol.steps_per_day} worker steps a day); "
        "nothing trained.", flush=True)
  return {}


def main(argv: Optional[Sequence[str]] = None) -> dict:
  args = parse_args(argv)
  started = time.time()
  try:
    protocol = make_protocol(args)
  except ValueError as e:  # a bad flag or data spec: the message says which
    benchmarks.refuse("benchmarks.switching", str(e))
  short = short_day(protocol.train_rows, args.num_workers, args.local_batch_size,
                    args.steps_per_day)
  if short:
    why, largest = short
    fix = (f"--local_batch_size={largest // args.num_workers} or less, or fewer --num_workers"
           if largest >= args.num_workers else f"fewer --num_workers or {LONGER_DAYS}")
    benchmarks.refuse("benchmarks.switching", f"{why}; pass {fix}.")
  if args.dry_run:
    return _dry_run(args, protocol)
  modes, seeds = args.modes_list, list(range(args.seeds))
  day = (f"one pass over each day's {protocol.train_rows:,} train rows (sync: "
         f"{protocol.pass_steps} local batches; modes without the data list: "
         f"{protocol.steps_per_day} worker steps)" if protocol.one_pass_batches else
         f"{protocol.steps_per_day} worker steps per day")
  print(f"switching benchmark: {args.data}, days {protocol.num_days}, modes {modes}, seeds "
        f"{seeds}, {day}", flush=True)
  runner = Runner(args, protocol)
  for seed in seeds:
    runner.seed(seed, modes)
  records = runner.records
  results = {
      "args": {k: v for k, v in vars(args).items() if k != "modes_list"},
      "modes": modes, "seeds": seeds,
      "stragglers": PROFILES.get(args.stragglers, args.stragglers),
      "straggler_delay": args.straggler_delay,
      "protocol": dataclasses.asdict(protocol),
      "tables": build_tables(records, modes, seeds, protocol),
      "runs": records,
      "wall_seconds": time.time() - started,
  }
  paths = write(results, args.out)
  print("\n" + markdown(results), flush=True)
  print("Wrote " + ", ".join(paths), flush=True)
  return results


if __name__ == "__main__":
  # A dry run returns no runs.
  sys.exit(1 if any(r["status"] == "failed" for r in main().get("runs", [])) else 0)
