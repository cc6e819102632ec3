"""tf.data reader of the Criteo Display Advertising Challenge format (Kaggle `train.txt`, ...).

Each line holds 40 tab-separated fields: `label` (0 or 1), `I1..I13` (integer counts, possibly
negative or empty) and `C1..C26` (categorical values hashed to 32 bits, written as 8 hex digits,
possibly empty). Files may be plain or gzip-compressed (a name ending in `.gz`).

Features:

* `I1..I13` (float32): `log(1 + max(x, 0))`, a missing value reads as 0. Counts are heavy-tailed
  (up to millions); the log keeps them in a range a DNN trains on without per-feature statistics,
  and the few negative values (-1, -2 in I2) carry no more meaning than 0.
* `C1..C26` (int64): id 0 is reserved for a missing value; a present value `s` maps to
  `1 + to_hash_bucket_fast(lower(s), vocab - 1)`, so ids lie in `[0, vocab)`. With
  `ids="fingerprint"` (the binary's `--embedding=hash`) there is no vocabulary and no modulo: `s`
  maps to the 64-bit Fingerprint64 of `lower(s)` as an int64 (`hash_table_ops.string_keys`, what
  a HashEmbedding makes of the string itself), a missing value still to 0.

Malformed rows (a field count other than 40, a label other than 0/1, a non-integer numeric or a
categorical that is not 8 hex digits) are detected in the tf.data graph with one regular
expression per line. By default they are skipped, and the first ten (then every 10**k-th) are
logged as warnings naming the file, the line and the problem, through TensorFlow's (absl) C++
logger at WARNING level (`tf.print(..., output_stream=absl.logging.warning)`; hidden when
`TF_CPP_MIN_LOG_LEVEL` >= 2). With `strict=True` the first one stops the iteration with an
`InvalidArgumentError` naming the file and line.

Why in the graph, and why counting is a separate pass (`malformed_row_count`): the real files hold
45 million (Kaggle) to 4 billion (Terabyte) rows, so validating them in Python before training
would take minutes to hours, and datasets under a ParameterServerStrategy are built as graphs that
run in the worker processes, where no Python callback or coordinator-side counter can be reached.
A check made of tf ops runs at C++ speed wherever the dataset runs; `malformed_row_count` runs the
very same check over the files to give the exact number a training pass skips.

Example:

  ds = make_dataset("/data/criteo", split="train", batch_size=1024, num_shards=4, shard_index=0)
  features, label = next(iter(ds))  # features["I1"]: float32 [1024], features["C1"]: int64 [1024]
"""

import glob
import gzip
import os
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from absl import logging
import tensorflow as tf

from tf_gba.data import pipeline
from tf_gba.data.info import DataInfo
from tf_gba.ops import hash_table_ops

NUMERIC_NAMES = tuple(f"I{i}" for i in range(1, 14))
CATEGORICAL_NAMES = tuple(f"C{i}" for i in range(1, 27))
FIELD_NAMES = ("label",) + NUMERIC_NAMES + CATEGORICAL_NAMES
MISSING_ID = 0
DEFAULT_VOCAB_SIZE = 10_000
# What a categorical value becomes (make_dataset's `ids`): a vocabulary id, or its 64-bit
# fingerprint (no vocabulary, no modulo: a HashEmbedding's key).
VOCAB_IDS = "vocab"
FINGERPRINT_IDS = "fingerprint"
IDS = (VOCAB_IDS, FINGERPRINT_IDS)

_LABEL = "[01]"
# Up to 18 digits, so every accepted integer parses without overflow.
_INTEGER = "(-?[0-9]{1,18})?"
_HEX = "([0-9a-fA-F]{8})?"
_ROW_PATTERN = f"{_LABEL}(\\t{_INTEGER}){{13}}(\\t{_HEX}){{26}}"
_EXPECTED = ("0 or 1",) + ("an integer or empty",) * 13 + ("8 hex digits or empty",) * 26

# Warn about each of the first rows, then only at 10**k skipped rows, so a file full of bad rows
# (say, the unlabelled Kaggle test.txt) does not flood the log.
_WARN_EACH_FIRST = 10
# Lines per block (see _selected_rows).
_BLOCK = 1024
# Where the warnings go: TensorFlow's C++ logger at WARNING level. A "file://<path>" (what tf.print
# also accepts) sends them to a file instead, which lets tests read them whatever the log level.
_WARNING_STREAM = logging.warning


