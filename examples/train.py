"""tf_gba training binary: one CTR model, any mode, a local or a real parameter-server cluster.

With no TF_CONFIG it starts a local cluster of real TF server processes on 127.0.0.1 and acts as
its coordinator:

  python examples/train.py                                  # DeepFM, synthetic data, GBA
  python examples/train.py --mode=async --stragglers=persistent:3@0
  python examples/train.py --data=criteo:/data/criteo/train.txt --model=dcn

On a real cluster the same command runs on every machine, each with its own TF_CONFIG: tasks of
type "ps" and "worker" serve (with tf_gba's ops loaded), the task of type "chief" coordinates.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the binary's flags (once); every flag has a default that works."""
  if "mode" in FLAGS:
    return
  flags.DEFINE_enum("mode", "gba", ["gba", "async", "bsp", "hop_bs", "hop_bw", "sync", "dts"],
                    "Parameter-server modes: gba, async, bsp, hop_bs, hop_bw; all-reduce "
                    "modes: sync (synchronous workers) and dts (delayed and temporally sparse "
                    "all-reduce). The same model, data and hyper-parameters in every mode.")
  flags.DEFINE_enum("model", "deepfm", ["deepfm", "dcn", "youtube_dnn"], "Model.")
  flags.DEFINE_string("data", "synthetic",
                      "'synthetic', 'criteo:<file, glob or dir>' or 'movielens100k:<dir>'.")
  flags.DEFINE_integer("num_ps", 1, "Parameter servers of the local cluster.")
  flags.DEFINE_integer("num_workers", 4, "Workers of the local cluster.")
  flags.DEFINE_integer("global_batch_size", None,
                       "Synchronous global batch kept by GBA (default: local x workers); "
                       "M = global / local.")
  flags.DEFINE_integer("local_batch_size", 256, "Examples per worker step.")
  flags.DEFINE_integer("staleness_threshold", 3, "GBA's iota: staler gradients are dropped.")
  flags.DEFINE_string("stragglers", "none",
                      "none | persistent:<f>[@w,..] | transient:<p>:<f> | trace:<file.json>, "
                      "joined by '+'.")
  flags.DEFINE_integer("straggler_seed", 0, "Seed of transient slowdowns.")
  flags.DEFINE_integer("steps", None, "Worker steps (local batches) to train, over all workers. "
                       "Unset: one pass over the day's train rows with --input=shared (the run "
                       "ends when the day is consumed), 2000 otherwise.")
  flags.DEFINE_string("model_dir", "/tmp/tf_gba_train",
                      "Checkpoints, summary.json and TensorBoard logs; restored from if present.")
  flags.DEFINE_integer("eval_every", 0, "Evaluate every N worker steps (0: at the end only).")
  flags.DEFINE_integer("log_every", 100, "Progress line every N worker steps.")
  flags.DEFINE_float("learning_rate", 0.001, "Adam learning rate (the same in every mode).")
  flags.DEFINE_integer("embedding_dim", 8, "Embedding width.")
  flags.DEFINE_integer("eval_examples", 20000, "Examples of the eval split to evaluate on.")
  flags.DEFINE_integer("day", None, "Train and evaluate on one day of day-split data.")
  flags.DEFINE_integer("eval_day", None, "Evaluate on every example of this day instead of on "
                       "the eval split of --day (the next-day protocol).")
  flags.DEFINE_integer("seed", 0, "Seed of the model and the input order.")
  flags.DEFINE_bool("strict_data", False, "Fail on a malformed data row instead of skipping it.")
  flags.DEFINE_integer("bsp_aggregate", None,
                       "BSP's b2: gradients per step, whatever their version (default: workers).")
  flags.DEFINE_integer("hop_bs_bound", 2,
                       "Hop-BS's b1: a worker blocks while more than b1 steps ahead of the "
                       "slowest worker.")
  flags.DEFINE_float("hop_bs_timeout_s", 30.0,
                     "Hop-BS: a worker blocked this long goes on anyway (counted in the summary).")
  flags.DEFINE_integer("hop_bw_backup", 1,
                       "Hop-BW's b3: backup workers; each step takes the first num_workers - b3 "
                       "gradients of the current version.")
  flags.DEFINE_integer("dts_delay", 4, "DTS: the all-reduce of step n is consumed at n + t - 1 "
                       "(1: synchronous).")
  flags.DEFINE_integer("dts_period", 4, "DTS: communicate every p-th step.")
  flags.DEFINE_float("dts_latency_ms", 0.0, "DTS: latency injected into each exchange.")
  flags.DEFINE_enum("dts_inner", "momentum", ["sgd", "momentum"], "DTS: local optimizer.")
  flags.DEFINE_bool("async_staleness_stats", True,
                    "In async mode, push through GBA buffers with M=1 to measure staleness; "
                    "false: the bare optimizer (plain ParameterServerStrategy async).")
  flags.DEFINE_enum("input", "shared", ["shared", "sharded"],
                    "Parameter-server modes: 'shared', every worker pulls its next batch from one "
                    "data list (tf.data service, dynamic sharding: each batch of a day read "
                    "once, a slow worker takes fewer); 'sharded', each worker repeats a static "
                    "shard of the rows.")
  flags.DEFINE_integer("tfdata_workers", 2, "--input=shared: tf.data service workers the local "
                       "cluster starts.")
  flags.DEFINE_string("tfdata_dispatcher", "", "--input=shared on a real cluster (TF_CONFIG): "
                      "host:port of the tf.data dispatcher (python -m tf_gba.distribute.server "
                      "--job_name=tfdata_dispatcher --port=PORT).")
  flags.DEFINE_float("stall_timeout_s", 120.0, "--input=shared: a day whose steps make no "
                     "progress this long ends, reporting the batches not trained on.")
  flags.DEFINE_string("data_options", "",
                      "Options of the data source as key=value,... e.g. num_examples=500000,"
                      "num_days=3,drift=0.2 (synthetic), vocab_size=100000 (criteo), num_days=7 "
                      "(movielens100k).")


