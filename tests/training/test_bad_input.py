"""Bad input to the training binary: one line on stderr that says what to fix, exit code 2.

The binary runs as a subprocess, as a user runs it (forked: tests/script_process.py); the faults
are found before any server starts (except the checkpoint faults, which need a run to write
checkpoints first).
"""

import glob
import gzip
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests import script_process
from tests import shared_data

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SMALL = ["--num_workers=1", "--num_ps=1", "--steps=20", "--log_every=10",
          "--local_batch_size=64", "--eval_examples=512", "--stragglers=none", "--export_dir="]


def _train(*args, timeout=300, prefix=(), env=None):
  """The binary with _SMALL's flags and `args`, forked as tests/script_process.py runs it; with a
  command `prefix`, a new interpreter under it."""
  env = dict(os.environ, **(env or {}))
  if not prefix:
    return script_process.run([*_SMALL, *args], env=env, timeout=timeout)
  env["PYTHONPATH"] = _ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
  return subprocess.run([*prefix, sys.executable, os.path.join(_ROOT, "examples", "train.py"),
                         *_SMALL, *args], capture_output=True, text=True, timeout=timeout,
                        env=env, cwd=_ROOT, check=False)


def _without_file_override():
  """A command prefix under which root, too, obeys file permissions: root reads any file through
  the capabilities CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, which `setpriv` drops."""
  if not (hasattr(os, "geteuid") and os.geteuid() == 0):
    return ()
  setpriv = shutil.which("setpriv")
  if setpriv is None:
    pytest.skip("running as root without setpriv (util-linux): root reads any file, so a file "
                "cannot be made unreadable to the binary")
  return (setpriv, "--bounding-set=-dac_override,-dac_read_search")


def _error_line(proc) -> str:
  """The one line the binary printed for the user; fails if there is more (or a traceback)."""
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr[-3000:]
  assert lines[0].startswith("train.py: error: "), lines
  return lines[0]


def _criteo_rows(n):
  path = os.path.join(shared_data.require("criteo_sample"), "train_8k.tsv.gz")
  with gzip.open(path, "rt") as f:
    return [next(f).rstrip("\n") for _ in range(n)]


def test_a_forked_run_says_what_a_new_interpreter_says(tmp_path):
  """The tests' forked binary (tests/script_process.py) against `python examples/train.py` as a
  user starts it: the same exit code, stdout and stderr, for a flag the job refuses (a
  parameter-server mode: the supervisor starts the job, forked or as a new interpreter)."""
  args = [*_SMALL, "--steps=0", f"--model_dir={tmp_path / 'm'}"]
  forked = script_process.run(args)
  new = subprocess.run([sys.executable, os.path.join(_ROOT, "examples", "train.py"), *args],
                       capture_output=True, text=True, timeout=300, cwd=_ROOT, check=False,
                       env=dict(os.environ, PYTHONPATH=_ROOT + os.pathsep +
                                os.environ.get("PYTHONPATH", "")))
  assert forked.returncode == new.returncode == 2, (forked, new)
  assert (forked.stdout, forked.stderr) == (new.stdout, new.stderr)
  assert new.stderr == "train.py: error: --steps must be >= 1, got 0.\n"


