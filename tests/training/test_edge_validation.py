"""The training binary's checks made before any server starts, in process (fast): non-finite
hyper-parameters, straggler workers that do not exist, --day / --eval_day against the data,
what --steps trains, corrupt records in model_dir, TF_CONFIG, and the constructors' arguments.
The binary's own lines and exit codes are in test_bad_input.py."""

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import tf_keras as keras

from tf_gba.common import interrupt
from tf_gba.distribute import GBAStrategy
from tf_gba.distribute import tf_config
from tf_gba.optimizers import DTS
from tf_gba.optimizers import GBA
from tf_gba.optimizers import AdaptiveRevision
from tf_gba.training import mode_registry
from tf_gba.training import preflight
from tf_gba.training import recovery
from tf_gba.training.config import TrainConfig


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(tmp_path, **kwargs):
  kwargs.setdefault("num_workers", 2)
  kwargs.setdefault("model_dir", str(tmp_path / "m"))
  return TrainConfig(**kwargs)


@pytest.mark.parametrize("field,value", [
    ("learning_rate", math.inf), ("learning_rate", math.nan), ("learning_rate", -math.inf),
    ("async_tuned_learning_rate", math.inf), ("shadow_alpha", math.nan),
    ("auto_margin", math.inf), ("stall_timeout_s", math.inf), ("hop_bs_timeout_s", math.nan),
    ("cluster_wait_s", math.inf)])
def test_non_finite_hyper_parameters_are_refused(tmp_path, field, value):
  with pytest.raises(ValueError) as e:
    _config(tmp_path, **{field: value}).validate()
  assert str(e.value) == f"--{field} must be a finite number, got {value}."


@pytest.mark.parametrize("profile,named", [
    ("persistent:3@9", "9"), ("persistent:3@0,2,5", "2, 5"), ("persistent:2@-1", "-1"),
    ("transient:0.1:3+persistent:3@4", "4")])
def test_a_straggler_naming_a_missing_worker_is_refused(tmp_path, profile, named):
  with pytest.raises(ValueError) as e:
    _config(tmp_path, stragglers=profile).validate()
  assert str(e.value) == (f"--stragglers={profile} names worker {named}, which does not exist: "
                          "the workers are 0 to 1 (--num_workers=2).")


def test_a_trace_naming_a_missing_worker_is_refused(tmp_path):
  trace = tmp_path / "trace.json"
  trace.write_text(json.dumps({"window_seconds": 1, "workers": {"0": [1, 2], "3": [2]}}))
  with pytest.raises(ValueError, match=r"names worker 3, which does not exist"):
    _config(tmp_path, stragglers=f"trace:{trace}").validate()
  _config(tmp_path, stragglers=f"trace:{trace}", num_workers=4).validate()


