"""tf_gba training binary: one CTR model, any mode, a local or a real parameter-server cluster.

With no TF_CONFIG it starts a local cluster of real TF server processes on 127.0.0.1 and acts as
its coordinator:

  python examples/train.py                                  # DeepFM, synthetic data, GBA
  python examples/train.py --mode=async --stragglers=persistent:3@0
  python examples/train.py --data=criteo:/data/criteo/train.txt --model=dcn

On a real cluster the same command runs on every machine, each with its own TF_CONFIG: tasks of
type "ps" and "worker" serve (with tf_gba's ops loaded), the task of type "chief" coordinates.
"""

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

# Whether the user chose TensorFlow's C++ log level; if not, --verbosity=debug lowers it.
_USER_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL" in os.environ
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from tf_gba.common import exiting  # noqa: E402
from tf_gba.common import interrupt  # noqa: E402
# The modes, their help and the flags each reads (no TensorFlow: the supervisor stays free of it).
from tf_gba.training import mode_registry  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the binary's flags (once); every flag has a default that works."""
  if "mode" in FLAGS:
    return
  flags.DEFINE_enum("mode", "gba", list(mode_registry.names()), mode_registry.help_text())
  flags.DEFINE_enum("model", "deepfm", ["deepfm", "dcn", "youtube_dnn"], "Model.")
  flags.DEFINE_string("data", "synthetic",
                      "'synthetic', 'criteo:<file, glob or dir>' or 'movielens100k:<dir>'.")
  flags.DEFINE_integer("num_ps", 1, "Parameter servers of the local cluster (with TF_CONFIG: "
                       "its cluster's).")
  flags.DEFINE_integer("num_workers", 4, "Workers of the local cluster (with TF_CONFIG: its "
                       "cluster's).")
  flags.DEFINE_integer("global_batch_size", None,
                       "Synchronous global batch kept by GBA (default: local x workers); "
                       "M = global / local.")
  flags.DEFINE_integer("local_batch_size", 256, "Examples per worker step.")
  flags.DEFINE_integer("staleness_threshold", 3, "GBA's iota: staler gradients are dropped.")
  flags.DEFINE_enum("sparse_normalize", "num_aggregate", ["num_aggregate", "per_id"],
                    "Parameter-server modes: divide an embedding row's aggregate by M (rows "
                    "absent from a batch count as zero, as the all-reduce sync mode does) or by "
                    "the number of aggregated batches that contained the row (the paper's rule).")
  flags.DEFINE_string("stragglers", "none",
                      "none | persistent:<f>[@w,..] | transient:<p>:<f> | trace:<file.json>, "
                      "joined by '+'.")
  flags.DEFINE_integer("straggler_seed", 0, "Seed of transient slowdowns.")
  flags.DEFINE_enum("straggler_delay", "after_push", ["after_push", "before_push"],
                    "Parameter-server modes: where a straggler sleeps its slowdown: at the end of "
                    "the step, after its gradient was pushed (a worker slow to take its next "
                    "batch), or between the gradient and its push (a slow machine: its gradient "
                    "arrives late and stale).")
  flags.DEFINE_integer("steps", None, "Worker steps (local batches) to train, over all workers. "
                       "Unset: one pass over the day's train rows with --input=shared (the run "
                       "ends when the day is consumed), 2000 otherwise.")
  flags.DEFINE_string("model_dir", "/tmp/tf_gba_train",
                      "Checkpoints, summary.json and TensorBoard logs; restored from if present.")
  flags.DEFINE_integer("eval_every", 0, "Evaluate every N worker steps (0: at the end only).")
  flags.DEFINE_integer("log_every", 200,
                       "Progress line every N worker steps (each line costs the coordinator "
                       "reads from every server).")
  flags.DEFINE_integer("steps_per_execution", None,
                       "Parameter-server modes: worker steps run by one function the coordinator "
                       "schedules (each step its own batch, token and push); fewer functions cost "
                       "the coordinator less CPU per step. Unset: with --input=shared, 50, or "
                       "fewer where an interval (--log_every) has fewer than 50 per worker (a "
                       "function run again after its worker failed skips the steps already "
                       "done); 1 with --input=sharded (a re-run trains its whole function again) "
                       "and in hop_bs and hop_bw, which refuse more than 1.")
  flags.DEFINE_bool("pack_reads", True,
                    "Parameter-server modes: a step reads the small dense variables of each "
                    "parameter server as one tensor (one transfer per server; the same values and "
                    "gradients). --nopack_reads: one transfer per variable.")
  flags.DEFINE_float("learning_rate", 0.001, "Adam learning rate (the same in every mode).")
  flags.DEFINE_integer("embedding_dim", 8, "Embedding width.")
  flags.DEFINE_enum("embedding", "vocab", ["vocab", "hash"],
                    "Categorical fields' table: 'vocab', one table over fixed vocabularies (ids "
                    "folded modulo each one, partitioned over the parameter servers); 'hash', "
                    "an expandable hash table over the raw ids (Criteo values as 64-bit "
                    "fingerprints, no modulo; tf_gba.layers.HashEmbedding, docs/"
                    "hash_embeddings.md), in the modes that update it through GBA on parameter "
                    "servers, or on every worker with all-gathered rows (sync): " +
                    ", ".join(mode_registry.hash_embedding_modes()) + ".")
  flags.DEFINE_integer("hash_min_frequency", 0,
                       "--embedding=hash: an id gets a row at its Nth training lookup (zero row "
                       "and dropped gradients before; 0: off).")
  flags.DEFINE_integer("hash_ttl_steps", 0,
                       "--embedding=hash: evict rows not looked up for more than N global steps "
                       "(0: off).")
  flags.DEFINE_integer("hash_max_rows", 0,
                       "--embedding=hash: the table's row budget over all parameter servers; "
                       "beyond it the least frequent rows are evicted (0: off).")
  flags.DEFINE_integer("hash_admission_filter_cells", 0,
                       "--embedding=hash with --hash_min_frequency: keep the admission counts in "
                       "a counting Bloom filter of N one-byte cells per parameter server (fixed "
                       "memory; false positives admit early) instead of one exact count per id "
                       "(0).")
  flags.DEFINE_integer("eval_examples", 20000, "Examples of the eval split to evaluate on.")
  flags.DEFINE_integer("day", None, "Train and evaluate on one day of day-split data.")
  flags.DEFINE_integer("eval_day", None, "Evaluate on every example of this day instead of on "
                       "the eval split of --day (the next-day protocol).")
  flags.DEFINE_integer("seed", 0, "Seed of the model and the input order.")
  flags.DEFINE_bool("strict_data", False, "Fail on a malformed data row instead of skipping it.")
  flags.DEFINE_integer("bsp_aggregate", None,
                       "BSP's b2: gradients per step, whatever their version (default: "
                       "max(1, round(workers / 5))).")
  flags.DEFINE_integer("hop_bs_bound", 2,
                       "Hop-BS's b1: a worker blocks while more than b1 steps ahead of the "
                       "slowest worker.")
  flags.DEFINE_float("hop_bs_timeout_s", None,
                     "Hop-BS: a worker blocked this long goes on anyway (counted in the summary); "
                     "unset: it blocks without a time limit.")
  flags.DEFINE_integer("hop_bw_backup", None,
                       "Hop-BW's b3: backup workers; each step takes the first num_workers - b3 "
                       "gradients of the current version, and a worker computes at most one "
                       "gradient per version (default: max(1, round(workers / 5))).")
  flags.DEFINE_float("async_tuned_learning_rate", 0.007,
                     "--mode=async_tuned: Adagrad's learning rate (paper: 0.006-0.008).")
  flags.DEFINE_integer("async_tuned_local_batch_size", None,
                       "--mode=async_tuned: examples per worker step (default: "
                       "--local_batch_size).")
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
                     "progress this long ends, reporting the batches not trained on; a run of "
                     "--steps restarts from its last checkpoint, as after a periodic checkpoint "
                     "save held this long (and 4x the run's longest save) by a server that does "
                     "not answer.")
  flags.DEFINE_float("cluster_wait_s", 600.0, "On a real cluster (TF_CONFIG): how long the chief "
                     "waits for its parameter servers and workers to accept connections (it "
                     "names those it waits for every few seconds) before giving up.")
  flags.DEFINE_string("data_options", "",
                      "Options of the data source as key=value,... e.g. num_examples=500000,"
                      "num_days=3,drift=0.2 (synthetic), vocab_size=100000 (criteo), num_days=7 "
                      "(movielens100k).")
  flags.DEFINE_integer("checkpoint_every_steps", 0,
                       "Also write a checkpoint every N worker steps during training (0: only at "
                       "the end).")
  flags.DEFINE_float("checkpoint_every_secs", 0.0,
                     "Also write a checkpoint every S seconds during training (0: off).")
  flags.DEFINE_integer("keep_checkpoints", 3, "Checkpoints kept in model_dir (the newest).")
  flags.DEFINE_integer("full_checkpoint_every", 1,
                       "--embedding=hash: every K-th periodic checkpoint (and the last) is full; "
                       "the others hold only the table rows changed since the checkpoint before "
                       "and the keys removed, in model_dir/deltas/ (1: every checkpoint full).")
  flags.DEFINE_string("export_dir", None,
                      "Where the run's serving SavedModel goes, after the final checkpoint, as "
                      "<export_dir>/<global step> (default <model_dir>/export; empty: none). "
                      "Stock TensorFlow loads it without tf_gba (docs/serving.md).")
  flags.DEFINE_integer("max_restarts", 3,
                       "Local runs of the parameter-server modes: how many times the job is "
                       "started again, from its last checkpoint, after a parameter server or "
                       "this coordinator died (0: never). Dead workers are restarted anyway.")
  flags.DEFINE_bool("private_network", True,
                    "Local runs: put the job (coordinator and servers) in a network namespace of "
                    "its own, so that other hosts cannot reach its unauthenticated TF servers "
                    "(README: Security). Turn off to read data over the network (gs://, ...).")
  # ShadowSync and ASGD without gradient delay (tf_gba/training/shadow_job.py).
  flags.DEFINE_float("shadow_alpha", 0.5, "shadow_*: elastic alpha of the replicas' pull.")
  flags.DEFINE_float("shadow_bmuf_eta", 1.0, "shadow_bmuf: block step size eta.")
  flags.DEFINE_float("shadow_bmuf_momentum", 0.0, "shadow_bmuf: block momentum (0: none).")
  flags.DEFINE_bool("shadow_bmuf_nesterov", False, "shadow_bmuf: Nesterov block momentum.")
  flags.DEFINE_integer("asgd_tau", 4, "asgd_nodelay: maximal staleness tau (local steps).")
  flags.DEFINE_integer("asgd_algorithm", 1,
                       "asgd_nodelay: Algorithm 1, or 2 (cycles of tau / 2 steps).")
  flags.DEFINE_float("shadow_sync_delay_ms", 0.0,
                     "shadow_*/asgd_nodelay: delay injected into every sync or merge.")
  flags.DEFINE_bool("keep_logs", False,
                    "Keep the log files of this process and of the local cluster's servers (in "
                    "<model_dir>/logs); by default they go to a temporary directory deleted at "
                    "the end of the run.")
  # --mode=auto (tf_gba/training/auto_policy.py).
  flags.DEFINE_float("auto_margin", 0.3, "--mode=auto: switch sync -> gba when GBA's predicted "
                     "QPS is at least (1 + margin) x Sync's.")
  flags.DEFINE_float("auto_hysteresis", 0.15, "--mode=auto: switch gba -> sync when the "
                     "predicted gain falls below 1 + margin - hysteresis.")
  flags.DEFINE_float("auto_dwell_s", 20.0, "--mode=auto: seconds trained in a mode before it "
                     "may be left.")
  flags.DEFINE_integer("auto_confirm", 2, "--mode=auto: consecutive progress lines that must "
                       "agree before a switch.")
  flags.DEFINE_bool("dry_run", False, "Check the flags, the configuration, the data and "
                    "model_dir as a run does before it starts anything, print one line and exit "
                    "(0 when all is valid); no server, cluster or network namespace is started.")
  flags.DEFINE_float("auto_sync_efficiency", 1.0, "--mode=auto: Sync's measured QPS over its "
                     "model QPS (N x batch / slowest step time) assumed before its first stay.")
  flags.DEFINE_float("auto_gba_efficiency", 1.0, "--mode=auto: GBA's measured QPS over its model "
                     "QPS (batch x sum of the workers' step rates) assumed before its first stay.")
  flags.DEFINE_bool("auto_learn_efficiency", True, "--mode=auto: once a mode has had a stay, "
                    "predict it from what that stay measured (its step overhead beyond the "
                    "workers' own step times) instead of the assumed efficiency (off: the flags' "
                    "efficiencies hold throughout).")
  flags.DEFINE_float("auto_switch_cost_s", 15.0, "--mode=auto: seconds a switch costs, assumed "
                     "until one is measured (then the mean of the last two measured).")
  flags.DEFINE_float("auto_horizon_s", 60.0, "--mode=auto: a switch is taken when the time it "
                     "saves over this many seconds (at least --auto_dwell_s) exceeds its cost.")
  flags.DEFINE_float("auto_probe_s", 0.0, "--mode=auto: start with a probe stay of this many "
                     "training seconds in each mode (Sync, then GBA, which then stays or goes "
                     "back by the usual rule), so that both efficiencies are measured before the "
                     "policy relies on them; 0: no probe.")
  flags.DEFINE_float("auto_measure_s", 5.0, "--mode=auto: a mode's first stay (entered on the "
                     "efficiency assumed for it) may be left after this many training seconds, "
                     "instead of --auto_dwell_s, once its measured efficiency says so.")


