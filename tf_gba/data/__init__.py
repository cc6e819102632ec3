"""Data sources for CTR training, behind one small API the training binary uses.

A source is named by a spec string:

* `"synthetic"` (the default, no download): a Criteo-like generator with a planted truth, see
  `synthetic.SyntheticCTR` for its options (`num_examples`, `num_days`, `drift`, `seed`, ...).
* `"criteo:<path>"`: Criteo Kaggle/Terabyte rows from a file, a glob or a directory (plain or
  .gz). A directory holding `train*` and `eval*` files uses them as the two splits; otherwise every
  `eval_every`-th row (default 10th) is an eval row. Options: `vocab_size`, `eval_every`,
  `shuffle_buffer`.
* `"movielens100k:<dir>"`: GroupLens ml-100k `u.data`, `u.user`, `u.item` (plain or .gz), a rating
  >= 4 is a click, split by time into `num_days` days. Options: `num_days`, `eval_fraction`.

Every source yields `(features, label)` batches: `features` maps each name of
`DataInfo.categorical` to int64 ids [batch] in `[0, vocab)` and each name of `DataInfo.numeric`
to float32 values [batch]; `label` is float32 [batch], 0 or 1.

Example:

  info = tf_gba.data.data_info("synthetic", num_days=3)
  ds = tf_gba.data.make_dataset("synthetic", split="train", day=0, num_days=3, batch_size=512,
                                num_shards=2, shard_index=0)
"""

import glob
import inspect
import os
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import tensorflow as tf

from tf_gba.data import criteo
from tf_gba.data import movielens
from tf_gba.data import synthetic
from tf_gba.data.info import DataInfo
from tf_gba.data.synthetic import SyntheticCTR


class _Source(NamedTuple):
  needs_path: bool
  accepts_glob: bool
  options: Tuple[str, ...]  # the source's own options, beyond make_dataset's common arguments
  data_info: Callable[..., DataInfo]
  make_dataset: Callable[..., tf.data.Dataset]
  malformed_row_count: Callable[..., int]


_COMMON_ARGS = ("path", "split", "batch_size", "num_shards", "shard_index", "day", "repeat",
                "shuffle_seed", "strict")


def _own_options(fn: Callable) -> Tuple[str, ...]:
  return tuple(p for p in inspect.signature(fn).parameters
               if p not in _COMMON_ARGS and p != "self")


_SOURCES: Dict[str, _Source] = {
    "synthetic": _Source(False, False, _own_options(SyntheticCTR.__init__), synthetic.data_info,
                         synthetic.make_dataset, synthetic.malformed_row_count),
    "criteo": _Source(True, True, _own_options(criteo.make_dataset), criteo.data_info,
                      criteo.make_dataset, criteo.malformed_row_count),
    "movielens100k": _Source(True, False, _own_options(movielens.make_dataset),
                             movielens.data_info, movielens.make_dataset,
                             movielens.malformed_row_count),
}
_ACCEPTED = "'synthetic', 'criteo:<file, glob or directory>' or 'movielens100k:<directory>'"


def _parse_spec(spec: str, options: dict) -> Tuple[_Source, Optional[str]]:
  """The source and path `spec` names; checks that the path exists and the options apply."""
  kind, sep, path = spec.partition(":")
  source = _SOURCES.get(kind.strip().lower())
  if source is None:
    raise ValueError(f"Unknown data spec {spec!r}; accepted: {_ACCEPTED}.")
  unknown = sorted(set(options) - set(source.options))
  if unknown:
    raise ValueError(f"Data spec {spec!r} takes no option(s) {unknown}; its options are "
                     f"{list(source.options)}.")
  if not source.needs_path:
    if sep:
      raise ValueError(f"Data spec {spec!r}: {kind!r} takes no path; accepted: {_ACCEPTED}.")
    return source, None
  if not path:
    raise ValueError(f"Data spec {spec!r} needs a path, as in '{kind}:/data/{kind}'; "
                     f"accepted: {_ACCEPTED}.")
  path = os.path.expanduser(path)
  if not (os.path.exists(path) or (source.accepts_glob and glob.glob(path))):
    raise ValueError(f"Data spec {spec!r}: nothing at {path!r}.")
  return source, path


def _call(fn: Callable, path: Optional[str], *args, **options):
  """Calls a source function with the options it takes: one options dict serves them all."""
  params = inspect.signature(fn).parameters
  if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
    options = {k: v for k, v in options.items() if k in params}
  return fn(*args, **options) if path is None else fn(path, *args, **options)


def data_info(spec: str = "synthetic", **options) -> DataInfo:
  """The feature schema of the source `spec` with `options` (see the module docstring)."""
  source, path = _parse_spec(spec, options)
  return _call(source.data_info, path, **options)


# Plain Python that builds a graph: tf.function callers (a ParameterServerStrategy dataset_fn)
# need not convert it.
@tf.autograph.experimental.do_not_convert
def make_dataset(spec: str = "synthetic", split: str = "train", batch_size: int = 256,
                 num_shards: int = 1, shard_index: int = 0, day: Optional[int] = None,
                 repeat: bool = False, shuffle_seed: Optional[int] = 0, strict: bool = False,
                 **options) -> tf.data.Dataset:
  """`(features, label)` batches of the source `spec`.

  Args:
    spec: "synthetic", "criteo:<path>" or "movielens100k:<dir>".
    split: "train" or "eval".
    batch_size: examples per batch (the last batch of a pass may be smaller).
    num_shards, shard_index: this worker's share; the shards partition the examples.
    day: one day in `[0, data_info(spec).num_days)`, or None for all days in order.
    repeat: repeat forever.
    shuffle_seed: seed of the train-row shuffle (reshuffled each epoch); None: file/time order.
      Eval rows are never shuffled.
    strict: fail at the first malformed row, naming file and line, instead of skipping it: Criteo
      (streamed) raises `tf.errors.InvalidArgumentError` when iteration reaches it, MovieLens
      (read up front) raises ValueError here.
    **options: the source's own options (see the module docstring).

  Raises:
    ValueError: an unknown spec or option, a missing path, or a bad argument.
  """
  source, path = _parse_spec(spec, options)
  return _call(source.make_dataset, path, split=split, batch_size=batch_size,
               num_shards=num_shards, shard_index=shard_index, day=day, repeat=repeat,
               shuffle_seed=shuffle_seed, strict=strict, **options)


def malformed_row_count(spec: str, split: str = "train", **options) -> int:
  """How many malformed rows a pass over `spec`'s `split` skips (always 0 for "synthetic").

  Criteo: runs the reader's own row check over the split's files (one pass, at C++ speed).
  MovieLens: the rows of the three files skipped when they were read (the same for each split).
  """
  source, path = _parse_spec(spec, options)
  return _call(source.malformed_row_count, path, split, **options)


__all__ = ["DataInfo", "SyntheticCTR", "data_info", "make_dataset", "malformed_row_count",
           "criteo", "movielens", "synthetic"]