@pytest.mark.parametrize("flags,expected", [
    (["--global_batch_size=-256"], "--global_batch_size must be >= 1"),
    (["--global_batch_size=0"], "--global_batch_size must be >= 1"),
    (["--global_batch_size=100"], "is not a multiple of --local_batch_size=64"),
    (["--eval_examples=-5"], "--eval_examples must be >= 1, got -5"),
    (["--eval_examples=0"], "--eval_examples must be >= 1, got 0"),
    (["--steps=0"], "--steps must be >= 1"),
    (["--num_workers=0"], "--num_workers must be >= 1"),
    (["--local_batch_size=-1"], "--local_batch_size must be >= 1"),
    (["--learning_rate=0"], "--learning_rate must be > 0"),
    (["--day=-1"], "--day must be >= 0"),
    (["--eval_every=-1"], "--eval_every must be >= 0"),
    (["--stragglers=sometimes"], "straggler"),
    (["--data_options=vocab"], "--data_options: expected key=value"),
    (["--data=criteo:/nonexistent/train.txt"], "nothing at '/nonexistent/train.txt'"),
    (["--data=movielens100k:/nonexistent"], "nothing at '/nonexistent'"),
    (["--data=parquet:/x"], "Unknown data spec 'parquet:/x'"),
    (["--mode=auto", "--auto_margin=0"], "--auto_margin must be > 0"),
    (["--mode=auto", "--auto_dwell_s=-1"], "--auto_dwell_s must be >= 0"),
    (["--mode=auto", "--auto_gba_efficiency=0"],
     "--auto_gba_efficiency (measured QPS / model QPS before a mode's first stay) must be in "
     "(0, 10]"),
    (["--mode=auto", "--auto_switch_cost_s=-5"], "--auto_switch_cost_s must be >= 0"),
    (["--mode=auto", "--auto_horizon_s=0"], "--auto_horizon_s must be > 0"),
    (["--mode=auto", "--auto_probe_s=-1"], "--auto_probe_s must be >= 0"),
    (["--mode=auto", "--auto_measure_s=-1"], "--auto_measure_s must be >= 0"),
    (["--mode=auto", "--auto_probe_s=5", "--noauto_learn_efficiency"],
     "--auto_probe_s measures each mode's efficiency at the start; with "
     "--noauto_learn_efficiency"),
    (["--mode=sync", "--auto_probe_s=5"], "--auto_probe_s"),
    (["--mode=auto", "--global_batch_size=128"],
     "--mode=auto does not use --global_batch_size (used by sync, gba); drop it"),
    # inf passes "> 0" and would train NaNs, exit 0.
    (["--learning_rate=inf"], "train.py: error: --learning_rate must be a finite number, got "
                              "inf."),
    (["--learning_rate=nan"], "--learning_rate must be a finite number, got nan."),
    (["--stragglers=persistent:3@9"],
     "train.py: error: --stragglers=persistent:3@9 names worker 9, which does not exist: the "
     "workers are 0 to 0 (--num_workers=1)."),
    # Checked against the data before the servers start (a traceback after training before).
    (["--day=99"], "train.py: error: --day=99: --data=synthetic holds 1 day(s), 0 to 0 (more "
                   "with --data_options=num_days=N)."),
    (["--eval_day=5"], "train.py: error: --eval_day=5: --data=synthetic holds 1 day(s), 0 to 0"),
    # absl's own parsing errors: exit 2 like every other bad input (1 before).
    (["--no_such_flag=1"], "train.py: error: Unknown command line flag 'no_such_flag' (python "
                           "examples/train.py --help lists the flags)"),
    (["--steps=many"], "train.py: error: flag --steps=many: invalid literal for int()"),
    # Words that are not flags were ignored (a boolean flag's value split from it: --nox 1).
    (["--mode=async", "stray", "words"], "train.py: error: unexpected argument(s) 'stray "
                                         "words': every option is a --flag=value"),
])
def test_flags_out_of_range(tmp_path, flags, expected):
  line = _error_line(_train(*flags, f"--model_dir={tmp_path / 'm'}"))
  assert expected in line
  assert not (tmp_path / "m").exists()  # refused before anything was written


_TF_CLUSTER = {"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"],
               "worker": ["127.0.0.1:3", "127.0.0.1:4"]}


@pytest.mark.parametrize("tf_config,flags,expected", [
    ("{not json", [], "train.py: error: TF_CONFIG is not valid JSON (Expecting property name "
                      "enclosed in double quotes: line 1 column 2 (char 1))"),
    (json.dumps({"cluster": _TF_CLUSTER, "task": {"type": "worker", "index": 5}}), [],
     "train.py: error: TF_CONFIG task.index is 5, but cluster.worker lists 2 task(s) (indices 0 "
     "to 1)."),
    (json.dumps({"cluster": _TF_CLUSTER}), [],
     "train.py: error: TF_CONFIG \"task\" is missing"),
    (json.dumps({"cluster": _TF_CLUSTER, "task": {"type": "chief", "index": 0}}),
     ["--num_workers=4"], "train.py: error: --num_workers=4 contradicts TF_CONFIG, whose "
                          "cluster.worker lists 2: drop --num_workers (TF_CONFIG sets it)."),
])
def test_bad_tf_config(tmp_path, tf_config, flags, expected):
  # (_SMALL's --num_workers=1 is not passed here: under TF_CONFIG the cluster sets it.)
  proc = script_process.run(["--steps=20", f"--model_dir={tmp_path / 'm'}", *flags],
                            env=dict(os.environ, TF_CONFIG=tf_config))
  assert _error_line(proc).startswith(expected)
  assert not (tmp_path / "m").exists()