def _task_type() -> str:
  """This process's TF_CONFIG task type ("" without TF_CONFIG); _check_tf_config ran before."""
  if not os.environ.get("TF_CONFIG"):
    return ""
  return _module_from_file("distribute", "tf_config").parse(os.environ["TF_CONFIG"]).task_type


def _check_tf_config() -> None:
  """A malformed or inconsistent TF_CONFIG is one line, exit 2, before anything starts; on the
  chief, the cluster it describes sets --num_workers and --num_ps (and through them every
  default that depends on them: the global batch, M, b2, b3, the data list's workers)."""
  if not os.environ.get("TF_CONFIG"):
    return
  tf_config = _module_from_file("distribute", "tf_config")
  try:
    cfg = tf_config.parse(os.environ["TF_CONFIG"])
  except tf_config.TFConfigError as e:
    _fail(str(e))
  if cfg.task_type != "chief":
    return
  for flag, job in (("num_workers", "worker"), ("num_ps", "ps")):
    n = cfg.count(job)
    if FLAGS[flag].present and FLAGS[flag].value != n:
      _fail(f"--{flag}={FLAGS[flag].value} contradicts TF_CONFIG, whose cluster.{job} lists "
            f"{n}: drop --{flag} (TF_CONFIG sets it).")
    if n:
      FLAGS[flag].value = n


