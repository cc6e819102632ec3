"""Reader of MovieLens-100K (GroupLens `ml-100k`) as a click-through task, split into days.

Reads `u.data`, `u.user` and `u.item` from a directory, each plain (as GroupLens ships them) or
gzip-compressed (`u.data.gz`, ...). A rating of 4 or 5 is a click (label 1).

Features, all categorical int64 ids with 0 reserved for missing or unknown values:

* `user_id`, `item_id`: the GroupLens ids (vocabulary: largest id + 1).
* `age_bucket`: 1..7 for ages <18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+ (the MovieLens-1M
  buckets).
* `gender`: 1 for M, 2 for F.
* `occupation`: 1..21, the position in the GroupLens `u.occupation` list.
* `zip_prefix`: the first 3 characters of the zip code (which carry the region), numbered 1..n in
  sorted order over the users in `u.user`.
* `genre`: 1 + the index (in `u.genre` order) of the item's FIRST genre flag. A single id keeps the
  features uniform (one id per feature per example, no ragged tensors); the first flag is the
  coarsest genre in GroupLens' ordering.

Days: the ratings, ordered by timestamp, are cut into `num_days` slices of (nearly) equal COUNT,
so every rating of day d is no later than every rating of day d + 1. Equal-time slices would be
very uneven: ratings in ML-100K come in bursts. Within a day the last `eval_fraction` of the
ratings (by time) form the "eval" split, the rest "train".

Malformed rows (wrong field count, non-integer or out-of-range values, duplicate ids, a rating of
an unknown user or item) are skipped with a warning naming file and line (absl logging), or raise
a ValueError naming file and line with `strict=True`. The files are small (100,000 ratings), so
they are read and checked in Python once and kept in memory; `malformed_row_count` returns the
number of rows skipped.

Example:

  ds = make_dataset("/data/ml-100k", split="train", day=0, num_days=7)
"""

import dataclasses
import functools
import gzip
import os
from typing import Dict, List, Optional, Tuple

from absl import logging
import numpy as np
import tensorflow as tf

from tf_gba.data import pipeline
from tf_gba.data.info import DataInfo

AGE_EDGES = (18, 25, 35, 45, 50, 56)
GENDERS = {"M": 1, "F": 2}
OCCUPATIONS = ("administrator", "artist", "doctor", "educator", "engineer", "entertainment",
               "executive", "healthcare", "homemaker", "lawyer", "librarian", "marketing", "none",
               "other", "programmer", "retired", "salesman", "scientist", "student", "technician",
               "writer")
NUM_GENRES = 19
FEATURES = ("user_id", "item_id", "age_bucket", "gender", "occupation", "zip_prefix", "genre")
DEFAULT_NUM_DAYS = 7
_WARN_EACH_FIRST = 10
# Ids index in-memory join tables; this bound keeps a corrupt id from allocating gigabytes.
_MAX_ID = 10_000_000


@dataclasses.dataclass(frozen=True)
class Ratings:
  """Every well-formed rating, joined with its user and item, in timestamp order."""
  features: Dict[str, np.ndarray]  # FEATURES -> int64 [n]
  labels: np.ndarray               # float32 [n]
  timestamps: np.ndarray           # int64 [n], non-decreasing
  vocab_sizes: Dict[str, int]
  malformed: Tuple[Tuple[str, int, str], ...]  # (file, line, problem) of each skipped row
  stars: Optional[np.ndarray] = None  # int64 [n]: the rating itself, 1..5 (for rating models)


class _Malformed(Exception):
  pass


def _find(directory: str, name: str) -> str:
  for candidate in (name, name + ".gz"):
    path = os.path.join(directory, candidate)
    if os.path.isfile(path):
      return path
  raise ValueError(f"MovieLens-100K directory {directory!r} has no {name} or {name}.gz; "
                   "expected the GroupLens ml-100k files u.data, u.user and u.item "
                   "(plain or .gz).")


