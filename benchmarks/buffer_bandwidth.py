"""Aggregation bandwidth of the GBA buffers next to a plain memcpy of the same bytes.

  python -m benchmarks.buffer_bandwidth [--elements=4194304] [--rows=1048576] [--dim=16] [--m=8]
      [--threads=N] [--scaling]

Dense: M pushes of a float32 gradient with `elements` values complete one global step; GB/s counts
the gradient bytes pushed. Sparse: M pushes of rows/M random ids each (rows x dim float32 in
total) into a table of `rows` rows. The memcpy baseline copies the same number of bytes, in the
same run, with NumPy (one thread). The sparse buffer is also timed against TensorFlow's own ways
of summing the same rows by id (the pushes' ids and rows concatenated beforehand, as a graph):
  unsorted_segment_sum         tf.math.unsorted_segment_sum into the whole [rows, dim] table
  unique+segment_sum           sort the ids, tf.unique, tf.math.segment_sum (sorted segments)
  unique+unsorted_segment_sum  tf.unique, tf.math.unsorted_segment_sum over the unique ids
Every figure is the best of --repeats, all measured in one process one after the other, so the
ratios compare like with like on a loaded machine. --threads sets TensorFlow's intra-op threads
(the buffers' parallel passes); --scaling runs the benchmark once per thread count from 1 to the
machine's cores, each in its own process (the thread count is fixed when TensorFlow starts).
"""

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import tf_gba  # noqa: E402,F401
import tensorflow as tf  # noqa: E402

from tf_gba.ops import gba_ops  # noqa: E402


def best_of(fn, repeats):
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return min(times)