def test_chief_says_whom_it_waits_for_and_gives_up(tmp_path):
  """A chief started before its servers: a line naming them every few seconds, then one error
  line after --cluster_wait_s, exit 1 (it waited in silence before)."""
  ports = []
  for _ in range(3):
    with socket.socket() as s:  # a port nobody listens on (closed again at once)
      s.bind(("127.0.0.1", 0))
      ports.append(s.getsockname()[1])
  cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{ports[1]}"],
             "worker": [f"127.0.0.1:{ports[2]}"]}
  proc = script_process.run(
      ["--steps=20", "--input=sharded", "--cluster_wait_s=6", f"--model_dir={tmp_path / 'm'}"],
      env=dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster,
                                                 "task": {"type": "chief", "index": 0}})))
  assert proc.returncode == 1, proc.stderr[-3000:]
  waiting = f"ps:0 at 127.0.0.1:{ports[1]}, worker:0 at 127.0.0.1:{ports[2]}"
  assert f"tf_gba: waiting for {waiting} (5 s of --cluster_wait_s=6)" in proc.stdout
  assert proc.stderr.strip().splitlines() == [
      f"train.py: error: gave up after 6 s (--cluster_wait_s) waiting for {waiting}: start those "
      "tasks (or fix their addresses in TF_CONFIG), then rerun."]


def test_steps_are_trained_exactly_or_the_rounding_is_said(tmp_path):
  short = _train("--steps=5", "--log_every=10", f"--model_dir={tmp_path / 'a'}")
  assert short.returncode == 0, short.stderr[-3000:]
  summary = _summary(str(tmp_path / "a"))
  # One worker, M = 1: 5 worker steps are 5 global steps (20 worker steps, "step 18/1", before).
  assert (summary["steps"], summary["global_step"]) == (5, 5)
  assert "--steps=5 trains" not in short.stdout
  rounded = _train("--steps=30", "--log_every=20", f"--model_dir={tmp_path / 'b'}")
  assert rounded.returncode == 0, rounded.stderr[-3000:]
  assert ("tf_gba: --steps=30 trains 40 worker steps: the parameter-server modes train whole "
          "intervals of 20 worker steps (--log_every=20); pass a multiple of 20 to train exactly "
          "that.") in rounded.stdout.splitlines()
  assert _summary(str(tmp_path / "b"))["steps"] == 40


def test_a_failure_after_training_keeps_the_trained_model(tmp_path):
  """The final evaluation fails (its snapshot directory cannot be made: a file is in the way, as
  a full disk fails it): the final checkpoint is already written; one line, exit 1."""
  model_dir = tmp_path / "m"
  model_dir.mkdir()
  (model_dir / "eval_snapshot").write_text("in the way")
  proc = _train(f"--model_dir={model_dir}")
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr
  assert lines[0].startswith(f"train.py: error: training finished and its checkpoint "
                             f"{model_dir / 'ckpt-20'} was written, but the final evaluation "
                             "failed: "), lines
  assert glob.glob(str(model_dir / "ckpt-20.index"))
  progress = json.loads((model_dir / "tf_gba_progress.json").read_text())
  assert progress["finished"] and progress["global_step"] == 20
  # Fixed, the rerun starts from that checkpoint (a finished run: --steps more after it).
  (model_dir / "eval_snapshot").unlink()
  rerun = _train(f"--model_dir={model_dir}")
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert _summary(model_dir)["start_global_step"] == 20


def test_empty_file(tmp_path):
  (tmp_path / "empty.tsv").write_text("")
  line = _error_line(_train(f"--data=criteo:{tmp_path / 'empty.tsv'}",
                            f"--model_dir={tmp_path / 'm'}"))
  assert "holds no rows" in line


def test_mostly_malformed_file(tmp_path):
  rows = _criteo_rows(600)
  # Two rows in three cut to 20 characters: 400 malformed rows out of 600.
  cut = [r if i % 3 == 2 else r[:20] for i, r in enumerate(rows)]
  (tmp_path / "cut.tsv").write_text("\n".join(cut) + "\n")
  line = _error_line(_train(f"--data=criteo:{tmp_path / 'cut.tsv'}",
                            f"--model_dir={tmp_path / 'm'}"))
  assert "400 of the 600 rows checked are malformed" in line
  fields = len(cut[0].split("\t"))
  assert f"{tmp_path / 'cut.tsv'}:1: has {fields} tab-separated fields, expected 40" in line


