"""The training binary with --embedding=hash on real servers (2 workers, 2 parameter servers) and
the real Criteo sample: gba and async train, the summary's rows and bytes are the table's, and a
rerun with another --num_ps resumes with the same rows. The refusals are at the end."""

import gzip
import json
import os
import subprocess

import numpy as np
import pytest
import tensorflow as tf
from absl import flags

from tests import script_process
from tests import shared_data
from tests import train_binary
from tf_gba import data as data_lib
from tf_gba import models as models_lib
from tf_gba.ops import hash_table_ops
from tf_gba.training import summary as summary_lib

FLAGS = flags.FLAGS
DIM = 8           # --embedding_dim (DeepFM's rows are DIM + 1 wide)
BATCH = 200       # the sample's 8,000 train rows are 40 batches: one pass is 40 worker steps
STEPS = 40
FIELDS = 26
ADAM_SLOTS = 2    # m and v
BLOCK_ROWS = 16384  # rows per block of the table (hash_table.h)
ROW_META = 32     # a row's tag, frequency, last_seen and latest write number (int64 each)
INDEX_SLOT = 17   # a key index slot: (int64 key, int64 row) and one control byte


train = train_binary.load()


def _run(model_dir, **overrides):
  """train.main with the test's flags; returns the summary it wrote."""
  FLAGS.unparse_flags()
  FLAGS(["train.py"])
  values = dict(embedding="hash", num_workers=2, num_ps=2, local_batch_size=BATCH,
                log_every=20, eval_examples=2000, model_dir=str(model_dir), stragglers="none",
                data=f"criteo:{shared_data.require('criteo_sample')}")
  values.update(overrides)
  try:
    for k, v in values.items():
      setattr(FLAGS, k, v)
    summary = train.main(["train.py"])
  finally:
    FLAGS.unparse_flags()
  with open(os.path.join(model_dir, "summary.json")) as f:
    assert json.load(f) == json.loads(json.dumps(summary))
  assert summary_lib.unknown_keys(summary) == []
  return summary


def _distinct_field_values() -> int:
  """Distinct (field, lower-cased value) pairs of the sample's train rows, read here with the
  gzip module: each is one key (an empty value is its field's missing id)."""
  path = os.path.join(shared_data.require("criteo_sample"), "train_8k.tsv.gz")
  seen = set()
  with gzip.open(path, "rt") as f:
    for line in f:
      fields = line.rstrip("\n").split("\t")
      assert len(fields) == 40
      seen.update((j, fields[14 + j].lower()) for j in range(FIELDS))
  return len(seen)


def _mix64(keys: np.ndarray) -> np.ndarray:
  """splitmix64's finaliser in NumPy uint64 arithmetic (wrapping), the shard rule's mixer."""
  z = keys.astype(np.uint64)
  with np.errstate(over="ignore"):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return z ^ (z >> np.uint64(31))


def _checkpoint_rows(path: str) -> dict:
  """The table's rows in checkpoint `path`, read into a model of this process, sorted by key."""
  info = data_lib.data_info(f"criteo:{shared_data.require('criteo_sample')}")
  model = models_lib.build_model("deepfm", info, embedding_dim=DIM, embedding="hash")
  tf.train.Checkpoint(model=model).read(path).expect_partial()
  rows = model.get_layer("categorical_embedding").table.export()
  order = np.argsort(rows["keys"].numpy())
  return {f: rows[f].numpy()[order] for f in hash_table_ops.EXPORT_FIELDS}


