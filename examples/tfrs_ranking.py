"""TensorFlow Recommenders' basic ranking model, trained with GBA on a local parameter-server cluster.

The model is written as the TFRS "basic ranking" tutorial writes it: a `tfrs.models.Model` whose
`compute_loss` calls a `tfrs.tasks.Ranking` task, user and movie embeddings and a small tower, on
MovieLens-100K's star ratings (a random 80/20 split). The differences that GBA needs:

  * the model and optimizer are created under `tf_gba.distribute.GBAStrategy(...).scope()`, here
    on a `LocalCluster` (parameter server and worker processes on 127.0.0.1);
  * the optimizer is `tf_gba.optimizers.GBA(tf.keras.optimizers.Adagrad(0.1), ...)`, whose global
    batch of M local batches is the tutorial's batch of 8192;
  * the task's loss gets `reduction=tf.keras.losses.Reduction.SUM`: Keras refuses the default
    reduction of a loss the model calls itself under any distribution strategy (GBAStrategy says
    so in one line if it is left out). Each worker is one replica, so the loss sums over its local
    batch; Adagrad's steps do not depend on that scale;
  * fit takes a `DatasetCreator` (each worker builds its own input pipeline).

Run:
  python examples/tfrs_ranking.py --data=/data/ml-100k   # the GroupLens ml-100k folder
It prints the test RMSE next to that of the mean predictor (the training ratings' mean). The
default 10 passes over the training ratings (95 global steps) gave 0.997 and 1.031 in two runs
(1.011 and 1.001 with compile(steps_per_execution=1), the strategy's default before; each
epoch's 19 local batches are now one function on one worker) against 1.131; the tutorial's 3
passes are not enough here (1.150). `--optimizer=adaptive_revision` trains the same model with
AdaptiveRevision(alpha=0.1, g0=0.1), asynchronously (0.957 after 10 passes; 0.959-0.967 in eight
runs of 160 local batches, where the paper's G0 = 1 gave 1.041-1.091 in thirteen runs and 1.142
once, and learned little beyond the mean: its predictions spread 0.1-0.3 against Adagrad's 0.57).
"""

import argparse
import os
import sys
import tempfile

# Before TensorFlow is imported: its C++ runtime and gRPC log start-up notices and, when the local
# cluster goes away, lines about servers they can no longer reach, straight to file descriptor 2.
# They go to a log file; Python's stderr keeps the terminal for errors.
_LOG_DIR = tempfile.mkdtemp(prefix="tfrs_ranking_logs_")
if "--verbose" not in sys.argv:
  _terminal = os.dup(2)
  _log = os.open(os.path.join(_LOG_DIR, "coordinator.log"), os.O_WRONLY | os.O_CREAT, 0o644)
  os.dup2(_log, 2)
  os.close(_log)
  sys.stderr = os.fdopen(_terminal, "w", buffering=1)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tf_gba  # noqa: E402  (first: sets TF_USE_LEGACY_KERAS, which TFRS needs, before TensorFlow)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorflow_recommenders as tfrs  # noqa: E402

from tf_gba.data import movielens  # noqa: E402

tf.get_logger().setLevel("ERROR")


class RankingModel(tf.keras.Model):

  def __init__(self, num_users: int, num_movies: int):
    super().__init__()
    embedding_dimension = 32
    self.user_embeddings = tf.keras.layers.Embedding(num_users, embedding_dimension)
    self.movie_embeddings = tf.keras.layers.Embedding(num_movies, embedding_dimension)
    self.ratings = tf.keras.Sequential([
        tf.keras.layers.Dense(256, activation="relu"),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(1),
    ])

  def call(self, inputs):
    user_id, movie_id = inputs
    user_embedding = self.user_embeddings(user_id)
    movie_embedding = self.movie_embeddings(movie_id)
    return self.ratings(tf.concat([user_embedding, movie_embedding], axis=1))


class MovielensModel(tfrs.models.Model):

  def __init__(self, num_users: int, num_movies: int):
    super().__init__()
    self.ranking_model = RankingModel(num_users, num_movies)
    self.task = tfrs.tasks.Ranking(
        loss=tf.keras.losses.MeanSquaredError(reduction=tf.keras.losses.Reduction.SUM),
        metrics=[tf.keras.metrics.RootMeanSquaredError()])

  def call(self, features):
    return self.ranking_model((features["user_id"], features["movie_id"]))

  def compute_loss(self, features, training=False):
    labels = features.pop("user_rating")
    rating_predictions = self(features)
    return self.task(labels=labels, predictions=rating_predictions)