def resolve_files(path: str, split: str, eval_every: int = 10) -> Tuple[List[str], bool]:
  """The files to read for `split`, and whether the split must be taken from their rows.

  `path` is a file, a glob, or a directory. In a directory, files named `train*` and `eval*`
  (e.g. `train_8k.tsv.gz`, `eval_2k.tsv.gz`) are the two splits. Otherwise (a file, a glob, a
  directory with only `train*` files, or with neither: then all its non-hidden files) every
  `eval_every`-th row is an eval row and the others are train rows: a reader that streams cannot
  know the row count up front to cut a chronological tail. Kaggle's `test.txt` is never used: it
  has no labels.

  Raises:
    ValueError: nothing matches `path`.
  """
  pipeline.check_split(split)
  if eval_every < 2:
    raise ValueError(f"eval_every must be >= 2, got {eval_every}.")
  if os.path.isdir(path):
    train = sorted(glob.glob(os.path.join(path, "train*")))
    evals = sorted(glob.glob(os.path.join(path, "eval*")))
    if train and evals:
      return (train if split == "train" else evals), False
    if train:
      return train, True
    files = sorted(f for f in glob.glob(os.path.join(path, "*"))
                   if os.path.isfile(f) and not f.lower().endswith(".md"))
  else:
    files = sorted(f for f in glob.glob(path) if os.path.isfile(f))
  if not files:
    raise ValueError(
        f"No Criteo files at {path!r}. Give a file (plain or .gz), a glob, or a directory "
        "holding train*/eval* files, e.g. 'criteo:/data/criteo/train.txt'.")
  return files, True


def _vocab_sizes(vocab_size: Union[int, Mapping[str, int]]) -> Dict[str, int]:
  if isinstance(vocab_size, int):
    sizes = {name: vocab_size for name in CATEGORICAL_NAMES}
  else:
    unknown = set(vocab_size) - set(CATEGORICAL_NAMES)
    if unknown:
      raise ValueError(f"vocab_size names unknown features {sorted(unknown)}; "
                       f"the Criteo features are {CATEGORICAL_NAMES}.")
    sizes = {name: int(vocab_size.get(name, DEFAULT_VOCAB_SIZE)) for name in CATEGORICAL_NAMES}
  for name, size in sizes.items():
    if size < 2:
      raise ValueError(f"vocab_size of {name} must be >= 2 (id 0 is kept for missing values), "
                       f"got {size}.")
  return sizes


def _check_num_days(num_days: int) -> None:
  if not isinstance(num_days, int) or num_days < 1:
    raise ValueError(f"num_days must be an integer >= 1, got {num_days!r}.")


_LINE_COUNTS: Dict[Tuple[str, float, int], int] = {}


def _count_lines(files: Sequence[str]) -> int:
  """Lines of `files` (gzip or plain), as TextLineDataset reads them; cached per file version."""
  total = 0
  for f in files:
    key = (f, os.path.getmtime(f), os.path.getsize(f))
    if key not in _LINE_COUNTS:
      opener = gzip.open if f.endswith(".gz") else open
      with opener(f, "rb") as fh:
        _LINE_COUNTS[key] = sum(1 for _ in fh)
    total += _LINE_COUNTS[key]
  return total


def data_info(path: str, vocab_size: Union[int, Mapping[str, int]] = DEFAULT_VOCAB_SIZE,
              eval_every: int = 10, num_days: int = 1) -> DataInfo:
  """Schema of the Criteo features; checks that `path` names files.

  Criteo files carry no timestamps; `num_days` > 1 cuts them into that many pseudo-days of
  consecutive rows, in file order (the Kaggle file is in time order), for the next-day protocol.
  """
  _check_num_days(num_days)
  resolve_files(path, "train", eval_every)
  return DataInfo(categorical=_vocab_sizes(vocab_size), numeric=NUMERIC_NAMES,
                  num_days=num_days)


class _Rows(NamedTuple):
  """A block of consecutive lines of one file (tf.data element)."""
  file: tf.Tensor     # string scalar
  number: tf.Tensor   # int64 [n], 1-based line numbers in `file`
  text: tf.Tensor     # string [n]


def _selected_rows(files: Sequence[str], split: str, split_rows: bool, eval_every: int,
                   num_shards: int, shard_index: int,
                   row_range: Optional[Tuple[int, int]] = None) -> tf.data.Dataset:
  """Blocks of the lines of `files` that belong to `split` and to shard `shard_index`.

  Everything works on blocks of lines rather than single lines: a tf.data step costs microseconds
  per element, so per-line steps would dominate reading 45 million rows.
  """

  def read(file):
    compression = tf.where(tf.strings.regex_full_match(file, r".*\.gz"), "GZIP", "")
    blocks = tf.data.TextLineDataset(file, compression_type=compression).batch(_BLOCK)

    def number(i, text):
      first = i * _BLOCK + 1
      return _Rows(file, first + tf.range(tf.size(text, out_type=tf.int64)), text)

    return blocks.enumerate().map(number)

  def select(rows_before, rows):
    # Row index g over all files; j, its index within the split, picks the shard, so the shards
    # partition the split evenly whatever eval_every and num_shards are.
    g = rows_before + tf.range(tf.size(rows.text, out_type=tf.int64))
    if split_rows:
      is_eval = g % eval_every == eval_every - 1
      j = g // eval_every if split == "eval" else g - (g + 1) // eval_every
      keep = is_eval if split == "eval" else tf.logical_not(is_eval)
    else:
      j, keep = g, tf.ones_like(g, tf.bool)
    if row_range is not None:  # a pseudo-day: rows [lo, hi) of the files, in order
      keep = tf.logical_and(keep, tf.logical_and(g >= row_range[0], g < row_range[1]))
    keep = tf.logical_and(keep, j % num_shards == tf.cast(shard_index, tf.int64))
    selected = _Rows(rows.file, tf.boolean_mask(rows.number, keep),
                     tf.boolean_mask(rows.text, keep))
    return rows_before + tf.size(g, out_type=tf.int64), selected

  ds = tf.data.Dataset.from_tensor_slices(list(files)).flat_map(read)
  return ds.scan(tf.constant(0, tf.int64), select)