def _task_type() -> str:
  import json  # pylint: disable=g-import-not-at-top
  tf_config = json.loads(os.environ.get("TF_CONFIG") or "{}")
  return tf_config.get("task", {}).get("type", "")


def main(argv=None):
  del argv
  if _task_type() in ("ps", "worker"):  # tf.data servers: python -m tf_gba.distribute.server
    from tf_gba.distribute import server  # pylint: disable=g-import-not-at-top
    return server.main([])
  import tf_gba  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  from tf_gba.training import TrainConfig  # pylint: disable=g-import-not-at-top
  from tf_gba.training import run  # pylint: disable=g-import-not-at-top
  config = TrainConfig(
      mode=FLAGS.mode, model=FLAGS.model, data=FLAGS.data, num_ps=FLAGS.num_ps,
      num_workers=FLAGS.num_workers, global_batch_size=FLAGS.global_batch_size,
      local_batch_size=FLAGS.local_batch_size, staleness_threshold=FLAGS.staleness_threshold,
      stragglers=FLAGS.stragglers, straggler_seed=FLAGS.straggler_seed, steps=FLAGS.steps,
      model_dir=FLAGS.model_dir, eval_every=FLAGS.eval_every, log_every=FLAGS.log_every,
      learning_rate=FLAGS.learning_rate, embedding_dim=FLAGS.embedding_dim,
      eval_examples=FLAGS.eval_examples, day=FLAGS.day, eval_day=FLAGS.eval_day,
      seed=FLAGS.seed,
      strict_data=FLAGS.strict_data, data_options=FLAGS.data_options,
      async_staleness_stats=FLAGS.async_staleness_stats, dts_delay=FLAGS.dts_delay,
      dts_period=FLAGS.dts_period, dts_latency_ms=FLAGS.dts_latency_ms,
      dts_inner=FLAGS.dts_inner, bsp_aggregate=FLAGS.bsp_aggregate,
      hop_bs_bound=FLAGS.hop_bs_bound, hop_bs_timeout_s=FLAGS.hop_bs_timeout_s,
      hop_bw_backup=FLAGS.hop_bw_backup, input=FLAGS.input,
      tfdata_workers=FLAGS.tfdata_workers, tfdata_dispatcher=FLAGS.tfdata_dispatcher,
      stall_timeout_s=FLAGS.stall_timeout_s)
  try:
    config.validate()
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  return run(config)


def _entry(argv):
  main(argv)
  sys.stdout.flush()
  sys.stderr.flush()
  # The local cluster is already gone; skipping interpreter teardown spares the log TF would
  # write about remote handles it can no longer release.
  os._exit(0)


if __name__ == "__main__":
  define_flags()
  app.run(_entry)
