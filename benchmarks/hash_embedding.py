"""Memory and speed of the hash embedding table (tf_gba.ops.hash_table_ops).

  python -m benchmarks.hash_embedding [--keys=20000000] [--shards=2] [--dim=16]
      [--optimizer=adagrad] [--batch=4096] [--fields=26] [--vocab=1000000] [--steps=20]

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
The shards all live in this process (one "parameter server" each is a device string away); what
the numbers compare is the kernels, not the network.
"""

import argparse
import json
import os
import resource

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
  parser.add_argument("--dry_run", action="store_true",
                      help="check the flags, print one line and exit without running anything")
  args = parser.parse_args(argv)
  for name in ("keys", "shards", "dim", "batch", "fields", "vocab", "steps", "repeats"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}.")
  if args.dry_run:
    print("benchmarks.hash_embedding: dry run: flags valid; nothing measured.")
    return None
  batches = zipf_batches(args.steps, args.batch, args.fields, args.vocab)
  result = {"args": vars(args)}
  result["memory"] = memory(args.keys, args.shards, args.dim, args.optimizer)
  result["train_step"] = train_step_rates(batches, args.shards, args.dim, args.optimizer,
                                          args.vocab, args.repeats)
  result["raw_lookup"] = raw_lookup_rates(batches, args.dim, args.vocab, args.repeats)
  print(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
