"""Each worker's shard position (tf_gba.training.shard_position), as a resumed run reads it.

A resumption skips, in each worker's shard, the batches the checkpoint counted as trained. That
is only right if the shard's order is the same in the new process: these tests build the
uninterrupted shard, the shard skipped through a position saved in and restored from a real
checkpoint, and the same shard in another process, and compare the batches (across an epoch
boundary, where the order is reshuffled). Positions of another run (workers, day, local batch)
are not used, and say so.
"""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tf_gba import data as data_lib
from tf_gba.training.shard_position import ShardPosition

import shared_data

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BATCH = 64


def _spec(source):
  if source == "synthetic":
    return "synthetic", {"num_examples": 1000}  # 500 rows a shard: an epoch is 8 batches
  return "criteo:" + shared_data.require("criteo_sample"), {}  # about 70 batches a shard


def _shard(spec, options):
  return data_lib.make_dataset(spec, split="train", batch_size=_BATCH, num_shards=2,
                               shard_index=1, repeat=True, shuffle_seed=3, **options)


def _digest(batches):
  """One hash per batch over every feature column and the labels."""
  out = []
  for features, labels in batches:
    h = hashlib.sha256()
    for name in sorted(features):
      h.update(name.encode())
      h.update(np.asarray(features[name]).tobytes())
    h.update(np.asarray(labels).tobytes())
    out.append(h.hexdigest())
  return out


_OTHER_PROCESS = """
import hashlib, json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import tf_gba
from tf_gba import data as data_lib
ds = data_lib.make_dataset(sys.argv[2], split="train", batch_size=int(sys.argv[3]), num_shards=2,
                           shard_index=1, repeat=True, shuffle_seed=3, **json.loads(sys.argv[4]))
for features, labels in ds.skip(int(sys.argv[5])).take(int(sys.argv[6])):
  h = hashlib.sha256()
  for name in sorted(features):
    h.update(name.encode())
    h.update(np.asarray(features[name]).tobytes())
  h.update(np.asarray(labels).tobytes())
  print(h.hexdigest())
"""


@pytest.mark.parametrize("source,trained", [("synthetic", 13), ("criteo", 68)])
def test_a_restored_position_resumes_each_shard_after_its_trained_batches(tmp_path, source,
                                                                          trained):
  spec, options = _spec(source)
  more = 6  # reaches into the next epoch from `trained`
  uninterrupted = _digest(_shard(spec, options).take(trained + more))
  assert len(set(uninterrupted)) == len(uninterrupted)  # batches a comparison can tell apart

  saved = ShardPosition(2, None, _BATCH)
  saved.record([5, trained])
  path = tf.train.Checkpoint(shard_position=saved.module).write(str(tmp_path / "ckpt"))
  resumed = ShardPosition(2, None, _BATCH)
  lines = []
  np.testing.assert_array_equal(resumed.restore(path, lines.append), [5, trained])
  assert not lines
  after = _digest(resumed.skip(_shard(spec, options), 1).take(more))
  assert after == uninterrupted[trained:]

  # A resumed run is a new process: its shard must come in the same order there.
  proc = subprocess.run(
      [sys.executable, "-c", _OTHER_PROCESS, _ROOT, spec, str(_BATCH), json.dumps(options),
       str(trained), str(more)],
      capture_output=True, text=True, timeout=300,
      env=dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.split() == uninterrupted[trained:]


def test_a_position_adds_this_runs_batches_to_the_restored_ones(tmp_path):
  first = ShardPosition(3, 2, _BATCH)
  first.record([4, 5, 6])
  path = tf.train.Checkpoint(shard_position=first.module).write(str(tmp_path / "a"))
  second = ShardPosition(3, 2, _BATCH)
  second.restore(path, print)
  second.record([1, 0, 2])
  path = tf.train.Checkpoint(shard_position=second.module).write(str(tmp_path / "b"))
  third = ShardPosition(3, 2, _BATCH)
  np.testing.assert_array_equal(third.restore(path, print), [5, 5, 8])


@pytest.mark.parametrize("other", [dict(num_workers=2), dict(day=1), dict(batch_size=32)])
def test_a_position_of_another_run_is_not_used_and_said(tmp_path, other):
  shape = dict(num_workers=3, day=2, batch_size=_BATCH)
  saved = ShardPosition(**shape)
  saved.record([4, 5, 6])
  path = tf.train.Checkpoint(shard_position=saved.module).write(str(tmp_path / "ckpt"))
  lines = []
  resumed = ShardPosition(**dict(shape, **other))
  np.testing.assert_array_equal(resumed.restore(path, lines.append),
                                np.zeros([resumed.num_workers]))
  assert len(lines) == 1 and "starts from its beginning" in lines[0], lines
  assert "3 workers, day 2, local batch 64" in lines[0]


def test_no_checkpoint_or_one_without_a_position_starts_every_shard_at_its_beginning(tmp_path):
  lines = []
  assert ShardPosition(2, None, _BATCH).restore(None, lines.append).tolist() == [0, 0]
  other_mode = tf.train.Checkpoint(step=tf.Variable(3)).write(str(tmp_path / "ckpt"))
  assert ShardPosition(2, None, _BATCH).restore(other_mode, lines.append).tolist() == [0, 0]
  assert not lines
  ds = tf.data.Dataset.range(5)
  assert ShardPosition(2, None, _BATCH).skip(ds, 0) is ds
