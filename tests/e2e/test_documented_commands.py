"""Every command README.md and docs/*.md show for the binary and the benchmarks is accepted.

Each documented `examples/train.py ...` and `python -m benchmarks.<name> ...` line (see
tests/e2e/documented_commands.py for what counts as one) is dry-run as written (`--dry_run`
added): the binary checks its flags, configuration, data and model_dir and starts nothing, a
benchmark checks its flags (and the binary's command lines it would run). What a page cannot
know is replaced: the data a `criteo:` or `movielens100k:` spec names (small files written
here), a straggler trace file, and `--model_dir` / `--out` (fresh directories, so a reader's
runs/ does not change the outcome). All commands run in one process
(tests/e2e/documented_commands_check.py): one TensorFlow start for all of them.
"""

import gzip
import json
import os
import re
import sys
import textwrap

import numpy as np
import pytest

from tests import script_process
from tests.e2e import documented_commands

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CHECK = os.path.join(_ROOT, "tests", "e2e", "documented_commands_check.py")
# Benchmarks the pages show (at least these); the binary's command lines at least this many.
_DOCUMENTED_BENCHMARKS = {"benchmarks.switching", "benchmarks.mode_qps", "benchmarks.simulate",
                          "benchmarks.auto_mode", "benchmarks.buffer_bandwidth",
                          "benchmarks.dts_latency", "benchmarks.adaptive_revision_delay",
                          "benchmarks.asgd_discrepancy", "benchmarks.shadow_overlap"}
_MIN_TRAIN_COMMANDS = 15


# ---- the extraction itself -----------------------------------------------------------------------
def test_extraction_reads_shell_as_bash_would(tmp_path):
  (tmp_path / "docs").mkdir()
  (tmp_path / "README.md").write_text(textwrap.dedent("""\
      # x

      ```
      .venv/bin/python examples/train.py --mode=async \\
          --steps=10 &   # a comment
      make test
      ```

      ```python
      os.system("python examples/train.py --mode=nope")
      ```

      Prose: `examples/train.py` is the binary; `python -m benchmarks.simulate
      --num_workers=4,8` runs the simulator.
      """))
  (tmp_path / "docs" / "a.md").write_text(textwrap.dedent("""\
      Indented:

          B="python -m benchmarks.switching --days=3"
          $B --seeds=2   # 2 min
          CLUSTER='{"ps": ["a:1"]}'
          TF_CONFIG="{\\"cluster\\": $CLUSTER}" examples/train.py --steps=5
      """))
  got = [(c.where, c.program, c.args, c.env) for c in documented_commands.extract(str(tmp_path))]
  assert got == [
      ("README.md:4", "examples/train.py", ["--mode=async", "--steps=10"], {}),
      ("README.md:13", "benchmarks.simulate", ["--num_workers=4,8"], {}),
      ("docs/a.md:4", "benchmarks.switching", ["--days=3", "--seeds=2"], {}),
      ("docs/a.md:6", "examples/train.py", ["--steps=5"],
       {"TF_CONFIG": '{"cluster": {"ps": ["a:1"]}}'}),
  ]


# ---- what the pages cannot know ------------------------------------------------------------------
# Rows of the Criteo file: the switching benchmark refuses a day of fewer than 4 global steps
# (benchmarks/switching.py MIN_GLOBAL_STEPS), and the pages run it on Criteo at 4 workers x 256 in
# 4 days: 4 x 1,024 train rows a day at least, 9 of every 10 rows train rows.
_CRITEO_ROWS = 20_000


def _criteo(directory) -> str:
  """A Criteo TSV: label, 13 integer and 26 hashed categorical columns, some values missing."""
  rng = np.random.default_rng(0)
  directory.mkdir()
  ints = rng.integers(0, 200, (_CRITEO_ROWS, 13)).astype(str).astype(object)
  ints[rng.random(ints.shape) < 0.1] = ""
  cats = np.char.zfill(np.char.mod("%x", rng.integers(0, 1 << 31, (_CRITEO_ROWS, 26))),
                       8).astype(object)
  cats[rng.random(cats.shape) < 0.1] = ""
  labels = (rng.random(_CRITEO_ROWS) < 0.25).astype(int).astype(str)
  with gzip.open(directory / "day_0.tsv.gz", "wt") as f:
    f.writelines("\t".join([label, *i, *c]) + "\n" for label, i, c in zip(labels, ints, cats))
  return str(directory)


def _movielens(directory) -> str:
  """GroupLens ml-100k's three files: 60 users, 40 items, 100,000 ratings in time order (as many
  as the real data set's: the benchmarks refuse days too short for their workers)."""
  rng = np.random.default_rng(1)
  directory.mkdir()
  (directory / "u.user").write_text("".join(
      f"{u}|{20 + u % 40}|{'MF'[u % 2]}|writer|{10000 + u}\n" for u in range(1, 61)))
  (directory / "u.item").write_text("".join(
      f"{i}|Film {i} (1995)|01-Jan-1995||http://x|" +
      "|".join("1" if g == i % 19 else "0" for g in range(19)) + "\n" for i in range(1, 41)))
  n = 100_000
  users, items, ratings = rng.integers(1, 61, n), rng.integers(1, 41, n), rng.integers(1, 6, n)
  (directory / "u.data").write_text("".join(
      f"{u}\t{i}\t{r}\t{874000000 + t}\n"
      for t, (u, i, r) in enumerate(zip(users, items, ratings))))
  return str(directory)