def test_strict_data_fails_on_the_first_malformed_row(tmp_path):
  rows = _criteo_rows(300)
  rows[41] = rows[41][:20]  # line 42
  rows[99] = "x"
  (tmp_path / "one.tsv").write_text("\n".join(rows) + "\n")
  line = _error_line(_train(f"--data=criteo:{tmp_path / 'one.tsv'}", "--strict_data",
                            f"--model_dir={tmp_path / 'm'}"))
  assert f"--strict_data: Malformed Criteo row at {tmp_path / 'one.tsv'}:42:" in line


def test_corrupt_gzip(tmp_path):
  (tmp_path / "train.tsv.gz").write_bytes(b"not gzip at all\n" * 10)
  line = _error_line(_train(f"--data=criteo:{tmp_path / 'train.tsv.gz'}",
                            f"--model_dir={tmp_path / 'm'}"))
  assert "cannot read the files" in line and "incorrect header check" in line


def test_unreadable_file(tmp_path):
  path = tmp_path / "train.tsv"
  path.write_text("\n".join(_criteo_rows(10)) + "\n")
  path.chmod(0)
  line = _error_line(_train(f"--data=criteo:{path}", f"--model_dir={tmp_path / 'm'}",
                            prefix=_without_file_override()))
  assert "permission denied" in line


def test_model_dir_is_a_file(tmp_path):
  (tmp_path / "f").write_text("x")
  line = _error_line(_train(f"--model_dir={tmp_path / 'f'}"))
  assert "is a file; give a directory" in line


def test_debug_verbosity_shows_the_traceback(tmp_path):
  proc = _train("--eval_examples=0", "--verbosity=debug", f"--model_dir={tmp_path / 'm'}")
  assert proc.returncode != 0 and "Traceback" in proc.stderr
  assert "--eval_examples must be >= 1" in proc.stderr


def _summary(model_dir):
  with open(os.path.join(model_dir, "summary.json")) as f:
    return json.load(f)


def test_malformed_rows_counted_other_model_and_truncated_checkpoint(tmp_path):
  """One model_dir through a run's life: malformed rows counted, another model refused, the
  newest checkpoint cut short and passed over for the one before it."""
  rows = _criteo_rows(600)
  data = [r if i % 3 != 2 else r[:20] for i, r in enumerate(rows)]
  (tmp_path / "d.tsv").write_text("\n".join(data) + "\n")
  # Reference: a row is malformed when it has other than 40 tab-separated fields (the other
  # faults do not occur in the sample).
  expected_bad = sum(len(r.split("\t")) != 40 for r in data)
  assert expected_bad == 200
  model_dir = str(tmp_path / "m")
  common = [f"--data=criteo:{tmp_path / 'd.tsv'}", f"--model_dir={model_dir}"]

  first = _train(*common)
  assert first.returncode == 0, first.stderr[-3000:]
  assert _summary(model_dir)["malformed_rows"] == expected_bad
  assert _summary(model_dir)["data_rows_checked"] == 600
  # Said before training, naming the first malformed row's file and line (third line: 1-based).
  out = first.stdout.splitlines()
  warning = (f"tf_gba: warning: {expected_bad} of the 600 rows checked are malformed and "
             f"skipped; first: Malformed Criteo row at {tmp_path / 'd.tsv'}:3: has ")
  at = next(i for i, l in enumerate(out) if l.startswith(warning))
  assert at < next(i for i, l in enumerate(out) if l.startswith("summary ("))

  line = _error_line(_train(*common, "--model=dcn"))
  assert "this directory holds a deepfm checkpoint" in line and "--model=dcn" in line
  line = _error_line(_train(*common, "--embedding_dim=4"))
  assert "--embedding_dim=8" in line

  second = _train(*common)
  assert second.returncode == 0, second.stderr[-3000:]
  assert _summary(model_dir)["start_global_step"] == 20
  assert _summary(model_dir)["checkpoint"].endswith("ckpt-40")

  for data_file in glob.glob(os.path.join(model_dir, "ckpt-40.data-*")):
    size = os.path.getsize(data_file)
    with open(data_file, "r+b") as f:
      f.truncate(size // 2)
  third = _train(*common, "--mode=async")  # a mode switch stays allowed
  assert third.returncode == 0, third.stderr[-3000:]
  assert "ckpt-40 is unreadable" in third.stdout
  assert "resuming from" in third.stdout and "ckpt-20, the newest readable" in third.stdout
  summary = _summary(model_dir)
  assert summary["start_global_step"] == 20 and summary["mode"] == "async"
  assert summary["skipped_checkpoints"] == [os.path.join(model_dir, "ckpt-40")]