def _check_table_report(summary, rows, num_ps, distinct):
  table = summary["hash_tables"]["categorical_embedding"]
  assert summary["embedding"] == "hash"
  assert table["rows"] == distinct == len(rows["keys"])
  shards = _mix64(rows["keys"]) % np.uint64(num_ps)
  assert table["rows_per_shard"] == [int(np.sum(shards == i)) for i in range(num_ps)]
  row_bytes = (DIM + 1) * (1 + ADAM_SLOTS) * 4
  assert table["row_bytes"] == row_bytes and rows["slots"].shape[1:] == (ADAM_SLOTS, DIM + 1)
  assert table["bytes_per_row"] == round(table["allocated_bytes"] / table["rows"], 1)
  # Whole blocks of rows, and a key index between 7/16 and 7/8 full (16 slots at least).
  blocks = sum(-(-r // BLOCK_ROWS) for r in table["rows_per_shard"])
  block_bytes = blocks * BLOCK_ROWS * (row_bytes + ROW_META)
  low = block_bytes + sum(r * 8 / 7 for r in table["rows_per_shard"]) * INDEX_SLOT
  high = block_bytes + sum(max(16, r * 16 / 7 + 1) for r in table["rows_per_shard"]) * INDEX_SLOT
  assert low <= table["allocated_bytes"] <= high


@pytest.fixture(scope="module")
def gba_run(tmp_path_factory):
  model_dir = tmp_path_factory.mktemp("hash_gba") / "model"
  return model_dir, _run(model_dir, mode="gba")


def _check_one_pass(summary):
  """Every batch of the day trained once: every key of the train rows was looked up in training
  (and evaluation, find-only, inserted none)."""
  assert summary["data_list"]["duplicates"] == 0 and summary["data_list"]["missed"] == 0
  assert summary["data_list"]["batches"] == STEPS


def test_gba_trains_one_pass_and_reports_the_table(gba_run):
  model_dir, summary = gba_run
  _check_one_pass(summary)
  assert summary["steps"] == STEPS and summary["global_step"] == STEPS // 2  # M = 2
  assert summary["eval_examples"] == 2000 and 0.5 < summary["eval_auc"] <= 1.0
  rows = _checkpoint_rows(summary["checkpoint"])
  _check_table_report(summary, rows, 2, _distinct_field_values())
  # Frequency: one per worker batch holding the key (deduplicated within it).
  assert rows["frequency"].min() >= 1
  assert rows["frequency"].sum() <= STEPS * BATCH * FIELDS
  assert rows["tags"].max() == summary["global_step"] - 1
  # The serving SavedModel holds every row (served by stock TensorFlow: test_serving_export.py).
  assert os.listdir(os.path.join(model_dir, "export")) == [str(summary["global_step"])]
  sizes = [shape for name, shape in tf.train.list_variables(os.path.join(
      model_dir, "export", str(summary["global_step"]), "variables", "variables"))
           if "serving_rows/sorted_keys" in name]
  assert sizes == [[len(rows["keys"]) + 1]]  # and the largest int64, the search's end


def test_async_trains_one_pass_and_reports_the_table(tmp_path):
  summary = _run(tmp_path / "model", mode="async")
  _check_one_pass(summary)
  assert summary["steps"] == STEPS and summary["global_step"] == STEPS  # M = 1
  assert 0.5 < summary["eval_auc"] <= 1.0
  rows = _checkpoint_rows(summary["checkpoint"])
  _check_table_report(summary, rows, 2, _distinct_field_values())
  assert rows["tags"].max() == STEPS - 1


def test_sync_trains_one_pass_and_reports_the_table(tmp_path, capsys):
  """--mode=sync: every worker holds the whole table (one shard) and looks up the union of the
  two workers' batches; one pass (20 global steps of 2 x 200 rows) inserts every distinct
  (field, value) pair of the train rows, once each, in the checkpoint the other modes read."""
  summary = _run(tmp_path / "model", mode="sync", num_ps=1, steps=STEPS)
  out = capsys.readouterr().out
  assert "hash table categorical_embedding " in out and "a copy on every worker" in out
  assert summary["mode"] == "sync" and summary["steps"] == STEPS
  assert summary["global_step"] == STEPS // 2
  assert 0.5 < summary["eval_auc"] <= 1.0
  rows = _checkpoint_rows(summary["checkpoint"])
  _check_table_report(summary, rows, 1, _distinct_field_values())
  # Counted once per global step whose batches held the key: at most the 20 steps.
  assert rows["frequency"].min() >= 1 and rows["frequency"].max() <= STEPS // 2
  assert rows["last_seen"].max() == STEPS // 2 - 1
  assert np.all(rows["tags"] == -1)  # GBA's tags: sync writes none


def test_admission_and_budget_through_the_binary(tmp_path):
  # One pass with --hash_min_frequency=2 and --hash_max_rows=10000: 20 global steps, fewer than
  # the eviction interval, so the only eviction is the final checkpoint's, after every lookup.
  summary = _run(tmp_path / "model", mode="gba", hash_min_frequency=2, hash_max_rows=10_000)
  _check_one_pass(summary)
  table = summary["hash_tables"]["categorical_embedding"]
  assert (table["min_frequency"], table["ttl_steps"], table["max_rows"]) == (2, 0, 10_000)
  # Every distinct (field, value) pair was looked up: once (pending) or at least twice (admitted
  # once, at its second lookup; nothing was evicted before the end).
  assert table["pending"] + table["admitted"] == _distinct_field_values()
  assert table["rows"] == table["admitted"] - table["evicted"]
  assert table["filtered"] > 0 and table["evicted"] > 0
  assert all(r <= 5_000 for r in table["rows_per_shard"])
  rows = _checkpoint_rows(summary["checkpoint"])
  assert len(rows["keys"]) == table["rows"] <= 10_000
  shards = _mix64(rows["keys"]) % np.uint64(2)
  assert table["rows_per_shard"] == [int(np.sum(shards == i)) for i in range(2)]
  assert rows["frequency"].min() >= 2


def test_admission_filter_through_the_binary(tmp_path):
  # The same pass with the counts in a counting Bloom filter of 2^16 cells per parameter server.
  cells = 1 << 16
  summary = _run(tmp_path / "model", mode="gba", hash_min_frequency=2,
                 hash_admission_filter_cells=cells)
  _check_one_pass(summary)
  table = summary["hash_tables"]["categorical_embedding"]
  assert table["admission_filter_cells"] == cells
  # `pending` counts cells in use; every admitted key had a count of at least 2 (or a false
  # positive), so at least the exact run's admissions happen and no more than the distinct pairs.
  assert 0 < table["pending"] <= 2 * cells
  assert 0 < table["admitted"] <= _distinct_field_values() and table["filtered"] > 0
  # The model's one hash table: its entries end in /.ATTRIBUTES/<field>.
  entries = {n.rsplit("/", 1)[1]: n for n, _ in tf.train.list_variables(summary["checkpoint"])
             if n.rsplit("/", 2)[-2:-1] == [".ATTRIBUTES"] and "table" in n}
  assert "admission_filter" in entries and "pending_keys" not in entries, sorted(entries)
  filters = tf.train.load_variable(summary["checkpoint"], entries["admission_filter"])
  assert filters.shape == (2, cells) and filters.dtype == np.uint8
  rows = _checkpoint_rows(summary["checkpoint"])
  assert len(rows["keys"]) == table["rows"] and rows["frequency"].min() >= 2


def _check_resumed(before, after):
  """The rows of `before` carried over: equal where the resumed steps did not look the key up,
  looked up again (frequency up, last_seen later) otherwise; no key lost."""
  np.testing.assert_array_equal(after["keys"], before["keys"])  # every key is in each pass
  same = after["frequency"] == before["frequency"]
  assert 0 < np.sum(same) < len(same)
  for f in ("values", "slots", "tags", "last_seen"):
    np.testing.assert_array_equal(after[f][same], before[f][same], err_msg=f)
  assert np.all(after["frequency"][~same] > before["frequency"][~same])
  assert np.all(after["last_seen"][~same] >= before["last_seen"][~same])


def test_resume_into_other_parameter_server_counts_keeps_the_rows(gba_run, tmp_path):
  source, first = gba_run
  model_dir = tmp_path / "model"
  subprocess.run(["cp", "-r", str(source), str(model_dir)], check=True)
  before = _checkpoint_rows(first["checkpoint"])
  previous = first
  for num_ps in (1, 3):
    summary = _run(model_dir, mode="gba", num_ps=num_ps, steps=20)
    assert summary["num_ps"] == num_ps
    assert summary["start_global_step"] == previous["global_step"]
    assert summary["global_step"] == previous["global_step"] + 10
    after = _checkpoint_rows(summary["checkpoint"])
    _check_table_report(summary, after, num_ps, len(before["keys"]))
    _check_resumed(before, after)
    before, previous = after, summary


def test_field_keys_tag_each_field_in_the_top_byte():
  ids = np.array([[0, 0, 5], [5, -1, 2**40]], np.int64)
  layer = models_lib.FieldKeys(["a", "b", "c"])
  keys = layer({"a": ids[:, 0], "b": ids[:, 1], "c": ids[:, 2]}).numpy()
  expected = ids.copy()
  expected[:, 1] ^= 1 << 56
  expected[:, 2] ^= 2 << 56
  np.testing.assert_array_equal(keys, expected)
  np.testing.assert_array_equal(models_lib.embedding.field_keys(["a", "b", "c"], ids), expected)
  assert keys[0, 0] != keys[0, 1] and keys[0, 2] != keys[1, 0]  # equal ids, other fields


def test_criteo_fingerprint_ids_keep_every_value_apart_and_vocab_ids_unchanged():
  spec = f"criteo:{shared_data.require('criteo_sample')}"
  hashed = data_lib.make_dataset(spec, batch_size=8000, shuffle_seed=None, ids="fingerprint")
  vocab = data_lib.make_dataset(spec, batch_size=8000, shuffle_seed=None, vocab_size=1000)
  (fx, _), (vx, _) = next(iter(hashed)), next(iter(vocab))
  path = os.path.join(shared_data.require("criteo_sample"), "train_8k.tsv.gz")
  with gzip.open(path, "rt") as f:
    values = [line.rstrip("\n").split("\t")[14:] for line in f]
  for j in range(FIELDS):
    column = [v[j].lower() for v in values]
    keys = fx[f"C{j + 1}"].numpy()
    assert len(keys) == len(column) == 8000
    # One key per value: as many distinct keys as distinct values, and a missing value is 0.
    pairs = set(zip(column, keys.tolist()))
    assert len(pairs) == len(set(column)) == len(set(keys.tolist()))
    assert all((k == 0) == (v == "") for v, k in pairs)
    ids = vx[f"C{j + 1}"].numpy()
    assert ids.min() >= 0 and ids.max() < 1000


def _train_subprocess(*args):
  return script_process.run(list(args), timeout=120)


def test_a_mode_that_cannot_host_the_table_is_refused_in_one_line(tmp_path):
  proc = _train_subprocess("--mode=dts", "--embedding=hash", f"--model_dir={tmp_path / 'm'}")
  assert proc.returncode == 2
  assert proc.stderr.strip() == (
      "train.py: error: --embedding=hash cannot run in --mode=dts: the hash table lives on the "
      "parameter servers, updated through the GBA optimizer, or whole on every worker of "
      "--mode=sync; only sync, gba, async, bsp, hop_bs, hop_bw, async_tuned host it; use one of "
      "them, or --embedding=vocab.")
  assert not os.path.exists(tmp_path / "m")  # refused before anything was written
