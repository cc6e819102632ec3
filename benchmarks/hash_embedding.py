"""Memory and speed of the hash embedding table (tf_gba.ops.hash_table_ops).

  python -m benchmarks.hash_embedding [--keys=20000000] [--shards=2] [--dim=16]
      [--optimizer=adagrad] [--batch=4096] [--fields=26] [--vocab=1000000] [--steps=20]
  python -m benchmarks.hash_embedding --budget_stream [--stream_keys=20000000] [--max_rows=1000000]
      [--min_frequency=2] [--ttl_steps=4] [--stream_steps=40] [--repeat_share=0.2]
      [--admission_filter_cells=0] [--out=DIR]

Three measurements, one process, one after the other:
  memory      `keys` random int64 keys inserted into a table of `shards` shards; bytes per row as
              the table counts them (rows, tags and counters, key index) and as the process' RSS
              grew, against the row's floats dim * (1 + slots) * 4 (target: <= 1.5x + 32 B).
  train step  Criteo-shaped batches (batch x fields ids, Zipf-distributed over `vocab` ids):
              deduplicate, look up, apply the optimizer to the rows. Hash: the table's lookup and
              fused update. Partitioned: a [vocab, dim] variable per shard, tf.gather and the
              tf_keras optimizer's sparse update (an IndexedSlices gradient). Examples per second,
              best of `steps` after a warm-up (target: hash >= 0.8x partitioned).
  raw lookup  find-only lookups of a batch's unique ids in a filled table against
              tf.lookup.experimental.DenseHashTable holding the same keys and rows.
With --budget_stream, one measurement instead:
  budget      `stream_keys` keys over `stream_steps` steps, most seen once (a fresh key each), a
              `repeat_share` of each step's keys drawn from the keys of earlier steps, into a table
              with `min_frequency`, `ttl_steps` and `max_rows`, evicting after every step. After
              each step: rows, pending counts, the table's bytes and the process' RSS growth,
              against the bytes `max_rows` rows take (whole blocks of rows, the key index at its
              emptiest) and the bytes the last step's pending counts take at most (their index
              at its emptiest). max_rows bounds the rows only: without ttl_steps, exact pending
              counts of keys seen once grow with the stream; with --admission_filter_cells the
              counts live in a counting Bloom filter of that many cells per shard, and what the
              budget implies is the rows' bytes plus the filters'. With --out, the timeline is
              written there as budget_stream.json and plotted (budget_stream.png, if matplotlib
              is installed).
The shards all live in this process (one "parameter server" each is a device string away); what
the numbers compare is the kernels, not the network.
"""

import argparse
import json
import os
import resource
from typing import Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import tf_gba  # noqa: E402,F401
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

from benchmarks import buffer_bandwidth  # noqa: E402
from tf_gba.ops import hash_table_ops  # noqa: E402


def rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * resource.getpagesize()


def best_of(fn, repeats):
  """buffer_bandwidth's best of `repeats` timed calls, after one untimed call (tracing)."""
  fn()
  return buffer_bandwidth.best_of(fn, repeats)


def memory(keys, shards, dim, optimizer, chunk=1 << 20):
  table = hash_table_ops.ShardedHashTable(dim, devices=[""] * shards)
  # The optimizer's layout first (an empty apply), so rows are made with their slots.
  table.apply(tf.zeros([0], tf.int64), tf.zeros([0, dim]), optimizer, learning_rate=0.1)
  rng = np.random.default_rng(0)
  before = rss_bytes()
  done = 0
  while done < keys:
    n = min(chunk, keys - done)
    table.lookup(tf.constant(rng.integers(-2**63, 2**63 - 1, size=n, dtype=np.int64)), 0)
    done += n
  rows = table.size()
  row_bytes = dim * (1 + hash_table_ops.NUM_SLOTS[optimizer]) * 4
  counted = table.allocated_bytes() / rows
  grown = (rss_bytes() - before) / rows
  return {"rows": rows, "row_floats_bytes": row_bytes, "bytes_per_row_table": round(counted, 1),
          "bytes_per_row_rss": round(grown, 1), "target": 1.5 * row_bytes + 32,
          "within_target": counted <= 1.5 * row_bytes + 32}