def _steps_reference(mode, steps, log_every, every, workers):
  """Worker steps a run trains, written out independently: whole fit epochs of
  gcd(log_every, every) in the parameter-server modes (one epoch of `steps` when shorter), whole
  global steps of `workers` batches in the all-reduce ones."""
  if mode == "sync":
    return max(1, steps // workers) * workers
  interval = math.gcd(log_every, every or log_every)
  if steps < interval:
    return steps
  epochs = -(-steps // interval)
  return epochs * interval


@pytest.mark.parametrize("mode,steps,log_every,every", [
    ("gba", 1, 20, 0), ("gba", 30, 20, 0), ("gba", 40, 20, 0), ("gba", 45, 20, 30),
    ("gba", 7, 100, 0), ("async", 2001, 100, 0), ("sync", 30, 20, 0), ("sync", 1, 20, 0),
    ("sync", 40, 20, 0), ("shadow_ma", 31, 20, 0)])
def test_steps_trained_and_the_line_that_says_so(tmp_path, mode, steps, log_every, every):
  cfg = _config(tmp_path, mode=mode, steps=steps, log_every=log_every,
                checkpoint_every_steps=every, input="sharded", num_workers=4)
  expected = steps if mode == "shadow_ma" else _steps_reference(mode, steps, log_every, every, 4)
  assert cfg.steps_trained() == expected
  note = cfg.steps_note()
  if expected == steps:
    assert note is None
  elif mode == "sync":
    assert note == (f"--steps={steps} trains {expected} worker steps: --mode=sync trains whole "
                    "global steps of one batch on each of the 4 workers; pass a multiple of 4 to "
                    "train exactly that.")
  else:
    interval = math.gcd(log_every, every or log_every)
    extra = f", --checkpoint_every_steps={every}" if every else ""
    assert note == (f"--steps={steps} trains {expected} worker steps: the parameter-server "
                    f"modes train whole intervals of {interval} worker steps "
                    f"(--log_every={log_every}{extra}); pass a multiple of {interval} to train "
                    "exactly that.")


@pytest.mark.parametrize("flag,value,options,days", [
    ("day", 99, "", 1), ("eval_day", 5, "", 1), ("eval_day", 3, "num_days=3", 3)])
def test_day_beyond_the_data_is_refused_before_any_server(tmp_path, flag, value, options, days):
  cfg = _config(tmp_path, **{flag: value}, data_options=options, steps=20)
  with pytest.raises(preflight.InputError) as e:
    preflight.check(cfg)
  assert str(e.value) == (f"--{flag}={value}: --data=synthetic holds {days} day(s), 0 to "
                          f"{days - 1} (more with --data_options=num_days=N).")
  assert not os.path.exists(cfg.model_dir)


# The modes whose embeddings live on parameter servers behind the GBA optimizer (written out
# here, not read from the registry).
_HASH_MODES = ("sync", "gba", "async", "bsp", "hop_bs", "hop_bw", "async_tuned")


@pytest.mark.parametrize("mode", mode_registry.names())
def test_hash_embedding_is_refused_where_no_parameter_server_hosts_it(tmp_path, mode):
  cfg = _config(tmp_path, mode=mode, embedding="hash", steps=20)
  if mode in _HASH_MODES:
    cfg.validate()
    return
  with pytest.raises(preflight.InputError) as e:
    preflight.check(cfg)
  assert str(e.value) == (
      f"--embedding=hash cannot run in --mode={mode}: the hash table lives on the parameter "
      "servers, updated through the GBA optimizer, or whole on every worker of --mode=sync; "
      f"only {', '.join(_HASH_MODES)} host it; use one of them, or --embedding=vocab.")
  assert not os.path.exists(cfg.model_dir)


@pytest.mark.parametrize("kwargs,expected", [
    (dict(mode="async", async_staleness_stats=False),
     "--embedding=hash in --mode=async needs the GBA buffers (M=1) that "
     "--noasync_staleness_stats turns off: the bare optimizer cannot update hash rows; drop one "
     "of the two."),
    (dict(data="criteo:/nonexistent", data_options="ids=vocab"),
     "--data_options: 'ids' is set by --embedding (vocab: ids modulo vocab_size; hash: 64-bit "
     "fingerprints); drop it.")])
def test_hash_embedding_combinations_refused(tmp_path, kwargs, expected):
  with pytest.raises(ValueError) as e:
    _config(tmp_path, embedding="hash", steps=20, **kwargs).validate()
  assert str(e.value) == expected


@pytest.mark.parametrize("kwargs,expected", [
    (dict(hash_min_frequency=2),
     "--hash_min_frequency=2 applies to --embedding=hash only: drop it, or add --embedding=hash."),
    (dict(hash_max_rows=100),
     "--hash_max_rows=100 applies to --embedding=hash only: drop it, or add --embedding=hash."),
    (dict(embedding="hash", hash_ttl_steps=-1), "--hash_ttl_steps must be >= 0 (0: off), got -1."),
    (dict(embedding="hash", num_ps=3, hash_max_rows=2),
     "--hash_max_rows=2 is below --num_ps=3: each parameter server keeps hash_max_rows / num_ps "
     "rows; raise it."),
    (dict(embedding="hash", hash_admission_filter_cells=1000),
     "--hash_admission_filter_cells=1000 holds admission counts, but admission is off: add "
     "--hash_min_frequency=2 (or more), or drop --hash_admission_filter_cells.")])
def test_hash_admission_and_eviction_flags_refused(tmp_path, kwargs, expected):
  with pytest.raises(ValueError) as e:
    _config(tmp_path, steps=20, **kwargs).validate()
  assert str(e.value) == expected


def test_hash_options_are_the_layers_arguments(tmp_path):
  cfg = _config(tmp_path, embedding="hash", steps=20, hash_min_frequency=2, hash_ttl_steps=50,
                hash_max_rows=1000)
  cfg.validate()
  assert cfg.hash_options() == {"min_frequency": 2, "ttl_steps": 50, "max_rows": 1000,
                                "admission_filter_cells": 0}
  assert _config(tmp_path, steps=20).hash_options() is None


def test_hash_embedding_takes_an_export_dir(tmp_path):
  # Its serving SavedModel holds the table's rows in stock variables (docs/serving.md).
  _config(tmp_path, embedding="hash", steps=20, export_dir=str(tmp_path / "serving")).validate()


def test_hash_embedding_reads_criteo_as_fingerprints_and_vocab_as_before(tmp_path):
  assert _config(tmp_path, data="criteo:x", embedding="hash").data_kwargs() == {
      "ids": "fingerprint"}
  assert _config(tmp_path, data="criteo:x").data_kwargs() == {"ids": "vocab"}
  # MovieLens' and the synthetic source's ids are their own either way.
  assert _config(tmp_path, data="movielens100k:x", embedding="hash").data_kwargs() == {}
  with pytest.raises(ValueError, match="--embedding must be one of"):
    _config(tmp_path, embedding="table").validate()


def test_a_checkpoint_of_the_other_embedding_is_refused(tmp_path):
  cfg = _config(tmp_path, steps=20)
  preflight.write_metadata(cfg)
  with open(os.path.join(cfg.model_dir, "checkpoint"), "w") as f:
    f.write('model_checkpoint_path: "ckpt-20"\n')
  preflight.check_model_dir(cfg)  # the same embedding resumes
  with pytest.raises(preflight.InputError) as e:
    preflight.check_model_dir(_config(tmp_path, steps=20, embedding="hash"))
  assert str(e.value) == (
      f"--model_dir={cfg.model_dir}: this directory holds a checkpoint with --embedding=vocab "
      "(written in mode gba); --embedding=hash cannot resume from it: pass --embedding=vocab to "
      "resume, or another --model_dir to start afresh.")


def test_corrupt_records_in_model_dir_are_reported(tmp_path, capsys):
  cfg = _config(tmp_path, steps=20)
  os.makedirs(cfg.model_dir)
  with open(os.path.join(cfg.model_dir, recovery.PROGRESS_FILE), "w") as f:
    f.write('{"mode": "gba", "steps"')
  with open(os.path.join(cfg.model_dir, preflight.METADATA_FILE), "w") as f:
    f.write("[1, 2]")
  preflight.check(cfg)
  out = capsys.readouterr().out.splitlines()
  progress = os.path.join(cfg.model_dir, recovery.PROGRESS_FILE)
  meta = os.path.join(cfg.model_dir, preflight.METADATA_FILE)
  assert out == [
      f"tf_gba: warning: {meta} is unreadable (not a JSON object); the checkpoint restore "
      "checks the model itself, and the file is written again.",
      f"tf_gba: warning: {progress} is unreadable (Expecting ':' delimiter: line 1 column 24 "
      "(char 23)); whether the last run finished is unknown: this run starts from the newest "
      "checkpoint and trains --steps more (not toward the last run's target)."]
  # The run goes on as a new one: begin() writes a readable record again.
  assert recovery.begin(cfg.model_dir, "gba", 20, 0, target_if_new=10).target_global_step == 10
  assert recovery.read(cfg.model_dir)["target_global_step"] == 10


# ---- TF_CONFIG -----------------------------------------------------------------------------------
_CLUSTER = {"chief": ["h:1"], "ps": ["h:2"], "worker": ["h:3", "h:4"]}


@pytest.mark.parametrize("text,expected", [
    ("{not json", "TF_CONFIG is not valid JSON (Expecting property name enclosed in double "
                  "quotes: line 1 column 2 (char 1)); expected {\"cluster\": {...}, \"task\": "
                  "{\"type\": ..., \"index\": ...}}."),
    ("[]", "TF_CONFIG must be a JSON object with \"cluster\" and \"task\", got list."),
    (json.dumps({"task": {"type": "chief"}}),
     "TF_CONFIG \"cluster\" is missing or empty: give an object mapping each job (chief, ps, "
     "worker) to its list of \"host:port\"."),
    (json.dumps({"cluster": _CLUSTER}),
     "TF_CONFIG \"task\" is missing: give this process's {\"type\": \"chief\"|\"ps\"|\"worker\", "
     "\"index\": N}."),
    (json.dumps({"cluster": _CLUSTER, "task": {"type": "worker", "index": 5}}),
     "TF_CONFIG task.index is 5, but cluster.worker lists 2 task(s) (indices 0 to 1)."),
    (json.dumps({"cluster": _CLUSTER, "task": {"type": "evaluator", "index": 0}}),
     "TF_CONFIG task.type must be one of chief, ps, worker, got 'evaluator'."),
    (json.dumps({"cluster": {"ps": ["h:2"], "worker": ["h:3"]},
                 "task": {"type": "chief", "index": 0}}),
     "TF_CONFIG task.type is 'chief', a job that cluster does not list (it lists ps, worker)."),
    (json.dumps({"cluster": dict(_CLUSTER, ps=["h"]), "task": {"type": "ps", "index": 0}}),
     "TF_CONFIG cluster.ps[0] must be \"host:port\" with a port in 1-65535, got 'h'."),
    (json.dumps({"cluster": dict(_CLUSTER, ps=["h:3"]), "task": {"type": "ps", "index": 0}}),
     "TF_CONFIG cluster.worker[0] is h:3, the address of ps[0] too: give each task its own "
     "port."),
    (json.dumps({"cluster": dict(_CLUSTER, worker=[]), "task": {"type": "ps", "index": 0}}),
     "TF_CONFIG cluster.worker must be a non-empty list of \"host:port\", got []."),
    (json.dumps({"cluster": _CLUSTER, "task": {"type": "ps", "index": -1}}),
     "TF_CONFIG task.index must be an integer >= 0, got -1."),
])
def test_malformed_tf_config_names_the_field(text, expected):
  with pytest.raises(tf_config.TFConfigError) as e:
    tf_config.parse(text)
  assert str(e.value) == expected


def test_tf_config_parsed():
  cfg = tf_config.parse(json.dumps({"cluster": _CLUSTER, "task": {"type": "worker",
                                                                  "index": "1"}}))
  assert (cfg.task_type, cfg.task_index, cfg.count("worker"), cfg.count("ps")) == (
      "worker", 1, 2, 1)
  assert cfg.addresses(("ps", "worker")) == [("ps:0", "h:2"), ("worker:0", "h:3"),
                                             ("worker:1", "h:4")]


@pytest.mark.parametrize("kwargs,expected", [
    ({"num_workers": 4}, "--num_workers=4 contradicts TF_CONFIG, whose cluster.worker lists 2: "
                         "drop --num_workers (TF_CONFIG sets it)."),
    ({"num_ps": 3}, "--num_ps=3 contradicts TF_CONFIG, whose cluster.ps lists 1: drop --num_ps "
                    "(TF_CONFIG sets it)."),
    ({"mode": "sync"}, "--mode=sync starts its own worker processes on this machine and cannot "
                       "run under TF_CONFIG: unset TF_CONFIG to train locally, or pick a "
                       "parameter-server mode."),
    ({"input": "shared"}, "--input=shared on a real cluster needs --tfdata_dispatcher=HOST:PORT"),
])
def test_tf_config_inconsistent_with_the_flags(tmp_path, monkeypatch, kwargs, expected):
  monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": _CLUSTER,
                                              "task": {"type": "chief", "index": 0}}))
  kwargs = dict({"num_workers": 2, "num_ps": 1, "input": "sharded", "steps": 20}, **kwargs)
  with pytest.raises(preflight.InputError) as e:
    preflight.check(_config(tmp_path, **kwargs))
  assert str(e.value).startswith(expected)
  monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": _CLUSTER}))
  with pytest.raises(preflight.InputError, match="TF_CONFIG \"task\" is missing"):
    preflight.check(_config(tmp_path, **kwargs))