def load_movielens(data_dir: str, seed: int):
  """MovieLens-100K ratings as the tutorial's features, split 80/20 at random."""
  ratings = movielens.load(data_dir)
  features = {"user_id": ratings.features["user_id"], "movie_id": ratings.features["item_id"],
              "user_rating": ratings.stars.astype(np.float32)}
  order = np.random.default_rng(seed).permutation(len(ratings.stars))
  cut = int(0.8 * len(order))
  train = {k: v[order[:cut]] for k, v in features.items()}
  test = {k: v[order[cut:]] for k, v in features.items()}
  return train, test, ratings.vocab_sizes["user_id"], ratings.vocab_sizes["item_id"]


def rmse(model, test) -> float:
  predictions = model({"user_id": tf.constant(test["user_id"]),
                       "movie_id": tf.constant(test["movie_id"])}).numpy().reshape(-1)
  return float(np.sqrt(np.mean((predictions - test["user_rating"]) ** 2)))


def main(args) -> dict:
  train, test, num_users, num_movies = load_movielens(args.data, args.seed)
  global_batch = 8192
  local_batch = global_batch // args.num_workers
  # Under a parameter-server strategy a fit step is one worker's local batch.
  steps_per_epoch = args.steps_per_epoch or len(train["user_rating"]) // local_batch

  def dataset_fn(context):
    ds = tf.data.Dataset.from_tensor_slices(train)
    ds = ds.shard(context.num_input_pipelines, context.input_pipeline_id)
    return ds.shuffle(100_000, seed=args.seed).repeat().batch(local_batch)

  with tf_gba.distribute.LocalCluster(num_ps=1, num_workers=args.num_workers) as cluster:
    if args.optimizer == "gba":
      strategy = tf_gba.distribute.GBAStrategy(cluster.resolver())
    else:  # AdaptiveRevision applies each worker's gradient on arrival (asynchronous training)
      strategy = tf_gba.distribute.GBAStrategy(cluster.resolver(), mode="async")
    with strategy.scope():
      model = MovielensModel(num_users, num_movies)
      if args.optimizer == "gba":
        optimizer = tf_gba.optimizers.GBA(tf.keras.optimizers.Adagrad(learning_rate=0.1),
                                          global_batch_size=global_batch,
                                          local_batch_size=local_batch)
      else:
        # G0 = 0.1, Adagrad's initial accumulator in tf_keras. The paper's G0 = 1 outweighs the
        # squared gradients of most coordinates here (embedding rows a few ratings touch, small
        # dense weights), so their steps stay near alpha x g, about 3x shorter than Adagrad's:
        # 80 steps of 8192 on one worker reached test RMSE 1.112 with G0 = 1 (predictions'
        # spread 0.08) against 1.016 with G0 = 0.1, which is plain Adagrad(0.1)'s 1.016.
        optimizer = tf_gba.optimizers.AdaptiveRevision(alpha=0.1, g0=0.1)
      model.compile(optimizer=optimizer)
      model({"user_id": tf.constant([1]), "movie_id": tf.constant([1])})  # creates the weights
      optimizer.build(model.trainable_variables)
    model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=args.epochs,
              steps_per_epoch=steps_per_epoch, verbose=0)
    result = {"test_rmse": rmse(model, test), "global_steps": int(optimizer.iterations.numpy())}
  mean = float(np.mean(train["user_rating"]))
  result["mean_predictor_rmse"] = float(np.sqrt(np.mean((test["user_rating"] - mean) ** 2)))
  batch = global_batch if args.optimizer == "gba" else local_batch
  print(f"test RMSE {result['test_rmse']:.3f} vs {result['mean_predictor_rmse']:.3f} for the "
        f"mean predictor ({result['global_steps']} global steps of {batch} ratings, "
        f"{args.num_workers} workers, {args.optimizer})", flush=True)
  return result


def _parse():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data", required=True,
                      help="the MovieLens-100K directory: u.data, u.user, u.item (plain or .gz)")
  parser.add_argument("--epochs", type=int, default=10)
  parser.add_argument("--steps_per_epoch", type=int, default=0,
                      help="local batches per epoch, over all workers (0: one pass over the "
                      "training ratings)")
  parser.add_argument("--num_workers", type=int, default=2)
  parser.add_argument("--optimizer", choices=("gba", "adaptive_revision"), default="gba",
                      help="GBA(Adagrad(0.1)) on a global batch of 8192, or AdaptiveRevision("
                      "alpha=0.1) applying each local batch asynchronously")
  parser.add_argument("--seed", type=int, default=42)
  parser.add_argument("--verbose", action="store_true",
                      help="leave TensorFlow's and gRPC's own logs on the terminal")
  return parser.parse_args()


if __name__ == "__main__":
  try:
    main(_parse())
  except BaseException:
    print(f"tfrs_ranking: TensorFlow's logs are in {_LOG_DIR}", file=sys.stderr, flush=True)
    raise
  # The servers' goodbyes (gRPC) would still reach the log file after this point; no need to keep
  # it when the run went well.
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.rmtree(_LOG_DIR, ignore_errors=True)