def main(argv=None):
  del argv
  # A ps or worker task serves (tf.data servers: python -m tf_gba.distribute.server); dry, it is
  # checked as the chief is.
  if _task_type() in ("ps", "worker") and not FLAGS.dry_run:
    from tf_gba.distribute import server  # pylint: disable=g-import-not-at-top
    return server.main([])
  import tf_gba  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  from tf_gba.training import TrainConfig  # pylint: disable=g-import-not-at-top
  from tf_gba.training import run  # pylint: disable=g-import-not-at-top
  # Every TrainConfig field has the flag of the same name (a mode's own flags included), but
  # log_dir: absl's own --log_dir is another thing; the run's log directory is chosen here.
  values = {f.name: FLAGS[f.name].value for f in dataclasses.fields(TrainConfig)
            if f.name in FLAGS and f.name != "log_dir"}
  config = TrainConfig(**values, log_dir=_LOGS.get("dir"))
  if FLAGS.dry_run:
    return _dry_run(config)
  _prefork_servers(config)
  return run(config)


def _prefork_servers(config) -> None:
  """A local job: its servers (or collective workers) will be forks of a fork of this process,
  made now, before any TensorFlow op runs here (tf_gba.distribute.server_forker.prefork): this
  process has imported TensorFlow already, and the forker need not import it again."""
  if os.environ.get("TF_CONFIG"):
    return
  from tf_gba.distribute import local_cluster  # pylint: disable=g-import-not-at-top
  local_cluster.prefork_forker(config.log_dir)


