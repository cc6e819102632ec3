"""Tests of the Criteo reader, on the shared real rows and on crafted files."""

import collections
import gzip
import math
import os

import numpy as np
import pytest

import tf_gba  # noqa: F401  (sets up Keras 2 before TensorFlow is imported)
import tensorflow as tf

from tf_gba import data
from tf_gba.data import criteo

import shared_data

NUMERIC = [f"I{i}" for i in range(1, 14)]
CATEGORICAL = [f"C{i}" for i in range(1, 27)]


def _sample_dir():
  return shared_data.require("criteo_sample")


def _plain_rows(path):
  """Rows of a Criteo file split with plain Python, independently of the reader."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    return [line.rstrip("\n").split("\t") for line in f]


def _collect(ds):
  features, labels = collections.defaultdict(list), []
  for f, label in ds:
    for name, value in f.items():
      features[name].append(value.numpy())
    labels.append(label.numpy())
  return {k: np.concatenate(v) for k, v in features.items()}, np.concatenate(labels)


def _row_tuples(features, labels):
  names = NUMERIC + CATEGORICAL
  return list(zip(labels.tolist(), *(features[n].tolist() for n in names)))


def _expected_id(value, vocab):
  if not value:
    return 0
  return int(tf.strings.to_hash_bucket_fast(value.lower(), vocab - 1)) + 1


def test_row_counts_hash_range_and_missing_ids():
  spec = "criteo:" + _sample_dir()
  vocab = 50
  features, labels = _collect(data.make_dataset(spec, "train", batch_size=1000, vocab_size=vocab))
  assert len(labels) == 8000
  _, eval_labels = _collect(data.make_dataset(spec, "eval", batch_size=1000, vocab_size=vocab))
  assert len(eval_labels) == 2000

  plain = _plain_rows(os.path.join(_sample_dir(), "train_8k.tsv.gz"))
  assert labels.sum() == sum(int(r[0]) for r in plain)
  for j, name in enumerate(CATEGORICAL):
    ids = features[name]
    assert ids.dtype == np.int64
    assert ids.min() >= 0 and ids.max() < vocab
    # Id 0 is exactly the missing values: the hash buckets start at 1.
    assert np.sum(ids == 0) == sum(1 for r in plain if r[14 + j] == ""), name
  assert len(np.unique(features["C3"])) > 40  # a high-cardinality field fills the range
  assert all(features[n].dtype == np.float32 for n in NUMERIC)


def test_first_rows_match_plain_python_parse():
  vocab = 1000
  features, labels = next(iter(data.make_dataset(
      "criteo:" + _sample_dir(), "train", batch_size=20, shuffle_seed=None, vocab_size=vocab)))
  plain = _plain_rows(os.path.join(_sample_dir(), "train_8k.tsv.gz"))[:20]
  np.testing.assert_array_equal(labels.numpy(), [float(r[0]) for r in plain])
  for j, name in enumerate(NUMERIC):
    want = [math.log1p(max(int(r[1 + j]), 0)) if r[1 + j] else 0.0 for r in plain]
    np.testing.assert_allclose(features[name].numpy(), want, rtol=1e-6, err_msg=name)
  for j, name in enumerate(CATEGORICAL):
    want = [_expected_id(r[14 + j], vocab) for r in plain]
    np.testing.assert_array_equal(features[name].numpy(), want, err_msg=name)


def _expected_ids(rows, vocab):
  """[rows, 26] ids of the plain-Python rows, hashing each column at once."""
  columns = []
  for j in range(26):
    values = np.array([r[14 + j].lower() for r in rows], dtype=object)
    hashed = tf.strings.to_hash_bucket_fast(values, vocab - 1).numpy() + 1
    columns.append(np.where(values == "", 0, hashed))
  return np.stack(columns, axis=1)


def test_shards_partition_rows_of_a_row_split():
  # A single file: the splits come from its rows (every 4th row to eval).
  path = os.path.join(_sample_dir(), "eval_2k.tsv.gz")
  plain = _plain_rows(path)
  ids = _expected_ids(plain, 100)
  want = collections.Counter(
      (float(r[0]),) + tuple(ids[i].tolist()) for i, r in enumerate(plain))
  got, sizes = collections.Counter(), {}
  for split in ("train", "eval"):
    for k in range(2):
      features, labels = _collect(data.make_dataset(
          "criteo:" + path, split, num_shards=2, shard_index=k, eval_every=4, vocab_size=100,
          batch_size=1000))
      sizes[split, k] = len(labels)
      got.update(zip(labels.tolist(), *(features[n].tolist() for n in CATEGORICAL)))
  assert sizes == {("train", 0): 750, ("train", 1): 750, ("eval", 0): 250, ("eval", 1): 250}
  assert got == want  # every row lands in exactly one (split, shard)


def _good_row(k, label=1):
  ints = [str(k * 13 + i - 1) if i % 4 else "" for i in range(13)]
  cats = ["%08x" % (0x1234ABCD + 7919 * k + i) if i % 5 else "" for i in range(26)]
  return "\t".join([str(label)] + ints + cats)


def _write_bad_file(tmp_path, name="bad.tsv"):
  good = [_good_row(k, label=k % 2) for k in range(4)]
  lines = [
      good[0],                                          # 1
      good[1] + "\tdeadbeef",                           # 2: 41 fields
      "2" + good[1][1:],                                # 3: label 2
      good[1].replace("\t13\t", "\t1.5\t", 1),          # 4: I2 not an integer
      good[1].replace("\t1234", "\txyz4", 1),           # 5: C2 not hex
      "",                                               # 6: empty line
      good[2] + "\r",                                   # 7: Windows line end: fine
      good[1].replace("\t13\t", "\t12345678901234567890\t", 1),  # 8: too long to be a count
      good[3],                                          # 9
  ]
  text = "\n".join(lines) + "\n"
  path = tmp_path / name
  if name.endswith(".gz"):
    with gzip.open(path, "wt") as f:
      f.write(text)
  else:
    path.write_text(text)
  return str(path), [good[0], good[2], good[3]]


def test_malformed_rows_are_counted_and_skipped(tmp_path):
  path, good = _write_bad_file(tmp_path)
  spec = "criteo:" + path
  features, labels = _collect(data.make_dataset(spec, eval_every=1000, shuffle_seed=None,
                                                vocab_size=100))
  assert len(labels) == 3
  np.testing.assert_array_equal(labels, [0, 0, 1])
  want_i2 = [math.log1p(int(r.split("\t")[2])) for r in good]
  np.testing.assert_allclose(features["I2"], want_i2, rtol=1e-6)
  assert data.malformed_row_count(spec, eval_every=1000) == 6


def test_malformed_rows_are_logged_as_warnings(tmp_path, monkeypatch):
  # The warnings go to TensorFlow's C++ logger, which the test setup turns down to errors; send
  # them to a file instead (tf.print's "file://" stream) to read them.
  log = tmp_path / "warnings.log"
  monkeypatch.setattr(criteo, "_WARNING_STREAM", "file://" + str(log))
  path, _ = _write_bad_file(tmp_path)
  _collect(data.make_dataset("criteo:" + path, eval_every=1000, vocab_size=100))
  warnings = log.read_text().splitlines()
  for expected in ("bad.tsv:2: has 41 tab-separated fields", "bad.tsv:3: label is '2'",
                   "bad.tsv:4: I2 is '1.5'", "bad.tsv:5: C2 is 'xyz4",
                   "bad.tsv:6: has 1 tab-separated fields", "bad.tsv:8: I2 is '1234567"):
    assert any(expected in line for line in warnings), (expected, warnings)
  assert len(warnings) == 6  # well-formed lines 1, 7 (CRLF) and 9 are not reported
  assert "malformed row 6 of this pass" in warnings[-1]


def test_warnings_are_spaced_out(tmp_path, monkeypatch):
  log = tmp_path / "warnings.log"
  monkeypatch.setattr(criteo, "_WARNING_STREAM", "file://" + str(log))
  (tmp_path / "labels_only.txt").write_text("x\n" * 1500 + _good_row(0) + "\n")
  spec = "criteo:" + str(tmp_path / "labels_only.txt")
  _, labels = _collect(data.make_dataset(spec, eval_every=10 ** 6))
  assert len(labels) == 1
  warnings = log.read_text().splitlines()
  # The first ten, then the 100th and the 1000th.
  assert len(warnings) == 12
  assert "labels_only.txt:1000: has 1 tab-separated" in warnings[-1]
  assert data.malformed_row_count(spec, eval_every=10 ** 6) == 1500


def test_strict_raises_naming_file_and_line(tmp_path):
  path, _ = _write_bad_file(tmp_path)
  ds = data.make_dataset("criteo:" + path, eval_every=1000, strict=True)
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"bad\.tsv:2: has 41 tab-separated"):
    _collect(ds)


def test_gzip_and_plain_read_the_same(tmp_path):
  plain, _ = _write_bad_file(tmp_path, "rows.tsv")
  gz, _ = _write_bad_file(tmp_path, "rows.tsv.gz")
  opts = dict(eval_every=1000, shuffle_seed=None, vocab_size=100)
  a = _row_tuples(*_collect(data.make_dataset("criteo:" + plain, **opts)))
  b = _row_tuples(*_collect(data.make_dataset("criteo:" + gz, **opts)))
  assert a == b and len(a) == 3


def test_directory_without_eval_files_splits_rows(tmp_path):
  rows = [_good_row(k, label=k % 2) for k in range(20)]
  (tmp_path / "train.txt").write_text("\n".join(rows) + "\n")
  (tmp_path / "README.md").write_text("not data\n")
  spec, opts = "criteo:" + str(tmp_path), dict(shuffle_seed=None, vocab_size=100)
  eval_features, eval_labels = _collect(data.make_dataset(spec, "eval", **opts))
  assert len(eval_labels) == 2  # rows 10 and 20
  want = [math.log1p(int(rows[k].split("\t")[2])) for k in (9, 19)]
  np.testing.assert_allclose(eval_features["I2"], want, rtol=1e-6)
  _, train_labels = _collect(data.make_dataset(spec, "train", **opts))
  assert len(train_labels) == 18


def test_vocab_size_per_feature_and_info():
  info = data.data_info("criteo:" + _sample_dir(), vocab_size={"C1": 7})
  assert info.categorical["C1"] == 7 and info.categorical["C2"] == criteo.DEFAULT_VOCAB_SIZE
  assert info.numeric == tuple(NUMERIC) and list(info.categorical) == CATEGORICAL
  assert info.num_days == 1
  features, _ = next(iter(data.make_dataset("criteo:" + _sample_dir(), batch_size=500,
                                            vocab_size={"C1": 7})))
  assert features["C1"].numpy().max() < 7
  with pytest.raises(ValueError, match="unknown features"):
    data.data_info("criteo:" + _sample_dir(), vocab_size={"C99": 7})


def test_bad_paths_and_options(tmp_path):
  with pytest.raises(ValueError, match="nothing at"):
    data.make_dataset("criteo:" + str(tmp_path / "missing.txt"))
  with pytest.raises(ValueError, match="No Criteo files"):
    data.make_dataset("criteo:" + str(tmp_path))  # an empty directory
  with pytest.raises(ValueError, match="takes no option"):
    data.make_dataset("criteo:" + str(tmp_path), drift=0.1)
  with pytest.raises(ValueError, match="day must be"):
    data.make_dataset("criteo:" + _sample_dir(), day=1)


def _numbered_file(tmp_path, n):
  """A Criteo file whose row r has I1 = r (read back as log1p(r)), to follow rows by number."""
  path = tmp_path / "rows.tsv"
  with open(path, "w") as f:
    for r in range(n):
      f.write("\t".join([str(r % 2), str(r)] + ["1"] * 12 + ["0000abcd"] * 26) + "\n")
  return str(path)


def _row_numbers(ds):
  if not any(int(y.shape[0]) for _, y in ds):
    return []
  features, _ = _collect(ds)
  return sorted(np.rint(np.expm1(features["I1"])).astype(int).tolist())


def test_pseudo_days_cut_the_rows_in_order(tmp_path):
  # 23 rows, 3 days: rows [0, 7), [7, 15), [15, 23); every 10th row (9, 19) is an eval row.
  path = _numbered_file(tmp_path, 23)
  spec = "criteo:" + path
  assert data.data_info(spec, num_days=3).num_days == 3
  days = {(split, d): _row_numbers(data.make_dataset(spec, split, batch_size=5, day=d,
                                                     num_days=3, shuffle_seed=None))
          for split in ("train", "eval") for d in range(3)}
  bounds = [(0, 7), (7, 15), (15, 23)]
  for d, (lo, hi) in enumerate(bounds):
    assert days[("train", d)] == [r for r in range(lo, hi) if r % 10 != 9]
    assert days[("eval", d)] == [r for r in range(lo, hi) if r % 10 == 9]
  # Sharded: the two shards of a day partition it.
  shards = [_row_numbers(data.make_dataset(spec, "train", batch_size=5, day=1, num_days=3,
                                           num_shards=2, shard_index=i, shuffle_seed=None))
            for i in range(2)]
  assert sorted(shards[0] + shards[1]) == days[("train", 1)] and shards[0] and shards[1]


def test_pseudo_days_of_the_sample_split_train_and_eval_files():
  spec = "criteo:" + _sample_dir()
  train = [len(_collect(data.make_dataset(spec, "train", batch_size=4096, day=d, num_days=4,
                                          shuffle_seed=None))[1]) for d in range(4)]
  evals = [len(_collect(data.make_dataset(spec, "eval", batch_size=4096, day=d, num_days=4,
                                          shuffle_seed=None))[1]) for d in range(4)]
  assert train == [2000] * 4 and evals == [500] * 4


def test_bad_num_days_and_day():
  spec = "criteo:" + _sample_dir()
  with pytest.raises(ValueError, match="num_days must be an integer >= 1"):
    data.data_info(spec, num_days=0)
  with pytest.raises(ValueError, match="day must be None"):
    data.make_dataset(spec, "train", day=3, num_days=3)
