"""Tests of the MovieLens-100K reader, on the shared GroupLens files and on crafted files."""

import collections
import gzip

import numpy as np
import pytest

import tf_gba  # noqa: F401  (sets up Keras 2 before TensorFlow is imported)

from tf_gba import data

import shared_data

FEATURES = ("user_id", "item_id", "age_bucket", "gender", "occupation", "zip_prefix", "genre")


def _spec():
  return "movielens100k:" + shared_data.require("movielens_100k")


def _plain(name):
  """Lines of a shared GroupLens file, read with plain Python, independently of the reader."""
  path = shared_data.require("movielens_100k", name + ".gz")
  with gzip.open(path, "rt", encoding="latin-1") as f:
    return [line.rstrip("\n") for line in f if line.strip()]


def _ratings():
  """(user, item) -> (rating, timestamp); each user rates an item at most once in ML-100K."""
  out = {}
  for line in _plain("u.data"):
    user, item, rating, ts = map(int, line.split("\t"))
    out[(user, item)] = (rating, ts)
  return out


def _collect(ds):
  features, labels = collections.defaultdict(list), []
  for f, label in ds:
    for name, value in f.items():
      features[name].append(value.numpy())
    labels.append(label.numpy())
  return {k: np.concatenate(v) for k, v in features.items()}, np.concatenate(labels)


def _pairs(features):
  return list(zip(features["user_id"].tolist(), features["item_id"].tolist()))


def test_all_ratings_and_label_rate():
  ratings = _ratings()
  assert len(ratings) == 100_000
  labels = []
  for split in ("train", "eval"):
    labels.append(_collect(data.make_dataset(_spec(), split, batch_size=10_000))[1])
  labels = np.concatenate(labels)
  assert len(labels) == 100_000
  clicks = sum(1 for rating, _ in ratings.values() if rating >= 4)
  assert labels.sum() == clicks
  assert labels.mean() == pytest.approx(clicks / 100_000)


def test_days_are_consecutive_time_slices():
  ratings = _ratings()
  num_days = 4
  previous_latest = -1
  for day in range(num_days):
    times = {}
    for split in ("train", "eval"):
      features, labels = _collect(data.make_dataset(
          _spec(), split, day=day, num_days=num_days, batch_size=10_000, shuffle_seed=None))
      times[split] = np.array([ratings[p][1] for p in _pairs(features)])
      # Labels belong to the right rows.
      np.testing.assert_array_equal(labels, [ratings[p][0] >= 4 for p in _pairs(features)])
      # Without shuffling the rows come in time order.
      assert np.all(np.diff(times[split]) >= 0)
    assert len(times["train"]) + len(times["eval"]) == 25_000  # equal-count days
    assert len(times["eval"]) == 2_500
    assert times["train"].max() <= times["eval"].min()  # eval: the day's latest ratings
    assert previous_latest <= times["train"].min()  # every day after the previous one
    previous_latest = times["eval"].max()


def _age_bucket(age):
  if age < 18:
    return 1
  for bucket, upper in enumerate((25, 35, 45, 50, 56), start=2):
    if age < upper:
      return bucket
  return 7


def test_features_are_joined_from_user_and_item_files():
  users = {}
  for line in _plain("u.user"):
    uid, age, gender, occupation, zip_code = line.split("|")
    users[int(uid)] = (int(age), gender, occupation, zip_code[:3])
  occupations = _plain("u.occupation")
  first_genre = {}
  for line in _plain("u.item"):
    fields = line.split("|")
    flags = [int(x) for x in fields[5:]]
    first_genre[int(fields[0])] = flags.index(1) + 1 if 1 in flags else 0
  ratings = _ratings()

  features, labels = _collect(data.make_dataset(_spec(), "train", day=2, batch_size=10_000,
                                                shuffle_seed=None))
  rng = np.random.default_rng(0)
  for i in list(range(20)) + rng.choice(len(labels), 200, replace=False).tolist():
    user, item = features["user_id"][i], features["item_id"][i]
    age, gender, occupation, _ = users[user]
    assert labels[i] == (ratings[(user, item)][0] >= 4)
    assert features["age_bucket"][i] == _age_bucket(age)
    assert features["gender"][i] == {"M": 1, "F": 2}[gender]
    assert features["occupation"][i] == occupations.index(occupation) + 1
    assert features["genre"][i] == first_genre[item]

  # Zip prefixes: one id per prefix, numbered in sorted prefix order from 1.
  by_prefix = collections.defaultdict(set)
  for user, zid in zip(features["user_id"], features["zip_prefix"]):
    by_prefix[users[user][3]].add(int(zid))
  assert all(len(ids) == 1 for ids in by_prefix.values())
  ordered = [next(iter(by_prefix[p])) for p in sorted(by_prefix)]
  assert ordered == sorted(ordered) and ordered[0] >= 1


