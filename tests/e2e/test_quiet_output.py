"""Quiet by default: the binary's stderr holds only real errors, pytest's output no gRPC noise."""

import glob
import os
import subprocess
import sys
import textwrap

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SMALL = ["--mode=gba", "--num_ps=1", "--num_workers=2", "--steps=40", "--log_every=20",
          "--local_batch_size=64", "--eval_examples=512", "--stragglers=transient:0.2:4",
          "--data_options=num_examples=20000"]


def _env():
  env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # as in a user's shell (the tests' conftest sets it)
  return env


def _train(*args, **env):
  return subprocess.run([sys.executable, os.path.join(_ROOT, "examples", "train.py"), *_SMALL,
                         *args], capture_output=True, text=True, timeout=400,
                        env=dict(_env(), **env), cwd=_ROOT, check=False)


def _logs_line(stdout):
  line = next(l for l in stdout.splitlines() if l.strip().startswith("logs "))
  return line.split()[1]


@pytest.mark.parametrize("mode", ["gba", "sync", "shadow_easgd"])
def test_a_run_writes_nothing_on_stderr_and_leaves_nothing_in_tmp(tmp_path, mode):
  # Every process of the job (the binary, its servers, sync's collective workers) inherits TMPDIR.
  tmp = tmp_path / "tmp"
  tmp.mkdir()
  proc = _train(f"--model_dir={tmp_path / 'm'}", f"--mode={mode}", TMPDIR=str(tmp))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stderr == ""
  assert "global step" in proc.stdout and "eval AUC" in proc.stdout
  if mode != "sync":  # the summary names the logs of a parameter-server job (sync removes its own)
    log_dir = _logs_line(proc.stdout)
    assert log_dir.startswith(str(tmp))
    assert "deleted at exit" in proc.stdout and not os.path.exists(log_dir)
  # AutoGraph's sources of the traced functions are removed from an atexit handler, which the
  # binary's os._exit skips: without tf_gba.common.exiting about 20 files a run stay here.
  assert sorted(os.listdir(tmp)) == []


def test_keep_logs_keeps_every_process_log(tmp_path):
  proc = _train(f"--model_dir={tmp_path / 'm'}", "--keep_logs")
  assert proc.returncode == 0, proc.stderr[-3000:]
  log_dir = _logs_line(proc.stdout)
  assert log_dir == str(tmp_path / "m" / "logs")
  names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(log_dir, "*.log")))
  # server_forker.log: the process the servers are forked from (tf_gba.distribute.server_forker).
  assert names == ["coordinator.log", "ps_0.log", "server_forker.log", "tfdata_dispatcher_0.log",
                   "tfdata_worker_0.log", "tfdata_worker_1.log", "worker_0.log", "worker_1.log"]
  with open(os.path.join(log_dir, "ps_0.log")) as f:
    assert "TF_GBA_SERVER_READY ps:0" in f.read()
  # What TF's runtime wrote on stderr is in the coordinator's log, not on the terminal.
  assert proc.stderr.strip() == f"train.py: logs kept in {log_dir}"


def test_verbosity_brings_tensorflow_logs_back(tmp_path):
  proc = _train(f"--model_dir={tmp_path / 'm'}", "--verbosity=debug")
  assert proc.returncode == 0, proc.stderr[-3000:]
  # TF's own C++ lines (I/W/E with a timestamp) are on the terminal again.
  assert any(l[:1] in "IWE" and l[1:5].isdigit() for l in proc.stderr.splitlines()), proc.stderr


_TEARDOWN = textwrap.dedent("""
    import os
    from tf_gba.training import TrainConfig, run

    def test_a_small_run():
      run(TrainConfig(num_workers=2, steps=20, log_every=10, local_batch_size=64,
                      eval_examples=512, stragglers="none", data_options="num_examples=20000",
                      model_dir=os.environ["MODEL_DIR"]))

    if __name__ == "__main__":
      test_a_small_run()
""")


def test_pytest_output_has_no_connection_refused(tmp_path):
  script = tmp_path / "test_teardown_noise.py"
  script.write_text(_TEARDOWN)
  env = dict(_env(), MODEL_DIR=str(tmp_path / "m"))
  # A plain run of the same code (no conftest hook) is quiet as well: the cluster's servers stay
  # until the process has released its remote functions (tf_gba.distribute.local_cluster).
  plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, env=env, cwd=_ROOT, check=False)
  assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
  assert "Connection refused" not in plain.stdout + plain.stderr
  env["MODEL_DIR"] = str(tmp_path / "m2")
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest",
                         "-p", "no:cacheprovider", str(script)], capture_output=True, text=True,
                        timeout=300, env=env, cwd=_ROOT, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "1 passed" in proc.stdout
  assert "Connection refused" not in proc.stdout + proc.stderr