def _is_well_formed(text):
  """Strips a Windows line end; returns the text and whether it is a well-formed row."""
  text = tf.strings.regex_replace(text, "\r$", "")
  return text, tf.strings.regex_full_match(text, _ROW_PATTERN)


def _problems(file, numbers, texts):
  """Messages naming the file, line and fault of each (malformed) row in `texts` [k]."""
  fields = tf.strings.split(texts, "\t")
  count = fields.row_lengths()
  padded = fields.to_tensor(shape=[None, 40])
  ok = tf.concat([tf.strings.regex_full_match(padded[:, :1], _LABEL),
                  tf.strings.regex_full_match(padded[:, 1:14], _INTEGER),
                  tf.strings.regex_full_match(padded[:, 14:], _HEX)], axis=1)
  first_bad = tf.argmin(tf.cast(ok, tf.int32), axis=1, output_type=tf.int32)
  value = tf.strings.substr(tf.gather(padded, first_bad, batch_dims=1), 0, 40)
  bad_field = tf.strings.join([tf.gather(FIELD_NAMES, first_bad), " is '", value, "', expected ",
                               tf.gather(_EXPECTED, first_bad)])
  bad_count = tf.strings.join(["has ", tf.strings.as_string(count),
                               " tab-separated fields, expected 40"])
  fault = tf.where(count == 40, bad_field, bad_count)
  return tf.strings.join(["Malformed Criteo row at ", file, ":", tf.strings.as_string(numbers),
                          ": ", fault])


def _check_and_report(strict: bool):
  """A `Dataset.scan` function: checks a block, fails on (strict) or warns about bad rows.

  Returns the block's well-formed texts. The state, the number of malformed rows this iterator
  has met, spaces the warnings.
  """
  powers_of_ten = tf.constant([10 ** k for k in range(2, 19)], tf.int64)

  def step(seen, rows):
    text, ok = _is_well_formed(rows.text)
    bad = tf.logical_not(ok)
    if strict:
      first = tf.boolean_mask(tf.range(tf.size(text)), bad)[:1]
      message = _problems(rows.file, tf.gather(rows.number, first), tf.gather(text, first))
      with tf.control_dependencies([tf.debugging.Assert(tf.reduce_all(ok), [message])]):
        return seen, tf.identity(text)

    running = seen + tf.cumsum(tf.cast(bad, tf.int64))  # malformed rows up to each row
    warn = tf.logical_and(bad, tf.logical_or(
        running <= _WARN_EACH_FIRST,
        tf.reduce_any(tf.equal(running[:, None], powers_of_ten), axis=1)))

    def log():
      lines = tf.strings.join([
          "Skipping ",
          _problems(rows.file, tf.boolean_mask(rows.number, warn), tf.boolean_mask(text, warn)),
          " (malformed row ", tf.strings.as_string(tf.boolean_mask(running, warn)),
          " of this pass; tf_gba.data.malformed_row_count counts them all)"])
      tf.print(tf.strings.reduce_join(lines, separator="\n"), output_stream=_WARNING_STREAM)
      return tf.constant(True)

    logged = tf.cond(tf.reduce_any(warn), log, lambda: tf.constant(False))
    with tf.control_dependencies([logged]):
      return seen + tf.reduce_sum(tf.cast(bad, tf.int64)), tf.boolean_mask(text, ok)

  return step