def budget_stream(stream_keys, stream_steps, repeat_share, shards, dim, optimizer, min_frequency,
                  ttl_steps, max_rows, admission_filter_cells=0, seed=2, progress=None):
  table = hash_table_ops.ShardedHashTable(dim, devices=[""] * shards,
                                          min_frequency=min_frequency, ttl_steps=ttl_steps,
                                          max_rows=max_rows,
                                          admission_filter_cells=admission_filter_cells)
  table.apply(tf.zeros([0], tf.int64), tf.zeros([0, dim]), optimizer, learning_rate=0.1)
  rng = np.random.default_rng(seed)
  per_step = stream_keys // stream_steps
  repeats = int(per_step * repeat_share)
  row_bytes = dim * (1 + hash_table_ops.NUM_SLOTS[optimizer]) * 4
  block_rows = 16384
  per_shard = -(-max_rows // shards)
  # A table of max_rows rows: whole blocks per shard (row floats, 32 B of tag, counters and write
  # number) and a key index of 17 B slots at its emptiest load, 7/16.
  budget_bytes = (shards * -(-per_shard // block_rows) * block_rows * (row_bytes + 32)
                  + int(max_rows * 16 / 7 * 17))
  # The filters are allocated with the table, before the baseline below: count them in both.
  filter_bytes = shards * admission_filter_cells
  # One step of the same size through a throwaway table first: TensorFlow's one-time start-up
  # allocations (kernels, thread pools, the allocator's first chunks) are not the table's.
  warm = hash_table_ops.ShardedHashTable(dim, devices=[""] * shards, min_frequency=min_frequency)
  warm.apply(tf.zeros([0], tf.int64), tf.zeros([0, dim]), optimizer, learning_rate=0.1)
  warm_keys = np.random.default_rng(seed + 1).integers(-2**63, 2**63 - 1, size=per_step,
                                                       dtype=np.int64)
  warm.lookup(tf.constant(warm_keys), 0)
  warm.evict(1)
  del warm, warm_keys
  before = rss_bytes() - filter_bytes
  recent = np.zeros([0], np.int64)
  timeline = []
  for step in range(stream_steps):
    fresh = rng.integers(-2**63, 2**63 - 1, size=per_step - repeats, dtype=np.int64)
    again = (rng.choice(recent, size=min(repeats, len(recent)), replace=False)
             if len(recent) else np.zeros([0], np.int64))
    keys = np.concatenate([fresh, again])
    table.lookup(tf.constant(keys), step)
    table.evict(step + 1)
    recent = keys  # the next step repeats some of this step's keys
    c = table.counters()
    timeline.append({"step": step + 1, "keys_seen": (step + 1) * per_step, "rows": c["rows"],
                     "pending": c["pending"], "admitted": c["admitted"],
                     "evicted": c["evicted"], "table_bytes": table.allocated_bytes(),
                     "rss_growth_bytes": rss_bytes() - before})
    if progress and (step + 1) % max(1, stream_steps // 10) == 0:
      progress(timeline[-1])
  last = timeline[-1]
  # A pending count is an index slot of 25 B (key, count, last_seen), at a load of 7/16 or more.
  pending_bytes_bound = 0 if admission_filter_cells else int(last["pending"] * 16 / 7 * 25)
  implied = budget_bytes + filter_bytes
  return {"keys_per_step": per_step, "repeats_per_step": repeats, "max_rows": max_rows,
          "admission_filter_cells": admission_filter_cells, "filter_bytes": filter_bytes,
          "budget_bytes": budget_bytes, "pending_bytes_bound": pending_bytes_bound,
          "implied_bytes": implied,
          "max_rss_over_implied": round(max(t["rss_growth_bytes"] for t in timeline) / implied, 4),
          "max_table_over_implied": round(max(t["table_bytes"] for t in timeline) / implied, 4),
          "timeline": timeline,
          "peak_table_bytes": max(t["table_bytes"] for t in timeline),
          "peak_rss_growth_bytes": max(t["rss_growth_bytes"] for t in timeline),
          "rows_within_budget": all(t["rows"] <= max_rows for t in timeline),
          # The pending counts are not bounded by max_rows: only ttl_steps forgets them.
          "last_bytes_within_budget_and_pending": (
              last["table_bytes"] <= implied + pending_bytes_bound)}


def plot_budget_stream(budget: dict, path: str) -> Optional[str]:
  """RSS growth and table bytes over the stream against what the budget implies."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    print("matplotlib is not installed: no plot (pip install matplotlib).", flush=True)
    return None
  t = budget["timeline"]
  keys = [x["keys_seen"] / 1e6 for x in t]
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(keys, [x["rss_growth_bytes"] / 2**20 for x in t], label="RSS growth")
  ax.plot(keys, [x["table_bytes"] / 2**20 for x in t], label="table bytes (counted)")
  ax.axhline(budget["implied_bytes"] / 2**20, color="k", ls="--", label="budget implies")
  ax.axhline(1.1 * budget["implied_bytes"] / 2**20, color="r", ls=":", label="+10%")
  ax.set_xlabel("keys seen (millions)")
  ax.set_ylabel("MiB")
  ax.set_title(f"max_rows={budget['max_rows']:,}, filter cells/shard="
               f"{budget['admission_filter_cells']:,}")
  ax.legend(loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def zipf_batches(steps, batch, fields, vocab, seed=1):
  rng = np.random.default_rng(seed)
  return [np.minimum(rng.zipf(1.2, size=(batch, fields)), vocab).astype(np.int64) - 1
          for _ in range(steps)]


def train_step_rates(batches, shards, dim, optimizer, vocab, repeats):
  inner = {"sgd": lambda: keras.optimizers.SGD(0.1),
           "adagrad": lambda: keras.optimizers.Adagrad(0.1),
           "adam": lambda: keras.optimizers.Adam(0.001)}[optimizer]
  table = hash_table_ops.ShardedHashTable(dim, devices=[""] * shards)

  @tf.function
  def hash_step(ids):
    unique, _ = tf.unique(tf.reshape(ids, [-1]))
    rows = table.lookup(unique)
    table.apply(unique, rows * 0.01, optimizer, learning_rate=0.1)

  per_shard = -(-vocab // shards)
  variables = [tf.Variable(tf.random.uniform([per_shard, dim], -0.05, 0.05))
               for _ in range(shards)]
  opt = inner()
  opt.build(variables)

  @tf.function
  def partitioned_step(ids):
    unique, _ = tf.unique(tf.reshape(ids, [-1]))
    shard = tf.cast(unique % shards, tf.int32)
    parts = tf.dynamic_partition(unique // shards, shard, shards)
    grads = []
    for v, local in zip(variables, parts):
      rows = tf.gather(v, local)
      grads.append((tf.IndexedSlices(rows * 0.01, local, tf.shape(v, out_type=tf.int64)), v))
    opt.apply_gradients(grads)

  examples = batches[0].shape[0]
  out = {}
  for name, step in (("hash", hash_step), ("partitioned", partitioned_step)):
    tensors = [tf.constant(b) for b in batches]
    step(tensors[0])  # trace and warm up (inserts the first rows)

    def run(step=step, tensors=tensors):
      for t in tensors:
        step(t)

    seconds = best_of(run, repeats)
    out[f"{name}_examples_per_s"] = round(examples * len(batches) / seconds)
  out["hash_vs_partitioned"] = round(out["hash_examples_per_s"] /
                                     out["partitioned_examples_per_s"], 3)
  return out


def raw_lookup_rates(batches, dim, vocab, repeats):
  keys = np.arange(vocab, dtype=np.int64) * 2654435761 + 1  # spread, never the empty key 0
  values = np.random.default_rng(2).uniform(-0.05, 0.05, size=(vocab, dim)).astype(np.float32)
  table = hash_table_ops.ShardedHashTable(dim)
  table.import_rows({"keys": tf.constant(keys), "values": tf.constant(values),
                     "slots": tf.zeros([vocab, 0, dim]),
                     "tags": tf.fill([vocab], tf.constant(-1, tf.int64)),
                     "frequency": tf.zeros([vocab], tf.int64),
                     "last_seen": tf.zeros([vocab], tf.int64)})
  dense = tf.lookup.experimental.DenseHashTable(
      tf.int64, tf.float32, default_value=tf.zeros([dim]), empty_key=0, deleted_key=-1)
  dense.insert(tf.constant(keys), tf.constant(values))
  queries = [tf.constant(keys[np.unique(b.ravel())]) for b in batches]
  out = {}
  spec = [tf.TensorSpec([None], tf.int64)]  # one trace for every batch's number of ids
  for name, fn in (("hash_table_find", tf.function(table.find, input_signature=spec)),
                   ("dense_hash_table_lookup", tf.function(dense.lookup, input_signature=spec))):
    def run(fn=fn):
      for q in queries:
        fn(q)

    seconds = best_of(run, repeats)
    out[f"{name}_keys_per_s"] = round(sum(int(q.shape[0]) for q in queries) / seconds)
  out["hash_vs_dense_hash_table"] = round(out["hash_table_find_keys_per_s"] /
                                          out["dense_hash_table_lookup_keys_per_s"], 3)
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--keys", type=int, default=20_000_000)
  parser.add_argument("--shards", type=int, default=2)
  parser.add_argument("--dim", type=int, default=16)
  parser.add_argument("--optimizer", default="adagrad", choices=hash_table_ops.OPTIMIZERS)
  parser.add_argument("--batch", type=int, default=4096)
  parser.add_argument("--fields", type=int, default=26)
  parser.add_argument("--vocab", type=int, default=1_000_000)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--budget_stream", action="store_true",
                      help="measure only memory over time under admission and a row budget")
  parser.add_argument("--stream_keys", type=int, default=20_000_000)
  parser.add_argument("--stream_steps", type=int, default=40)
  parser.add_argument("--repeat_share", type=float, default=0.2)
  parser.add_argument("--min_frequency", type=int, default=2)
  parser.add_argument("--ttl_steps", type=int, default=4)
  parser.add_argument("--max_rows", type=int, default=1_000_000)
  parser.add_argument("--admission_filter_cells", type=int, default=0,
                      help="admission counts in a counting Bloom filter of N cells per shard "
                           "(0: exact counts)")
  parser.add_argument("--out", default=None,
                      help="--budget_stream: a directory for budget_stream.json and its plot")
  parser.add_argument("--dry_run", action="store_true",
                      help="check the flags, print one line and exit without running anything")
  args = parser.parse_args(argv)
  for name in ("keys", "shards", "dim", "batch", "fields", "vocab", "steps", "repeats",
               "stream_keys", "stream_steps", "max_rows"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}.")
  if not 0 <= args.repeat_share < 1:
    parser.error(f"--repeat_share must be in [0, 1), got {args.repeat_share}.")
  if args.min_frequency < 0 or args.ttl_steps < 0:
    parser.error("--min_frequency and --ttl_steps must be >= 0 (0: off).")
  if args.admission_filter_cells < 0:
    parser.error("--admission_filter_cells must be >= 0 (0: exact admission counts).")
  if args.admission_filter_cells and args.min_frequency < 2:
    parser.error("--admission_filter_cells needs admission: --min_frequency=2 or more.")
  if args.max_rows < args.shards:
    parser.error(f"--max_rows must be >= --shards, got {args.max_rows}.")
  if args.dry_run:
    print("benchmarks.hash_embedding: dry run: flags valid; nothing measured.")
    return None
  result = {"args": vars(args)}
  if args.budget_stream:
    def progress(t):
      print(f"budget_stream: {t['keys_seen']:,} keys, {t['rows']:,} rows, RSS growth "
            f"{t['rss_growth_bytes'] / 2**20:.1f} MiB", flush=True)

    result["budget"] = budget_stream(args.stream_keys, args.stream_steps, args.repeat_share,
                                     args.shards, args.dim, args.optimizer, args.min_frequency,
                                     args.ttl_steps, args.max_rows, args.admission_filter_cells,
                                     progress=progress)
    if args.out:
      os.makedirs(args.out, exist_ok=True)
      with open(os.path.join(args.out, "budget_stream.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
      plot_budget_stream(result["budget"], os.path.join(args.out, "budget_stream.png"))
    summary = {k: v for k, v in result["budget"].items() if k != "timeline"}
    print(json.dumps({"args": result["args"], "budget": summary}, indent=2))
    return result
  batches = zipf_batches(args.steps, args.batch, args.fields, args.vocab)
  result["memory"] = memory(args.keys, args.shards, args.dim, args.optimizer)
  result["train_step"] = train_step_rates(batches, args.shards, args.dim, args.optimizer,
                                          args.vocab, args.repeats)
  result["raw_lookup"] = raw_lookup_rates(batches, args.dim, args.vocab, args.repeats)
  print(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