def test_the_chief_names_the_servers_it_waits_for_and_gives_up(monkeypatch):
  monkeypatch.setattr(tf_config, "WAIT_LINE_EVERY_S", 0.5)
  up = socket.socket()
  up.bind(("127.0.0.1", 0))
  up.listen()
  down = socket.socket()
  down.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
  up_address = f"127.0.0.1:{up.getsockname()[1]}"
  down_address = f"127.0.0.1:{down.getsockname()[1]}"
  lines = []
  try:
    assert tf_config.wait_for_servers([("ps:0", up_address)], 5.0, lines.append) < 5.0
    assert lines == []
    start = time.monotonic()
    with pytest.raises(tf_config.ServersUnreachable) as e:
      tf_config.wait_for_servers([("ps:0", up_address), ("worker:1", down_address)], 2.0,
                                 lines.append)
    assert 2.0 <= time.monotonic() - start < 6.0
  finally:
    up.close()
    down.close()
  assert str(e.value) == (f"gave up after 2 s (--cluster_wait_s) waiting for worker:1 at "
                          f"{down_address}: start those tasks (or fix their addresses in "
                          "TF_CONFIG), then rerun.")
  assert len(lines) >= 2
  for line in lines:
    assert line.startswith(f"tf_gba: waiting for worker:1 at {down_address} (")
    assert line.endswith(" s of --cluster_wait_s=2)")