def memcpy_seconds(nbytes, chunks, repeats):
  src = np.ones(nbytes // 4 // chunks, np.float32)
  dst = np.empty_like(src)

  def run():
    for _ in range(chunks):
      np.copyto(dst, src)

  run()
  return best_of(run, repeats)


def dense_seconds(elements, m, repeats):
  buf = gba_ops.DenseBuffer([elements], tf.float32,
                            gba_ops.BufferConfig(m, staleness_threshold=gba_ops.NEVER_STALE))
  grads = [tf.random.normal([elements]) for _ in range(m)]
  ticket = [0]

  def run():
    for g in grads:
      ready, agg, _ = buf.push(0, ticket[0], g)
      ticket[0] += 1
    assert bool(ready)
    return agg

  run()
  return best_of(run, repeats)


def sparse_seconds(rows, dim, m, repeats):
  buf = gba_ops.SparseBuffer(rows, [dim], tf.float32,
                             gba_ops.BufferConfig(m, staleness_threshold=gba_ops.NEVER_STALE))
  rng = np.random.default_rng(0)
  per_push = rows // m
  pushes = [(tf.constant(rng.integers(0, rows, per_push)), tf.random.normal([per_push, dim]))
            for _ in range(m)]
  ticket = [0]

  def run():
    for ids, vals in pushes:
      ready, *_ = buf.push(0, ticket[0], ids, vals)
      ticket[0] += 1
    assert bool(ready)

  run()
  return best_of(run, repeats)


def sparse_baselines(rows, dim, m, repeats):
  """Seconds of TensorFlow's own id-wise sums of the same rows (see the module's docstring)."""
  rng = np.random.default_rng(0)
  per_push = rows // m
  ids = tf.constant(np.concatenate([rng.integers(0, rows, per_push) for _ in range(m)]))
  vals = tf.random.normal([per_push * m, dim])

  @tf.function
  def unsorted():
    return tf.math.unsorted_segment_sum(vals, ids, rows)

  @tf.function
  def unique_segment_sum():
    order = tf.argsort(ids)
    sorted_ids = tf.gather(ids, order)
    unique_ids, seg = tf.unique(sorted_ids)
    return unique_ids, tf.math.segment_sum(tf.gather(vals, order), seg)

  @tf.function
  def unique_unsorted():
    unique_ids, seg = tf.unique(ids)
    return unique_ids, tf.math.unsorted_segment_sum(vals, seg, tf.size(unique_ids))

  out = {}
  for name, fn in (("unsorted_segment_sum", unsorted), ("unique+segment_sum", unique_segment_sum),
                   ("unique+unsorted_segment_sum", unique_unsorted)):
    fn()  # trace

    def run(fn=fn):
      tf.nest.map_structure(lambda t: t.numpy(), fn())

    out[name] = best_of(run, repeats)
  return out


def scaling(argv, threads_list):
  """Runs this benchmark once per intra-op thread count, each in a fresh process."""
  rows = []
  for n in threads_list:
    cmd = [sys.executable, "-m", "benchmarks.buffer_bandwidth", *argv, f"--threads={n}",
           "--json=/dev/stdout", "--quiet"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows.append((n, json.loads(out[out.index("{"):])))
  print("| intra-op threads | dense GB/s | dense / memcpy | sparse GB/s | sparse vs best TF |")
  print("|---|---|---|---|---|")
  for n, r in rows:
    print(f"| {n} | {r['dense']['buffer_gbps']:.2f} | {r['dense']['ratio']:.2f} | "
          f"{r['sparse']['buffer_gbps']:.2f} | {r['sparse']['speedup_vs_best_tf']:.2f}x |")
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--elements", type=int, default=4 * 1024 * 1024)
  p.add_argument("--rows", type=int, default=1024 * 1024)
  p.add_argument("--dim", type=int, default=16)
  p.add_argument("--m", type=int, default=8)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--json", default=None, help="also write the results here")
  p.add_argument("--threads", type=int, default=0,
                 help="TensorFlow intra-op threads (0: TensorFlow's default, one per core)")
  p.add_argument("--scaling", action="store_true",
                 help="run once per thread count from 1 to the machine's cores")
  p.add_argument("--quiet", action="store_true", help="no table (with --json)")
  p.add_argument("--dry_run", action="store_true",
                 help="check the flags, print one line and exit without running anything")
  args = p.parse_args(argv)
  if args.dry_run:
    print("benchmarks.buffer_bandwidth: dry run: flags valid; nothing measured.")
    return None
  if args.scaling:
    passed = [a for a in (argv if argv is not None else sys.argv[1:])
              if not a.startswith(("--scaling", "--threads", "--json", "--quiet"))]
    return scaling(passed, range(1, (os.cpu_count() or 1) + 1))
  if args.threads:
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)

  results = {}
  dense_bytes = args.m * args.elements * 4
  t_dense = dense_seconds(args.elements, args.m, args.repeats)
  t_copy = memcpy_seconds(dense_bytes, args.m, args.repeats)
  results["dense"] = {"bytes": dense_bytes, "buffer_gbps": dense_bytes / t_dense / 1e9,
                      "memcpy_gbps": dense_bytes / t_copy / 1e9}
  sparse_bytes = (args.rows // args.m) * args.m * args.dim * 4
  t_sparse = sparse_seconds(args.rows, args.dim, args.m, args.repeats)
  t_copy = memcpy_seconds(sparse_bytes, args.m, args.repeats)
  results["sparse"] = {"bytes": sparse_bytes, "buffer_gbps": sparse_bytes / t_sparse / 1e9,
                       "memcpy_gbps": sparse_bytes / t_copy / 1e9}
  for r in results.values():
    r["ratio"] = r["buffer_gbps"] / r["memcpy_gbps"]
  baselines = sparse_baselines(args.rows, args.dim, args.m, args.repeats)
  results["sparse"]["tf_seconds"] = baselines
  results["sparse"]["buffer_seconds"] = t_sparse
  # The target compares with the best of the two plain TF routes to an id-wise sum.
  best_named = min(baselines["unsorted_segment_sum"], baselines["unique+segment_sum"])
  results["sparse"]["speedup_vs_best_tf"] = best_named / t_sparse
  results["sparse"]["speedup_vs_each_tf"] = {k: v / t_sparse for k, v in baselines.items()}
  results["threads"] = args.threads or "default"
  if not args.quiet:
    print(f"intra-op threads: {results['threads']}; load average: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| buffer | bytes per global step | buffer GB/s | memcpy GB/s | ratio |")
    print("|---|---|---|---|---|")
    for name in ("dense", "sparse"):
      r = results[name]
      print(f"| {name} (M={args.m}) | {r['bytes'] / 2**20:.0f} MiB | {r['buffer_gbps']:.2f} | "
            f"{r['memcpy_gbps']:.2f} | {r['ratio']:.2f} |")
    print("| sparse: TF on the same rows | seconds | buffer speed-up |")
    print("|---|---|---|")
    print(f"| GBA sparse buffer | {t_sparse:.4f} | 1.00x |")
    for name, t in baselines.items():
      print(f"| {name} | {t:.4f} | {t / t_sparse:.2f}x |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)
  return results


if __name__ == "__main__":
  main()
