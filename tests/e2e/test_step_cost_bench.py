"""benchmarks.step_cost's measurement: CPU by process role from /proc, per worker step.

Real processes, no cluster: a parent that forks a child named as a parameter server ("ps:0") and
one named as a worker, each burning a known share of CPU; the sampler must attribute each
process's CPU to its role and lose none of it. The benchmark's own runs are long (minutes); its
commands are dry-run by test_documented_commands.py.
"""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks import process_cpu
from benchmarks import step_cost

# A parent that burns ~0.3 s of CPU, and forks two children that name themselves (as the local
# cluster's servers do, /proc/self/comm) and burn ~0.6 s and ~0.9 s, then all exit.
_TREE = r"""
import os, sys, time
def burn(seconds):
  end = time.process_time() + seconds
  while time.process_time() < end:
    pass
pids = []
for name, seconds in (("ps:0", 0.6), ("worker:1", 0.9)):
  pid = os.fork()
  if pid == 0:
    with open("/proc/self/comm", "w") as f:
      f.write(name)
    burn(seconds)
    time.sleep(0.3)  # read once more after the burn: the sampler keeps a process's last reading
    os._exit(0)
  pids.append(pid)
burn(0.3)
for pid in pids:
  os.waitpid(pid, 0)
"""


def test_cpu_is_attributed_to_each_processes_role():
  proc = subprocess.Popen([sys.executable, "-c", _TREE])
  with process_cpu.ProcessTreeCpu(proc.pid, interval=0.05) as cpu:
    assert proc.wait(timeout=60) == 0
  roles = cpu.by_role()
  # Each role's CPU within 0.15 s of what it burned (the interpreter's start adds to the root).
  assert 0.55 <= roles["ps"] <= 0.75, roles
  assert 0.85 <= roles["worker"] <= 1.05, roles
  assert 0.3 <= roles["coordinator"] <= 0.8, roles
  assert set(roles) == {"coordinator", "ps", "worker"}, cpu.by_process()


def test_roles_follow_the_cluster_names():
  assert process_cpu.role_of("train.py", "train.py") == "coordinator"
  assert process_cpu.role_of("ps:3", "train.py") == "ps"
  assert process_cpu.role_of("tfdata_worker:0", "train.py") == "tfdata_worker"
  # "tfdata_dispatcher:0" as /proc/<pid>/comm holds it (15 bytes).
  assert process_cpu.role_of("tfdata_dispatch", "train.py") == "tfdata_dispatcher"
  assert process_cpu.role_of("server_forker", "train.py") == "other"


def test_per_step_is_the_windows_cpu_over_its_steps():
  cost = {"coordinator": 0.5, "ps": 2.0, "worker": 6.0, "tfdata_worker": 0.25,
          "tfdata_dispatcher": 0.125, "window_steps": 250, "window_seconds": 10.0}
  per = step_cost.per_step(cost)
  want = np.array([0.5, 2.0, 6.0, 0.25, 0.125, 0.0]) * 1000 / 250
  np.testing.assert_allclose([per[r] for r in step_cost.ROLES], want)
  assert per["job"] == pytest.approx(want.sum())


def test_a_run_too_short_for_a_window_is_refused_in_one_line(capsys):
  with pytest.raises(SystemExit) as e:
    step_cost.main(["--steps=300", "--log_every=100", "--dry_run"])
  assert e.value.code == 2
  assert "--steps=300 leaves too few progress lines" in capsys.readouterr().err


def test_the_user_script_trains_its_epochs_under_the_strategys_defaults(tmp_path):
  # benchmarks/user_fit_job.py, as `--modes=user_fit` runs it (by path, this checkout's tf_gba),
  # kept short: 2 epochs of 40 steps on 2 workers, i.e. functions of 20 steps (the default).
  out = subprocess.run(
      [sys.executable, os.path.join(step_cost.ROOT, "benchmarks", "user_fit_job.py"),
       "--steps=80", "--log_every=40", "--num_workers=2", "--local_batch_size=64"],
      cwd=tmp_path, env=step_cost._tree_env(step_cost.ROOT),  # pylint: disable=protected-access
      capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  assert out.stdout.splitlines() == ["step 40/80", "step 80/80"], out.stdout