def _dry_run(config) -> int:
  """--dry_run: the checks `run` makes before any server starts, then one line on stdout."""
  from tf_gba.training import preflight  # pylint: disable=g-import-not-at-top
  report = preflight.check(config)  # raises InputError, as in a run
  rows = (f", {report['rows_checked']:,} data rows checked" if report["rows_checked"] else "")
  print(f"train.py: dry run: --mode={config.mode} --data={config.data} "
        f"--model_dir={config.model_dir} valid{rows}; nothing started.", flush=True)
  return 0


# The run's log directory: {"dir": path} once _quiet_stderr has chosen it.
_LOGS = {}


def _quiet_stderr() -> None:
  """Sends what TensorFlow's C++ runtime writes on stderr to a log file; Python keeps the terminal.

  TF and gRPC log start-up notices and, when the local cluster goes away, lines about remote
  handles they can no longer reach, straight to file descriptor 2: no Python setting silences them.
  Descriptor 2 is pointed at `coordinator.log` in the run's log directory (the servers' logs go
  there too), while `sys.stderr` keeps a copy of the terminal for progress, errors and
  tracebacks.
  """
  if _keep_logs():
    log_dir = os.path.join(FLAGS.model_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
  else:
    log_dir = tempfile.mkdtemp(prefix="tf_gba_logs_")
  _LOGS["dir"] = log_dir
  terminal = os.dup(2)
  fd = os.open(os.path.join(log_dir, "coordinator.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
               0o644)
  os.dup2(fd, 2)
  os.close(fd)
  sys.stderr = os.fdopen(terminal, "w", buffering=1)


def _keep_logs() -> bool:
  return FLAGS.keep_logs and not FLAGS.dry_run  # a dry run writes nothing into model_dir


def _end_logs(keep: bool) -> None:
  log_dir = _LOGS.get("dir")
  if not log_dir:
    return
  if keep or _keep_logs():
    print(f"train.py: logs kept in {log_dir}", file=sys.stderr, flush=True)
  else:
    shutil.rmtree(log_dir, ignore_errors=True)


def _debug() -> bool:
  """--verbosity=debug (1) or more: tracebacks and TensorFlow's own logs are shown."""
  return FLAGS["verbosity"].present and FLAGS.verbosity >= 1


def _fail(message: str) -> None:
  """One line on stderr and exit code 2: the user's input is at fault, not the program."""
  print(f"train.py: error: {message}", file=sys.stderr, flush=True)
  _end_logs(keep=False)
  exiting.exit_now(2)


# tf_gba.training.recovery.EXIT_RESTART (not imported: the supervisor stays free of TensorFlow).
_EXIT_RESTART = 75
_SUPERVISOR_ENV = "TF_GBA_SUPERVISOR_PID"


def _module_from_file(package: str, name: str):
  """tf_gba.<package>.<name> loaded from its file: the supervisor stays free of TensorFlow
  (importing the tf_gba package imports it)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(
      f"_tf_gba_{name}", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                      "tf_gba", package, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _supervised() -> bool:
  """Whether this process should run the job as a child it restarts after a failure."""
  return (not os.environ.get("TF_CONFIG") and not FLAGS.dry_run and FLAGS.max_restarts > 0 and
          mode_registry.get(FLAGS.mode).kind == mode_registry.PARAMETER_SERVER and
          _SUPERVISOR_ENV not in os.environ)


def _supervise() -> int:
  """Runs the job in a child process; starts it again when it lost a parameter server or died.

  A dead parameter server takes the variables with it, and TF cannot reconnect a coordinator to a
  new one: the whole job (coordinator and local cluster) starts again and resumes from the last
  checkpoint, toward the same target (tf_gba.training.recovery). A child killed by a signal (the
  coordinator itself died) is started again the same way.
  """
  restarts = 0
  env = dict(os.environ, **{_SUPERVISOR_ENV: str(os.getpid())})
  received = []
  current = {}

  def forward(signum, frame):  # pylint: disable=unused-argument
    # Each signal to the job: the first stops it at its next progress point with a checkpoint,
    # a second at once (tf_gba.common.interrupt).
    received.append(signum)
    child = current.get("child")
    if child is not None and child.poll() is None:
      child.send_signal(signum)

  for signum in interrupt.SIGNALS:
    signal.signal(signum, forward)
  while True:
    if received:  # between two jobs (a restart)
      print(f"train.py: stopped by {interrupt.name(received[0])} before restarting the job; rerun "
            "the same command to resume from the last checkpoint.", file=sys.stderr, flush=True)
      return interrupt.exit_code(received[0])
    # A process group of its own: Ctrl-C reaches this process only, which forwards it once.
    child = _start_job(env)
    current["child"] = child
    rc = child.wait()
    if received:
      if rc < 0:  # ended by the signal before it could handle it (still starting)
        print(f"train.py: {interrupt.message(received[0], None, None)}", file=sys.stderr,
              flush=True)
        return interrupt.exit_code(received[0])
      return rc
    if rc not in (_EXIT_RESTART, -signal.SIGKILL, -signal.SIGSEGV, -signal.SIGABRT):
      return rc
    if rc < 0:
      # Killed by a signal: the job itself could say nothing; the resumed run's summary lists
      # the signal among its restart causes.
      name = signal.Signals(-rc).name
      print(f"train.py: the job's process died of {name}.", file=sys.stderr, flush=True)
      _module_from_file("training", "recovery").record_failure(FLAGS.model_dir, name)
    restarts += 1
    if restarts > FLAGS.max_restarts:
      print(f"train.py: error: the job failed {restarts} times; rerun the same command to resume "
            f"from the last checkpoint in {FLAGS.model_dir}.", file=sys.stderr, flush=True)
      return 1
    print(f"train.py: restarting the job from its last checkpoint (restart {restarts} of at most "
          f"{FLAGS.max_restarts}).", file=sys.stderr, flush=True)
    time.sleep(1.0)


def _without_rerun_advice(message: str) -> str:
  """A lost job's line, without its advice to rerun the command where this process's supervisor
  restarts the job itself (its next line says so); a user reruns only when it gives up."""
  if _SUPERVISOR_ENV not in os.environ:
    return message
  advice = message.find(" Rerun the same command")
  return message if advice < 0 else message[:advice]


def _start_job(env):
  """The job as a child process in a process group of its own: a new interpreter running this
  command, or, in a supervisor that has imported TensorFlow without running it (a fork of a
  process that had: tests/script_process.py), a fork of this process, which need not import it
  again (as tf_gba.distribute.server_forker forks servers)."""
  forking = _job_forking()
  if forking is None:
    return subprocess.Popen([sys.executable] + sys.argv, env=env, process_group=0)
  for stream in (sys.stdout, sys.stderr):  # or the fork writes what is buffered a second time
    stream.flush()
  pid = os.fork()
  if pid:
    return forking.ForkedChild(pid)
  code = 1
  try:
    os.setpgid(0, 0)
    for signum in interrupt.SIGNALS:
      signal.signal(signum, signal.SIG_DFL if signum != signal.SIGINT else
                    signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    _entry([sys.argv[0]])  # the job (this process is no supervisor now: _SUPERVISOR_ENV is set)
    code = 0
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 1
  except BaseException:  # pylint: disable=broad-except
    sys.excepthook(*sys.exc_info())  # as an interpreter ends on an uncaught exception
  finally:
    exiting.exit_now(code)


def _job_forking():
  """tf_gba.distribute.server_forker when this supervisor may fork its job, else None."""
  if "tensorflow" not in sys.modules:
    return None  # (and the supervisor stays free of it)
  from tf_gba.distribute import server_forker  # pylint: disable=g-import-not-at-top
  return server_forker if server_forker.enabled() and server_forker.imported_unused() else None


def _watch_supervisor(pid: int) -> None:
  # The supervisor died (killed with the user's command): this job goes too, and its servers
  # with it; rerunning the command resumes.
  while os.getppid() == pid:
    time.sleep(1.0)
  exiting.exit_now(1)


def _isolate() -> None:
  """A local run: the job's servers in a private network namespace, or a one-line warning."""
  if os.environ.get("TF_CONFIG") or _SUPERVISOR_ENV in os.environ or FLAGS.dry_run:
    return  # a real cluster's task; the supervisor has done it for the whole job; or no job
  why = "--noprivate_network"
  if FLAGS.private_network:
    why = _module_from_file("distribute", "private_network").enter()
    if why is None:
      return
  print(f"train.py: warning: the local cluster's TF servers accept unauthenticated connections "
        f"from any host that can reach this machine while the run lasts (no private network: "
        f"{why}); run on a trusted network (README: Security).", file=sys.stderr, flush=True)


def _check_mode_flags() -> None:
  """A mode-specific flag set explicitly for a mode that does not read it is an error."""
  unused = mode_registry.unused_flags(FLAGS.mode, [name for name in FLAGS if FLAGS[name].present])
  if unused:
    _fail(mode_registry.unused_flags_message(FLAGS.mode, unused) + ".")


def _stopped(e) -> None:
  """A run stopped by SIGINT or SIGTERM (tf_gba.common.interrupt): one line, exit 130 or 143."""
  print(f"train.py: {e}", file=sys.stderr, flush=True)
  _end_logs(keep=False)
  exiting.exit_now(e.exit_code)


def _entry(argv):
  if argv and len(argv) > 1:  # words absl did not take as flags would otherwise be ignored
    _fail(f"unexpected argument(s) {' '.join(argv[1:])!r}: every option is a --flag=value; "
          "check for a flag that lost its '--' or a value split from its flag.")
  _check_mode_flags()
  _check_tf_config()
  _isolate()
  if _supervised():
    exiting.exit_now(_supervise())
  # SIGINT and SIGTERM: the run stops at its next progress point with a checkpoint; a second
  # signal ends it at once (the servers of the local cluster follow: they watch this process).
  interrupt.install(on_abort=lambda: _end_logs(keep=False))
  if _SUPERVISOR_ENV in os.environ:
    threading.Thread(target=_watch_supervisor, args=(int(os.environ[_SUPERVISOR_ENV]),),
                     daemon=True).start()
  if _debug() and not _USER_LOG_LEVEL:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
  if not FLAGS["verbosity"].present:
    _quiet_stderr()  # before TensorFlow is imported: its start-up notices come at import
  from tf_gba.distribute import tf_config  # pylint: disable=g-import-not-at-top
  from tf_gba.training import preflight  # pylint: disable=g-import-not-at-top
  from tf_gba.training import recovery  # pylint: disable=g-import-not-at-top
  try:
    main(argv)
  except preflight.InputError as e:
    if _debug():
      raise
    _fail(str(e))
  except interrupt.Interrupted as e:
    _stopped(e)
  except (recovery.AfterTrainingError, tf_config.ServersUnreachable) as e:
    if _debug():
      raise
    print(f"train.py: error: {e}", file=sys.stderr, flush=True)
    _end_logs(keep=False)
    exiting.exit_now(1)
  except recovery.JobLost as e:
    if _debug():
      raise
    print(f"train.py: {_without_rerun_advice(str(e))}", file=sys.stderr, flush=True)
    recovery.record_failure(FLAGS.model_dir, e)  # the resumed run's summary says why
    _end_logs(keep=False)
    exiting.exit_now(recovery.EXIT_RESTART)
  except BaseException as e:  # pylint: disable=broad-except
    # A malformed row past the pre-flight scan, met by a worker under --strict_data.
    if _debug() or "Malformed" not in str(e):
      _end_logs(keep=True)  # they may say what went wrong
      raise
    line = next(l for l in str(e).splitlines() if "Malformed" in l).strip()
    _fail(f"--strict_data: {line[line.index('Malformed'):][:300]}; fix or remove the row, or "
          "drop --strict_data to skip malformed rows.")
  _end_logs(keep=False)
  # The local cluster is already gone; skipping interpreter teardown spares the log TF would
  # write about remote handles it can no longer release (exit_now removes what teardown would).
  exiting.exit_now(0)


# absl's --verbosity takes a number; these names are accepted too (debug = 1: TF's logs and
# tracebacks are shown).
_VERBOSITY_NAMES = {"debug": "1", "info": "0", "warning": "-1", "error": "-2", "fatal": "-3"}


def _named_verbosity(argv):
  out = []
  for arg in argv:
    name, sep, value = arg.partition("=")
    if sep and name in ("--verbosity", "-v") and value.lower() in _VERBOSITY_NAMES:
      arg = f"{name}={_VERBOSITY_NAMES[value.lower()]}"
    out.append(arg)
  return out


def _parse_flags(argv):
  """absl's parsing, with a flag error as every other bad input: one line, exit code 2."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    print(f"train.py: error: {e} (python examples/train.py --help lists the flags)",
          file=sys.stderr, flush=True)
    exiting.exit_now(2)


if __name__ == "__main__":
  define_flags()
  app.run(_entry, argv=_named_verbosity(sys.argv), flags_parser=_parse_flags)