def test_info_and_shards():
  info = data.data_info(_spec(), num_days=5)
  assert info.num_days == 5 and info.numeric == ()
  assert info.categorical["user_id"] == 944 and info.categorical["item_id"] == 1683
  assert info.categorical["genre"] == 20 and info.categorical["age_bucket"] == 8
  assert data.malformed_row_count(_spec()) == 0

  whole, _ = _collect(data.make_dataset(_spec(), "train", day=1, batch_size=10_000))
  shards = collections.Counter()
  sizes = []
  for k in range(3):
    part, _ = _collect(data.make_dataset(_spec(), "train", day=1, batch_size=10_000,
                                         num_shards=3, shard_index=k))
    for name in FEATURES:
      assert part[name].max() < info.categorical[name]
    sizes.append(len(part["user_id"]))
    shards.update(_pairs(part))
  assert shards == collections.Counter(_pairs(whole))  # a partition of the day's rows
  assert max(sizes) - min(sizes) <= 1


_USERS = ["1|24|M|technician|85711",
          "2|53|X|other|94043",       # line 2: gender X
          "3|23|M|writer|32067",
          "4|17|F|student|T8H1N"]


def _item(item_id, genres, title="A Film (1995)"):
  flags = ["1" if g in genres else "0" for g in range(19)]
  return "|".join([str(item_id), title, "01-Jan-1995", "", "http://x"] + flags)


_ITEMS = [_item(1, {3, 4}),
          "2|Broken (1995)|01-Jan-1995",  # line 2: 3 fields
          _item(3, set())]
_DATA = ["1\t1\t5\t100",
         "3\t3\t2\t50",
         "1\t3\tx\t70",   # line 3: rating x
         "2\t1\t4\t80",   # line 4: user 2's row is malformed
         "4\t1\t6\t90",   # line 5: rating 6
         "4\t3\t4\t60",
         "4\t2\t5\t65",   # line 7: item 2's row is malformed
         "1\t1\t3"]       # line 8: 3 fields


def _write_files(directory, compress):
  for name, lines in (("u.user", _USERS), ("u.item", _ITEMS), ("u.data", _DATA)):
    text = "\n".join(lines) + "\n"
    if compress:
      with gzip.open(directory / (name + ".gz"), "wt", encoding="latin-1") as f:
        f.write(text)
    else:
      (directory / name).write_text(text, encoding="latin-1")
  return "movielens100k:" + str(directory)


@pytest.mark.parametrize("compress", [False, True])
def test_crafted_files_plain_or_gzip_with_malformed_rows(tmp_path, compress):
  spec = _write_files(tmp_path, compress)
  opts = dict(num_days=1, eval_fraction=0.34)
  assert data.malformed_row_count(spec, **opts) == 7
  train, train_labels = _collect(data.make_dataset(spec, "train", shuffle_seed=None, **opts))
  evals, eval_labels = _collect(data.make_dataset(spec, "eval", shuffle_seed=None, **opts))
  # Well-formed ratings in time order: (3, 3) at 50, (4, 3) at 60, then (1, 1) at 100 as eval.
  assert _pairs(train) == [(3, 3), (4, 3)] and _pairs(evals) == [(1, 1)]
  np.testing.assert_array_equal(train_labels, [0, 1])
  np.testing.assert_array_equal(eval_labels, [1])
  np.testing.assert_array_equal(train["age_bucket"], [2, 1])     # 23, 17
  np.testing.assert_array_equal(train["gender"], [1, 2])
  np.testing.assert_array_equal(train["occupation"], [21, 19])   # writer, student
  np.testing.assert_array_equal(train["zip_prefix"], [1, 3])     # of 320, 857, T8H
  np.testing.assert_array_equal(train["genre"], [0, 0])
  np.testing.assert_array_equal(evals["genre"], [4])             # Animation, the first flag
  np.testing.assert_array_equal(evals["zip_prefix"], [2])

  with pytest.raises(ValueError, match=r"u\.user(\.gz)?:2: gender is 'X'.*7 malformed rows"):
    data.make_dataset(spec, strict=True, **opts)


def test_bad_paths_and_options(tmp_path):
  with pytest.raises(ValueError, match="nothing at"):
    data.make_dataset("movielens100k:" + str(tmp_path / "missing"))
  with pytest.raises(ValueError, match="no u.data or u.data.gz"):
    data.make_dataset("movielens100k:" + str(tmp_path))
  spec = _write_files(tmp_path, compress=False)
  with pytest.raises(ValueError, match="takes no option"):
    data.make_dataset(spec, vocab_size=10)
  with pytest.raises(ValueError, match="day must be"):
    data.make_dataset(spec, num_days=2, day=2)
