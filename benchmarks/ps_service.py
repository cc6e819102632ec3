"""The parameter servers' service times, measured from the real ops, for the simulator's queue.

  python -m benchmarks.ps_service [--model=deepfm] [--data=synthetic] [--local_batch_size=256]
                                  [--num_aggregate=8] [--repeats=200]

Times, in this process (the ops a PS runs, without the RPC around them), best of `--repeats`
medians of 20:
  * push: every variable's gradient of one real step of the model pushed into GBA's buffers
    (dense and sparse), a push that does not complete a global batch;
  * apply: the extra time of the push that completes one (aggregation and the inner optimizer's
    Adam update); from the mean push at M = 1 (every push completes) and at M = 8;
  * per byte of dense gradient and per embedding row: DenseBuffer pushes of 4 MiB and
    SparseBuffer pushes of 4,096 rows of the model's embedding width (M = 8: aggregation
    included), each divided by its size.
Prints the simulator flags (`--ps_push_ms`, `--ps_apply_ms`) for the model.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402

import tf_gba  # noqa: E402,F401
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

from tf_gba import data as data_lib  # noqa: E402
from tf_gba import models as models_lib  # noqa: E402
from tf_gba.distribute import step_context  # noqa: E402
from tf_gba.ops import gba_ops  # noqa: E402
from tf_gba.optimizers import GBA  # noqa: E402


def _median_ms(fn, repeats: int, inner: int = 20) -> float:
  """Best over `repeats` of the median of `inner` calls, in ms (a loaded machine's noise is
  one-sided)."""
  fn()  # trace
  best = float("inf")
  for _ in range(max(1, repeats // inner)):
    times = []
    for _ in range(inner):
      t0 = time.perf_counter()
      fn()
      times.append(time.perf_counter() - t0)
    best = min(best, float(np.median(times)))
  return best * 1e3


def model_times(args) -> dict:
  info = data_lib.data_info(args.data)
  model = models_lib.build_model(args.model, info)
  features, labels = next(iter(data_lib.make_dataset(args.data, batch_size=args.local_batch_size)))
  variables = model.trainable_variables
  with tf.GradientTape() as tape:
    loss = keras.losses.BinaryCrossentropy()(labels, model(features, training=True))
  grads = tape.gradient(loss, variables)
  dense_bytes = sum(int(np.prod(g.shape)) * 4 for g in grads
                    if not isinstance(g, tf.IndexedSlices))
  rows = sum(int(g.indices.shape[0]) for g in grads if isinstance(g, tf.IndexedSlices))
  width = max([int(g.values.shape[-1]) for g in grads if isinstance(g, tf.IndexedSlices)] + [1])

  def pusher(m):
    opt = GBA(keras.optimizers.Adam(1e-3), num_aggregate=m)
    opt.build(variables)

    @tf.function
    def push():
      info_ = step_context.StepInfo(token=opt.iterations, ticket=tf.constant(-1, tf.int64))
      with step_context.scope(info_):
        opt.apply_gradients(zip(grads, variables))
    return push

  # Every push completes a batch at M = 1 (push + apply); one in M does at M = 8 (push +
  # apply / 8). A buffer that never completes would keep growing its pending sparse rows.
  push_apply = _median_ms(pusher(1), args.repeats)
  mean_of_8 = _median_ms(pusher(8), args.repeats)
  apply = max(0.0, (push_apply - mean_of_8) * 8 / 7)
  return {"model": args.model, "dense_bytes": dense_bytes, "rows_per_push": rows,
          "embedding_width": width, "push_ms": push_apply - apply, "apply_ms": apply,
          "push_and_apply_ms": push_apply}


def unit_times(args, width: int) -> dict:
  elements = 1 << 20   # 4 MiB of float32
  config = gba_ops.BufferConfig(num_aggregate=8)
  dense = gba_ops.DenseBuffer([elements], tf.float32, config)
  g = tf.random.normal([elements])
  dense_ms = _median_ms(lambda: dense.push(0, -1, g), args.repeats)
  n_rows = 4096
  sparse = gba_ops.SparseBuffer(1 << 16, [width], tf.float32, config)
  ids = tf.constant(np.random.default_rng(0).integers(0, 1 << 16, n_rows), tf.int64)
  values = tf.random.normal([n_rows, width])
  sparse_ms = _median_ms(lambda: sparse.push(0, -1, ids, values), args.repeats)
  return {"ms_per_mib_dense": dense_ms / 4.0, "us_per_row": sparse_ms * 1e3 / n_rows}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="deepfm")
  p.add_argument("--data", default="synthetic")
  p.add_argument("--local_batch_size", type=int, default=256)
  p.add_argument("--repeats", type=int, default=200)
  p.add_argument("--out", default=None, help="a JSON file for the figures")
  p.add_argument("--dry_run", action="store_true",
                 help="check the flags, print one line and exit without running anything")
  args = p.parse_args(argv)
  if args.repeats < 1 or args.local_batch_size < 1:
    p.error("--repeats and --local_batch_size must be >= 1")
  if args.dry_run:
    print("benchmarks.ps_service: dry run: flags valid; nothing measured.")
    return None
  m = model_times(args)
  u = unit_times(args, m["embedding_width"])
  out = {**m, **u, "predicted_push_ms": m["dense_bytes"] / 2**20 * u["ms_per_mib_dense"]
                                        + m["rows_per_push"] * u["us_per_row"] * 1e-3}
  print(f"{args.model}, local batch {args.local_batch_size}: {m['dense_bytes']:,} bytes of dense "
        f"gradient and {m['rows_per_push']:,} embedding rows (width {m['embedding_width']}) per "
        f"push")
  print(f"  push {m['push_ms']:.3f} ms; aggregation + Adam apply {m['apply_ms']:.3f} ms more "
        f"(push completing a batch {m['push_and_apply_ms']:.3f} ms)")
  print(f"  units: dense {u['ms_per_mib_dense']:.3f} ms per MiB, sparse {u['us_per_row']:.3f} us "
        f"per row -> {out['predicted_push_ms']:.3f} ms per push from the units")
  print(f"  simulator flags: --ps_push_ms={m['push_ms']:.3f} --ps_apply_ms={m['apply_ms']:.3f}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=2)
  return out


if __name__ == "__main__":
  main()
