"""Figure 1 of "Asynchronous SGD without gradient delay" (seed 003) on our model.

  python -m benchmarks.asgd_discrepancy [--taus=2,4,8] [--workers=2,4,8] [--trials=5]
                                        [--out=runs/asgd_discrepancy] [--plot=docs/img/...]

The average distance of the workers' parameters to their mean, as the paper measures it (its
section 4), on DeepFM's dense parameters (what the replicas of asgd_nodelay hold; the embedding
table, on the parameter servers, is held fixed), synthetic data, plain SGD:

- ASGD without gradient delay, staleness tau: every worker starts from the same parameters and
  makes tau local steps on batches of its own shard; the distance is mean_w ||x_w - mean(x)||.
- Gradient delay (plain async), worst case: worker k reads the PS after k gradients have been
  applied, computes one gradient on that copy and advances its own copy with it, and the PS
  applies the gradient; the distance is mean_k ||x_k - PS.x (final)||.

The starting point is a model trained for `--warmup` SGD steps (not the initialisation, where
gradients are unusually large), and each point is the mean over `--trials` starting batches.
One process, no cluster: this measures the algorithms' geometry, not the runtime.
"""

import argparse
import json
import os

import numpy as np
import tensorflow as tf
import tf_keras as keras

from tf_gba import data as data_lib
from tf_gba import models as models_lib


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--taus", default="2,4,8")
  p.add_argument("--workers", default="2,4,8")
  p.add_argument("--trials", type=int, default=5)
  p.add_argument("--warmup", type=int, default=200)
  p.add_argument("--learning_rate", type=float, default=0.05)
  p.add_argument("--local_batch_size", type=int, default=256)
  p.add_argument("--out", default="runs/asgd_discrepancy")
  p.add_argument("--plot", default="")
  p.add_argument("--dry_run", action="store_true",
                 help="check the flags, print one line and exit without running anything")
  args = p.parse_args(argv)
  try:
    taus = [int(x) for x in args.taus.split(",")]
    workers = [int(x) for x in args.workers.split(",")]
  except ValueError:
    p.error(f"--taus and --workers take comma-separated integers, got {args.taus!r} and "
            f"{args.workers!r}")
  if args.dry_run:
    print(f"benchmarks.asgd_discrepancy: dry run: flags valid (tau {taus}, workers {workers}); "
          "nothing run.")
    return None
  lr = args.learning_rate

  info = data_lib.data_info("synthetic", num_examples=200_000)
  model = models_lib.build_model("deepfm", info)
  shared = {id(w) for layer in model.layers if isinstance(layer, models_lib.FieldEmbedding)
            for w in layer.weights}
  dense = [v for v in model.trainable_variables if id(v) not in shared]
  loss_fn = keras.losses.BinaryCrossentropy()

  @tf.function
  def grad(features, labels, variables):
    with tf.GradientTape() as tape:
      loss = loss_fn(labels, model(features, training=True))
    return tape.gradient(loss, variables)

  warm = iter(data_lib.make_dataset("synthetic", batch_size=args.local_batch_size, repeat=True,
                                    num_examples=200_000))
  opt = keras.optimizers.SGD(lr)
  for _ in range(args.warmup):
    x, y = next(warm)
    opt.apply_gradients(zip(grad(x, y, model.trainable_variables), model.trainable_variables))
  w0 = [v.numpy() for v in dense]

  # Every trial's batches, drawn once per worker shard and shared by every (workers, tau) point:
  # worker w of trial t trains on the same batches whether 2, 4 or 8 workers take part, so the
  # points differ only in the number of workers and tau. (Drawing them as each point runs gave
  # each point its own stretch of the shards' streams: the 2-worker points their first batches.
  # Measured that way, shards 0 and 1 on their first batches spread 0.6x as far as shards 2 and 3,
  # 4 and 5, or 6 and 7 on later ones, tau = 4: the batches, not the number of workers.)
  max_workers, max_tau = max(workers), max(taus)
  shards = [iter(data_lib.make_dataset("synthetic", batch_size=args.local_batch_size,
                                       num_shards=max_workers, shard_index=w, repeat=True,
                                       shuffle_seed=w + 1, num_examples=200_000))
            for w in range(max_workers)]
  batches = [[[next(shards[w]) for _ in range(max_tau)] for _ in range(args.trials)]
             for w in range(max_workers)]

  def set_dense(values):
    for v, x in zip(dense, values):
      v.assign(x)

  def local_steps(start, w, steps, trial):
    set_dense(start)
    for x, y in batches[w][trial][:steps]:
      for v, g in zip(dense, grad(x, y, dense)):
        v.assign_sub(lr * g)
    return np.concatenate([v.numpy().ravel() for v in dense])

  # "asgd_nodelay_normalised": each asgd_nodelay point divided by sqrt((N - 1) / N). N
  # independent points lie, on average, that fraction of their spread from their own mean: the
  # statistic itself grows x1.22 from 2 to 4 workers and x1.08 from 4 to 8. Divided by it, a flat
  # curve is one whose workers spread no further apart as more take part.
  results = {"asgd_nodelay": {}, "asgd_nodelay_normalised": {}, "gradient_delay": {}}
  for n in workers:
    for tau in taus:
      dists = []
      for trial in range(args.trials):
        xs = np.stack([local_steps(w0, w, tau, trial) for w in range(n)])
        dists.append(float(np.mean(np.linalg.norm(xs - xs.mean(axis=0), axis=1))))
      results["asgd_nodelay"][f"{n},{tau}"] = float(np.mean(dists))
      results["asgd_nodelay_normalised"][f"{n},{tau}"] = float(np.mean(dists) /
                                                               np.sqrt((n - 1) / n))
    dists = []
    for trial in range(args.trials):
      ps = [x.copy() for x in w0]
      local = []
      for k in range(n):
        set_dense(ps)  # worker k reads PS.x after k gradients
        x, y = batches[k][trial][0]
        g = [t.numpy() for t in grad(x, y, dense)]
        local.append(np.concatenate([(a - lr * b).ravel() for a, b in zip(ps, g)]))
        ps = [a - lr * b for a, b in zip(ps, g)]
      final = np.concatenate([a.ravel() for a in ps])
      dists.append(float(np.mean([np.linalg.norm(l - final) for l in local])))
    results["gradient_delay"][str(n)] = float(np.mean(dists))

  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"args": vars(args), "results": results}, f, indent=2)
  print("| workers | " + " | ".join(f"asgd_nodelay tau={t}" for t in taus) +
        " | async (gradient delay) |")
  print("|---|" + "---|" * (len(taus) + 1))
  for n in workers:
    print(f"| {n} | " + " | ".join(f"{results['asgd_nodelay'][f'{n},{t}']:.4f}" for t in taus) +
          f" | {results['gradient_delay'][str(n)]:.4f} |")
  print("\nasgd_nodelay divided by sqrt((N - 1) / N):")
  print("| workers | " + " | ".join(f"tau={t}" for t in taus) + " |")
  print("|---|" + "---|" * len(taus))
  for n in workers:
    print(f"| {n} | " + " | ".join(
        f"{results['asgd_nodelay_normalised'][f'{n},{t}']:.4f}" for t in taus) + " |")
  if args.plot:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for i, t in enumerate(taus):
      line, = ax.plot(workers, [results["asgd_nodelay"][f"{n},{t}"] for n in workers], "o-",
                      label=f"asgd_nodelay, tau={t}")
      ax.plot(workers, [results["asgd_nodelay_normalised"][f"{n},{t}"] for n in workers], ":",
              color=line.get_color(),
              label="dotted: divided by sqrt((N-1)/N)" if i == len(taus) - 1 else None)
    ax.plot(workers, [results["gradient_delay"][str(n)] for n in workers], "s--k",
            label="async (gradient delay)")
    ax.set_xlabel("workers")
    ax.set_ylabel("mean distance to the mean (dense params)")
    ax.set_xticks(workers)
    ax.set_title("DeepFM, synthetic data, SGD lr %g" % lr)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {args.plot}")
  return results


if __name__ == "__main__":
  main()