# ---- constructors --------------------------------------------------------------------------------
@pytest.mark.parametrize("make,error,expected", [
    (lambda: AdaptiveRevision(alpha=-1), ValueError,
     "AdaptiveRevision: alpha (the learning-rate scale) must be > 0, got -1."),
    (lambda: AdaptiveRevision(alpha=math.inf), ValueError,
     "AdaptiveRevision: alpha (the learning-rate scale) must be a finite number, got inf."),
    (lambda: AdaptiveRevision(alpha="fast"), TypeError,
     "AdaptiveRevision: alpha (the learning-rate scale) must be a number, got str 'fast'."),
    (lambda: AdaptiveRevision(g0=0), ValueError,
     "AdaptiveRevision: g0 (the initial accumulator G0) must be > 0, got 0."),
    (lambda: GBAStrategy(None), TypeError,
     "GBAStrategy needs a cluster resolver (e.g. LocalCluster(...).resolver() or "
     "tf.distribute.cluster_resolver.TFConfigClusterResolver()), got NoneType None."),
    (lambda: GBA(keras.optimizers.Adam(), staleness_threshold=None), TypeError,
     "GBA: staleness_threshold must be an integer, got NoneType None."),
    (lambda: GBA(keras.optimizers.Adam(), staleness_threshold=-2), ValueError,
     "GBA: staleness_threshold must be >= 0, got -2."),
    (lambda: GBA(keras.optimizers.Adam(), decay_alpha=math.nan), ValueError,
     "GBA: decay_alpha must be a finite number, got nan."),
    (lambda: DTS(keras.optimizers.SGD(), delay=None), TypeError,
     "DTS: delay (1 = synchronous) must be an integer, got NoneType None."),
    (lambda: DTS(keras.optimizers.SGD(), period=0), ValueError,
     "DTS: period (1 = every step) must be >= 1, got 0."),
])
def test_constructors_refuse_bad_arguments_in_one_line(make, error, expected):
  with pytest.raises(error) as e:
    make()
  assert type(e.value) is error and str(e.value) == expected