def _localized(command, k: int, fixtures: dict, out_dir: str) -> dict:
  args = []
  for arg in command.args:
    name, _, value = arg.partition("=")
    kind = value.partition(":")[0]
    if name == "--data" and kind in ("criteo", "movielens100k"):
      arg = f"--data={kind}:{fixtures[kind]}"
    elif name in ("--model_dir", "--out"):
      arg = f"{name}={os.path.join(out_dir, str(k))}"
    arg = re.sub(r"trace:[^+]*", "trace:" + fixtures["trace"], arg)
    args.append(arg)
  if command.program == "examples/train.py" and not any(a.startswith("--model_dir=") for a in args):
    args.append(f"--model_dir={os.path.join(out_dir, str(k))}")  # not the user's /tmp default
  return {"program": command.program, "args": args, "env": command.env}


# ---- the documented commands, dry-run ------------------------------------------------------------
def test_every_documented_command_is_accepted_as_written(tmp_path):
  commands = documented_commands.extract(_ROOT)
  train = [c for c in commands if c.program == "examples/train.py"]
  benchmarks = {c.program for c in commands if c.program != "examples/train.py"}
  assert len(train) >= _MIN_TRAIN_COMMANDS, [c.where for c in train]
  assert _DOCUMENTED_BENCHMARKS <= benchmarks, _DOCUMENTED_BENCHMARKS - benchmarks
  fixtures = {"criteo": _criteo(tmp_path / "criteo"),
              "movielens100k": _movielens(tmp_path / "ml-100k"),
              "trace": str(tmp_path / "trace.json")}
  with open(fixtures["trace"], "w") as f:
    json.dump({"window_seconds": 60, "workers": {"0": [1, 4, 1], "1": [1, 4, 1]}}, f)
  jobs = [_localized(c, k, fixtures, str(tmp_path / "out")) for k, c in enumerate(commands)]
  # Two commands that must be refused: the check can fail.
  refused = [{"program": "examples/train.py", "env": {},
              "args": ["--mode=auto", "--steps=100", "--input=sharded",
                       f"--model_dir={tmp_path / 'refused'}"]},
             {"program": "benchmarks.switching", "env": {},
              "args": ["--modes=sync,nosuch", f"--out={tmp_path / 'refused'}"]}]
  with open(tmp_path / "commands.json", "w") as f:
    json.dump(jobs + refused, f)
  proc = script_process.run([str(tmp_path / "commands.json"), str(tmp_path / "results.json")],
                            script=_CHECK, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / "results.json") as f:
    results = json.load(f)
  assert len(results) == len(jobs) + len(refused)

  failures = []
  for c, job, r in zip(commands, jobs, results):
    where = f"{c.where}: {c.text}"
    stray = [a for a in job["args"] if not a.startswith("-")]
    if stray:  # absl would pass them to main, which ignores them: not what the page means
      failures.append(f"{where}\n  words that are not flags: {stray}")
    if r["rc"] != 0:
      failures.append(f"{where}\n  exit {r['rc']}: {r['stderr'].strip()[-600:]}")
    elif c.program == "examples/train.py":
      lines = r["stdout"].splitlines()
      if len(lines) != 1 or not lines[0].startswith("train.py: dry run:") or r["stderr"]:
        failures.append(f"{where}\n  not one line: {r['stdout']!r} {r['stderr']!r}")
    for planned in r.get("planned", []):
      if planned["rc"] != 0:
        failures.append(f"{where}\n  its run {planned['command']}\n  exit {planned['rc']}: "
                        f"{planned['stderr'].strip()[-600:]}")
    if job["program"] in ("benchmarks.mode_qps", "benchmarks.shadow_overlap"):
      if not r.get("planned"):
        failures.append(f"{where}\n  planned no run of the binary: {r['stdout']!r}")
  assert not failures, "documented commands refused:\n" + "\n".join(failures)

  auto, switching = results[len(jobs):]
  assert auto["rc"] == 2 and "--mode=auto does not use --input" in auto["stderr"]
  assert switching["rc"] == 2 and "nosuch" in switching["stderr"]


def test_dry_run_of_a_server_task_starts_nothing(tmp_path):
  """A real cluster's ps task would serve until killed; dry, it checks and exits at once."""
  model_dir = tmp_path / "never_made"
  env = dict(os.environ,
             TF_CONFIG=json.dumps({"cluster": {"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]},
                                   "task": {"type": "ps", "index": 0}}))
  proc = script_process.run(["--dry_run", f"--model_dir={model_dir}", "--keep_logs"], env=env,
                            timeout=300)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.splitlines() == [
      f"train.py: dry run: --mode=gba --data=synthetic --model_dir={model_dir} valid; nothing "
      "started."]
  assert proc.stderr == ""
  assert not model_dir.exists()  # not even --keep_logs' log directory


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
