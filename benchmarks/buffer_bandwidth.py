"""Aggregation bandwidth of the GBA buffers next to a plain memcpy of the same bytes.

  python -m benchmarks.buffer_bandwidth [--elements=4194304] [--rows=1048576] [--dim=16] [--m=8]

Dense: M pushes of a float32 gradient with `elements` values complete one global step; GB/s counts
the gradient bytes pushed. Sparse: M pushes of rows/M random ids each (rows x dim float32 in
total) into a table of `rows` rows. The memcpy baseline copies the same number of bytes, in the
same run, with NumPy (one thread).
"""

import argparse
import json
import os
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


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--elements", type=int, default=4 * 1024 * 1024)
  p.add_argument("--rows", type=int, default=1024 * 1024)
  p.add_argument("--dim", type=int, default=16)
  p.add_argument("--m", type=int, default=8)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--json", default=None, help="also write the results here")
  args = p.parse_args(argv)

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
  print(f"| buffer | bytes per global step | buffer GB/s | memcpy GB/s | ratio |")
  print(f"|---|---|---|---|---|")
  for name, r in results.items():
    r["ratio"] = r["buffer_gbps"] / r["memcpy_gbps"]
    print(f"| {name} (M={args.m}) | {r['bytes'] / 2**20:.0f} MiB | {r['buffer_gbps']:.2f} | "
          f"{r['memcpy_gbps']:.2f} | {r['ratio']:.2f} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)
  return results


if __name__ == "__main__":
  main()