def _lines(path: str):
  """(1-based line number, text) of each line; GroupLens files are latin-1."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", encoding="latin-1", newline="") as f:
    for number, line in enumerate(f, start=1):
      yield number, line.rstrip("\r\n")


def _int(text: str, what: str, low: Optional[int] = None, high: Optional[int] = None) -> int:
  try:
    value = int(text)
  except ValueError:
    raise _Malformed(f"{what} is {text[:40]!r}, expected an integer") from None
  if (low is not None and value < low) or (high is not None and value > high):
    expected = f">= {low}" if high is None else f"in {low}..{high}"
    raise _Malformed(f"{what} is {value}, expected {expected}")
  return value


def _fields(text: str, sep: str, count: int) -> List[str]:
  fields = text.split(sep)
  if len(fields) != count:
    raise _Malformed(f"has {len(fields)} {sep!r}-separated fields, expected {count}")
  return fields


def _parse_user(text):
  user, age, gender, occupation, zip_code = _fields(text, "|", 5)
  if gender not in GENDERS:
    raise _Malformed(f"gender is {gender[:40]!r}, expected M or F")
  return (_int(user, "user id", 1, _MAX_ID), _int(age, "age", 0, 150), GENDERS[gender], occupation,
          zip_code.strip().upper()[:3])


def _parse_item(text):
  fields = _fields(text, "|", 5 + NUM_GENRES)
  flags = fields[5:]
  if any(f not in ("0", "1") for f in flags):
    raise _Malformed("a genre flag is not 0 or 1")
  first = flags.index("1") + 1 if "1" in flags else 0
  return _int(fields[0], "item id", 1, _MAX_ID), first


def _parse_rating(users: set, items: set, text: str):
  user, item, rating, timestamp = _fields(text, "\t", 4)
  row = (_int(user, "user id", 1), _int(item, "item id", 1), _int(rating, "rating", 1, 5),
         _int(timestamp, "timestamp", 0))
  if row[0] not in users:
    raise _Malformed(f"rates as user {row[0]}, who is not (well-formed) in u.user")
  if row[1] not in items:
    raise _Malformed(f"rates item {row[1]}, which is not (well-formed) in u.item")
  return row


def _read(path: str, parse, malformed: list, seen_ids: Optional[set] = None):
  """Parses each line of `path`; records the malformed ones (and repeated ids) in `malformed`."""
  rows = []
  for number, text in _lines(path):
    try:
      row = parse(text)
      if seen_ids is not None:
        if row[0] in seen_ids:
          raise _Malformed(f"repeats id {row[0]}")
        seen_ids.add(row[0])
      rows.append(row)
    except _Malformed as e:
      malformed.append((path, number, str(e)))
  return rows


def _file_key(directory: str) -> Tuple:
  """Identifies the directory's files and their versions, so edited files are read again."""
  key = []
  for name in ("u.data", "u.user", "u.item"):
    path = _find(directory, name)
    stat = os.stat(path)
    key.append((path, stat.st_size, stat.st_mtime_ns))
  return tuple(key)


def load(directory: str) -> Ratings:
  """Reads, checks and joins the files of `directory` (cached while the files do not change)."""
  if not os.path.isdir(directory):
    raise ValueError(f"MovieLens-100K directory {directory!r} does not exist; expected a "
                     "directory holding the GroupLens ml-100k files u.data, u.user and u.item.")
  return _load(_file_key(directory))


@functools.lru_cache(maxsize=4)
def _load(key: Tuple) -> Ratings:
  (data_path, _, _), (user_path, _, _), (item_path, _, _) = key
  malformed: List[Tuple[str, int, str]] = []
  user_ids, item_ids = set(), set()
  users = _read(user_path, _parse_user, malformed, user_ids)
  items = _read(item_path, _parse_item, malformed, item_ids)
  ratings = _read(data_path, functools.partial(_parse_rating, user_ids, item_ids), malformed)
  _warn(malformed)

  max_user = max(user_ids, default=0)
  max_item = max(item_ids, default=0)
  zip_vocab = sorted({u[4] for u in users if u[4]})
  zip_ids = {z: i + 1 for i, z in enumerate(zip_vocab)}
  occupation_ids = {name: i + 1 for i, name in enumerate(OCCUPATIONS)}
  user_table = np.zeros((max_user + 1, 4), np.int64)  # age_bucket, gender, occupation, zip
  for user, age, gender, occupation, zip_prefix in users:
    user_table[user] = (1 + np.searchsorted(AGE_EDGES, age, side="right"), gender,
                        occupation_ids.get(occupation, 0), zip_ids.get(zip_prefix, 0))
  genre = np.zeros(max_item + 1, np.int64)
  for item, first_genre in items:
    genre[item] = first_genre

  r = np.array(ratings, np.int64).reshape(-1, 4)
  r = r[np.argsort(r[:, 3], kind="stable")]

  features = {"user_id": r[:, 0], "item_id": r[:, 1]}
  for j, name in enumerate(("age_bucket", "gender", "occupation", "zip_prefix")):
    features[name] = user_table[r[:, 0], j]
  features["genre"] = genre[r[:, 1]]
  vocab_sizes = {"user_id": max_user + 1, "item_id": max_item + 1,
                 "age_bucket": len(AGE_EDGES) + 2, "gender": len(GENDERS) + 1,
                 "occupation": len(OCCUPATIONS) + 1, "zip_prefix": len(zip_vocab) + 1,
                 "genre": NUM_GENRES + 1}
  return Ratings(features, (r[:, 2] >= 4).astype(np.float32), r[:, 3], vocab_sizes,
                 tuple(malformed), stars=r[:, 2])


