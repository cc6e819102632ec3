"""Size on disk of an incremental (delta) hash-table checkpoint against a full one.

  python -m benchmarks.hash_checkpoint_delta [--keys=1000000] [--changed=0.01] [--shards=2]
      [--dim=16] [--optimizer=adagrad] [--evicted=0.0] [--out=DIR]

A table of `shards` shards gets `keys` random int64 keys (one training lookup and one apply of
`optimizer` each), and tf.train.Checkpoint writes it whole. Then a `changed` share of the keys
is trained again (a lookup and an apply: new values, slots and counters) and, with `evicted`,
that share of new keys arrives in a table whose budget (max_rows) is the first `keys`, so as many
of the keys trained once are evicted; the delta checkpoint written next holds the changed and new
rows and the removed keys. Printed: both checkpoints' bytes on disk (data and
index files), their ratio, and the seconds each save took; the delta is then restored on top of
the full checkpoint into a fresh table and compared with the trained one, row by row. With
--out, the figures go to DIR/hash_checkpoint_delta.json.
"""

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import tf_gba  # noqa: E402,F401
import tensorflow as tf  # noqa: E402

from tf_gba.ops import hash_table_ops  # noqa: E402

_BATCH = 1 << 16


def _train(table, keys: np.ndarray, optimizer: str, step: int, rng) -> None:
  """One lookup and one apply of every key, in batches."""
  for i in range(0, len(keys), _BATCH):
    k = tf.constant(keys[i:i + _BATCH], tf.int64)
    table.lookup(k, step)
    grads = tf.constant(rng.normal(size=(len(keys[i:i + _BATCH]), table.dim)), tf.float32)
    table.apply(k, grads, optimizer, learning_rate=0.05, iteration=step)


def _bytes_on_disk(prefix: str) -> int:
  directory, base = os.path.split(prefix)
  return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
             if f.startswith(base + "."))


def _rows(table):
  rows = {f: v.numpy() for f, v in table.export().items()}
  order = np.argsort(rows["keys"])
  return {f: rows[f][order] for f in hash_table_ops.EXPORT_FIELDS}


def run(keys: int, changed: float, shards: int, dim: int, optimizer: str, evicted: float,
        directory: str) -> dict:
  rng = np.random.default_rng(0)
  all_keys = np.unique(rng.integers(-2**62, 2**62, size=keys, dtype=np.int64))
  devices = ["/cpu:0"] * shards

  def make(max_rows=0):
    table = hash_table_ops.ShardedHashTable(dim, devices=devices, seed=1, max_rows=max_rows)
    table.enable_incremental_checkpoints()
    return table

  # The budget holds the first keys exactly: new keys push out as many of the keys trained once.
  budget = len(all_keys) if evicted else 0
  table = make(budget)
  _train(table, all_keys, optimizer, 0, rng)
  ckpt = tf.train.Checkpoint(table=table)
  out = {"keys": int(len(all_keys)), "shards": shards, "dim": dim, "optimizer": optimizer}
  for name, full, train in (("full", True, None), ("delta", False, changed)):
    if train is not None:
      # The changed keys are the most trained ones: a budget evicts among the others.
      chosen = rng.choice(all_keys, size=int(round(train * len(all_keys))), replace=False)
      _train(table, chosen, optimizer, 1, rng)
      _train(table, chosen, optimizer, 2, rng)
      new = rng.integers(2**62, 2**63 - 1, size=int(round(evicted * len(all_keys))),
                         dtype=np.int64)
      _train(table, np.unique(new), optimizer, 2, rng)
      out["changed_keys"] = int(len(chosen))
      out["new_keys"] = int(len(np.unique(new)))
    start = time.perf_counter()
    table.stage_checkpoint(full=full)
    staged = table.staged_entries
    path = ckpt.write(os.path.join(directory, name, "ckpt"))
    table.checkpoint_written()
    out[f"{name}_save_s"] = round(time.perf_counter() - start, 3)
    out[f"{name}_bytes"] = _bytes_on_disk(path)
    out[f"{name}_rows"] = int(staged["keys"].shape[0])
    out[f"{name}_deleted_keys"] = int(staged[hash_table_ops.DELETED_FIELD].shape[0])
    out[f"{name}_path"] = path
  out["delta_over_full"] = round(out["delta_bytes"] / out["full_bytes"], 5)
  # Full + delta into a fresh table: the same rows as the trained one.
  fresh = make(budget)
  restore = tf.train.Checkpoint(table=fresh)
  start = time.perf_counter()
  for name in ("full", "delta"):
    restore.read(out[f"{name}_path"]).assert_consumed()
  fresh.checkpoint_restored()
  out["restore_s"] = round(time.perf_counter() - start, 3)
  want, got = _rows(table), _rows(fresh)
  out["restored_equal"] = bool(all(np.array_equal(want[f], got[f]) for f in want))
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--keys", type=int, default=1_000_000)
  parser.add_argument("--changed", type=float, default=0.01,
                      help="share of the keys trained again between the two checkpoints")
  parser.add_argument("--shards", type=int, default=2)
  parser.add_argument("--dim", type=int, default=16)
  parser.add_argument("--optimizer", default="adagrad", choices=hash_table_ops.OPTIMIZERS)
  parser.add_argument("--evicted", type=float, default=0.0,
                      help="share of new keys arriving before the delta, evicting as many old "
                           "ones (the budget is --keys)")
  parser.add_argument("--out", default=None, help="a directory for hash_checkpoint_delta.json")
  parser.add_argument("--dry_run", action="store_true",
                      help="check the flags, print one line and exit without running anything")
  args = parser.parse_args(argv)
  for name in ("keys", "shards", "dim"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}.")
  if not 0 < args.changed <= 1:
    parser.error(f"--changed must be in (0, 1], got {args.changed}.")
  if not 0 <= args.evicted < 1 or args.evicted + args.changed > 1:
    parser.error(f"--evicted must be in [0, 1) and at most 1 - --changed, got {args.evicted}.")
  if args.evicted and args.keys < args.shards:
    parser.error("--evicted needs --keys >= --shards (the budget is the keys).")
  if args.dry_run:
    print("benchmarks.hash_checkpoint_delta: dry run: flags valid; nothing measured.")
    return None
  with tempfile.TemporaryDirectory() as directory:
    out = run(args.keys, args.changed, args.shards, args.dim, args.optimizer, args.evicted,
              directory)
  for name in ("full", "delta"):
    out.pop(f"{name}_path")
  print(f"keys {out['keys']:,} over {args.shards} shards, dim {args.dim}, {args.optimizer}; "
        f"{out['changed_keys']:,} keys changed ({args.changed:.2%}), {out['new_keys']:,} new, "
        f"{out['delta_deleted_keys']:,} removed")
  print(f"  full  checkpoint: {out['full_bytes']:>13,} bytes, {out['full_rows']:,} rows, "
        f"saved in {out['full_save_s']} s")
  print(f"  delta checkpoint: {out['delta_bytes']:>13,} bytes, {out['delta_rows']:,} rows, "
        f"{out['delta_deleted_keys']:,} deleted keys, saved in {out['delta_save_s']} s")
  print(f"  delta / full = {out['delta_over_full']:.4f}; full + delta restored in "
        f"{out['restore_s']} s, equal to the trained table: {out['restored_equal']}")
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hash_checkpoint_delta.json"), "w") as f:
      json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  main()