def test_gba_strategy_refuses_a_straggler_worker_it_does_not_have():
  resolver = _FakeResolver({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]})
  with pytest.raises(ValueError) as e:
    GBAStrategy(resolver, stragglers="persistent:3@2")
  assert str(e.value) == ("GBAStrategy: stragglers='persistent:3@2' names worker(s) [2], which "
                          "the cluster does not have (workers 0 to 1).")


class _FakeResolver:
  """Only the cluster spec, which GBAStrategy checks before it connects to anything."""

  def __init__(self, spec):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    self._spec = tf.train.ClusterSpec(spec)

  def cluster_spec(self):
    return self._spec


# ---- signals -------------------------------------------------------------------------------------
def test_interrupt_request_and_message():
  interrupt.reset()
  try:
    assert interrupt.requested() is None
    seen = []
    interrupt.on_request(lambda: seen.append(interrupt.requested()))
    interrupt.request(15)
    assert interrupt.requested() == 15 and seen == [15]
    e = interrupt.Interrupted(15, "/m/ckpt-40", 40)
    assert e.exit_code == 143 and interrupt.exit_code(2) == 130
    assert str(e) == ("stopped by SIGTERM at global step 40: checkpoint /m/ckpt-40 written; rerun "
                      "the same command to resume from it.")
  finally:
    interrupt._on_request.clear()  # pylint: disable=protected-access
    interrupt.reset()


_TWO_SIGNALS = """
import os, signal, sys, time
from tf_gba.common import interrupt
interrupt.install(on_abort=lambda: open(sys.argv[1], "w").write("aborted"))
os.kill(os.getpid(), signal.{first})
print("asked", interrupt.requested(), flush=True)  # the first only asks: the loop goes on
os.kill(os.getpid(), signal.{second})
time.sleep(30)
print("not reached", flush=True)
"""


@pytest.mark.parametrize("first,second,code", [("SIGTERM", "SIGTERM", 143),
                                               ("SIGTERM", "SIGINT", 130)])
def test_a_second_signal_ends_the_process_at_once(tmp_path, first, second, code):
  """The first signal is a request the training loop reads at its next stop point; a second ends
  the process at once, with the exit code of the signal that ended it, after the abort callbacks
  (the binary removes its temporary files there)."""
  marker = tmp_path / "aborted"
  began = time.monotonic()
  proc = subprocess.run([sys.executable, "-c", _TWO_SIGNALS.format(first=first, second=second),
                         str(marker)], capture_output=True, text=True, timeout=25,
                        env=dict(os.environ, PYTHONPATH=_ROOT))
  assert proc.returncode == code, proc.stderr
  assert proc.stdout == f"asked {getattr(signal, first).value}\n" and proc.stderr == ""
  assert marker.read_text() == "aborted"
  assert time.monotonic() - began < 20  # not the 30 s sleep