def _warn(malformed: List[Tuple[str, int, str]]):
  for path, number, problem in malformed[:_WARN_EACH_FIRST]:
    logging.warning("Skipping malformed MovieLens row at %s:%d: %s", path, number, problem)
  if len(malformed) > _WARN_EACH_FIRST:
    logging.warning("Skipped %d malformed MovieLens rows in all (the first %d are listed above).",
                    len(malformed), _WARN_EACH_FIRST)


def _check_strict(ratings: Ratings):
  if ratings.malformed:
    path, number, problem = ratings.malformed[0]
    raise ValueError(f"Malformed MovieLens row at {path}:{number}: {problem} "
                     f"({len(ratings.malformed)} malformed rows in all).")


def day_bounds(num_rows: int, num_days: int) -> np.ndarray:
  """Row index where each day starts, plus `num_rows`: `num_days` slices of (nearly) equal count."""
  return np.array([num_rows * d // num_days for d in range(num_days + 1)], np.int64)


def split_rows(ratings: Ratings, split: str, day: Optional[int], num_days: int,
               eval_fraction: float) -> np.ndarray:
  """Indices (in time order) of the rows of `split` on `day` (None: every day)."""
  bounds = day_bounds(len(ratings.labels), num_days)
  rows = []
  for d in range(num_days) if day is None else [day]:
    start, end = bounds[d], bounds[d + 1]
    first_eval = end - int(round((end - start) * eval_fraction))
    rows.append(np.arange(start, first_eval) if split == "train" else np.arange(first_eval, end))
  return np.concatenate(rows)


def _check_options(num_days: int, eval_fraction: float):
  if num_days < 1:
    raise ValueError(f"num_days must be >= 1, got {num_days}.")
  if not 0.0 < eval_fraction < 1.0:
    raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}.")


def data_info(path: str, num_days: int = DEFAULT_NUM_DAYS, eval_fraction: float = 0.1) -> DataInfo:
  _check_options(num_days, eval_fraction)
  return DataInfo(categorical=dict(load(path).vocab_sizes), numeric=(), num_days=num_days)


# Plain Python that builds a graph: tf.function callers (a ParameterServerStrategy dataset_fn)
# need not convert it.
@tf.autograph.experimental.do_not_convert
def make_dataset(path: str, split: str = "train", batch_size: int = 256, num_shards: int = 1,
                 shard_index: int = 0, day: Optional[int] = None, repeat: bool = False,
                 shuffle_seed: Optional[int] = 0, strict: bool = False,
                 num_days: int = DEFAULT_NUM_DAYS, eval_fraction: float = 0.1) -> tf.data.Dataset:
  """MovieLens-100K `(features, label)` batches of one split and day (None: every day).

  Args:
    path: directory with u.data, u.user and u.item (plain or .gz).
    split: "train" or "eval" (the last `eval_fraction` of each day, by time).
    batch_size: rows per batch (the last one may be smaller).
    num_shards, shard_index: this worker takes rows `shard_index, shard_index + num_shards, ...`
      of the selected ones, so the shards partition them.
    day: a day in `[0, num_days)`, or None for all days in order.
    repeat: repeat forever.
    shuffle_seed: shuffle train rows (again in each epoch); None keeps time order. Eval rows
      keep time order.
    strict: raise ValueError at the first malformed row instead of skipping it.
    num_days: the number of equal-count slices of the ratings by time.
    eval_fraction: share of each day's (latest) ratings that form the eval split.
  """
  pipeline.check_common_args(split, batch_size, num_shards, shard_index)
  _check_options(num_days, eval_fraction)
  pipeline.check_day(day, num_days)
  ratings = load(path)
  if strict:
    _check_strict(ratings)
  rows = split_rows(ratings, split, day, num_days, eval_fraction)
  info = DataInfo(categorical=dict(ratings.vocab_sizes), numeric=(), num_days=num_days)
  return pipeline.from_arrays(info, {name: v[rows] for name, v in ratings.features.items()},
                              ratings.labels[rows], batch_size=batch_size, num_shards=num_shards,
                              shard_index=shard_index, repeat=repeat,
                              shuffle_seed=shuffle_seed if split == "train" else None)


def malformed_row_count(path: str, split: str = "train") -> int:
  """Rows of the three files that the reader skips as malformed, whatever the split and day."""
  del split
  return len(load(path).malformed)