def _parse(vocab_sizes: Mapping[str, int], ids: str = VOCAB_IDS):
  """Batch of well-formed lines -> (features, label)."""

  def parse(text):
    fields = tf.strings.split(text, "\t").to_tensor(shape=[None, 40])
    label = tf.strings.to_number(fields[:, 0], tf.float32)
    numeric = fields[:, 1:14]
    numeric = tf.strings.to_number(tf.where(numeric == "", "0", numeric), tf.float64)
    numeric = tf.cast(tf.math.log1p(tf.maximum(numeric, 0.0)), tf.float32)
    features = {name: numeric[:, j] for j, name in enumerate(NUMERIC_NAMES)}
    for j, name in enumerate(CATEGORICAL_NAMES):
      value = fields[:, 14 + j]
      if ids == FINGERPRINT_IDS:
        hashed = hash_table_ops.string_keys(tf.strings.lower(value))
      else:
        hashed = tf.strings.to_hash_bucket_fast(tf.strings.lower(value), vocab_sizes[name] - 1) + 1
      features[name] = tf.where(value == "", tf.constant(MISSING_ID, tf.int64), hashed)
    return features, label

  return parse


# Plain Python that builds a graph: tf.function callers (a ParameterServerStrategy dataset_fn)
# need not convert it.
@tf.autograph.experimental.do_not_convert
def make_dataset(path: str, split: str = "train", batch_size: int = 256, num_shards: int = 1,
                 shard_index: int = 0, day: Optional[int] = None, repeat: bool = False,
                 shuffle_seed: Optional[int] = 0, strict: bool = False,
                 vocab_size: Union[int, Mapping[str, int]] = DEFAULT_VOCAB_SIZE,
                 eval_every: int = 10, shuffle_buffer: int = 10_000,
                 num_days: int = 1, ids: str = VOCAB_IDS) -> tf.data.Dataset:
  """Reads Criteo rows as `(features, label)` batches.

  Args:
    path: a file, a glob or a directory (see `resolve_files`).
    split: "train" or "eval".
    batch_size: rows per batch (the last one may be smaller).
    num_shards, shard_index: this worker reads rows `shard_index, shard_index + num_shards, ...`
      of the split, so the shards partition it. Every worker decompresses every file: with few
      large files (Kaggle's one), sharding by file would leave workers idle.
    day: None (every row) or a pseudo-day in [0, num_days).
    repeat: repeat forever (the shuffle order changes in each epoch).
    shuffle_seed: shuffle train rows through a `shuffle_buffer`-row buffer; None: keep file order.
      Eval rows are never shuffled.
    strict: stop with an error at the first malformed row instead of skipping it.
    vocab_size: ids per categorical feature (one int for all, or a dict by feature name; absent
      names get DEFAULT_VOCAB_SIZE), including id 0 for missing values.
    eval_every: when the split is taken from rows, every `eval_every`-th row is an eval row.
    shuffle_buffer: rows in the shuffle buffer.
    num_days: pseudo-days: the rows of the files read for `split` (train and eval files; or all
      rows, before every `eval_every`-th is taken to eval) cut into `num_days` runs of
      consecutive rows; day d is rows [d * n // num_days, (d + 1) * n // num_days). Counting n
      costs one pass over the files (cached).
    ids: "vocab", categorical ids in [0, vocab_size); "fingerprint", the value's 64-bit
      Fingerprint64 (any int64; missing: 0), for a HashEmbedding.
  """
  pipeline.check_common_args(split, batch_size, num_shards, shard_index)
  _check_num_days(num_days)
  pipeline.check_day(day, num_days)
  sizes = _vocab_sizes(vocab_size)
  if ids not in IDS:
    raise ValueError(f"ids must be one of {IDS}, got {ids!r}.")
  files, split_rows = resolve_files(path, split, eval_every)
  logging.info("Criteo %s split: %d file(s) %s%s", split, len(files), files[:3],
               f", every {eval_every}th row to eval" if split_rows else "")

  row_range = None
  if day is not None and num_days > 1:
    n = _count_lines(files)
    row_range = (day * n // num_days, (day + 1) * n // num_days)
  ds = _selected_rows(files, split, split_rows, eval_every, num_shards, shard_index, row_range)
  ds = ds.scan(tf.constant(0, tf.int64), _check_and_report(strict)).unbatch()
  if split == "train" and shuffle_seed is not None:
    seed = pipeline.shard_seed(shuffle_seed, num_shards, shard_index)
    ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
  if repeat:
    ds = ds.repeat()
  ds = ds.batch(batch_size).map(_parse(sizes, ids), num_parallel_calls=tf.data.AUTOTUNE)
  return ds.prefetch(tf.data.AUTOTUNE)


def malformed_row_count(path: str, split: str = "train", eval_every: int = 10) -> int:
  """How many rows of `split` a reader skips as malformed: one pass with the reader's own check."""
  files, split_rows = resolve_files(path, split, eval_every)

  def count_bad(total, rows):
    _, ok = _is_well_formed(rows.text)
    return total + tf.reduce_sum(tf.cast(tf.logical_not(ok), tf.int64))

  ds = _selected_rows(files, split, split_rows, eval_every, num_shards=1, shard_index=0)
  return int(ds.reduce(tf.constant(0, tf.int64), count_bad))
