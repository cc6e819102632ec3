"""benchmarks/replay.py end to end on tiny data: both directions, switching's tables, and the
zero-staleness invariant at the scale of a whole day.

Synthetic data in three days, 2 workers without stragglers: every worker step of a day has the
same length, so the buffered modes see no staleness and GBA's day must equal Sync's (SPEC section
1, zero-staleness equivalence) in next-day AUC; async (M = 1) must not.
"""

import os
import subprocess
import sys

import pytest

from benchmarks import replay as replay_bench

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("sync", "gba", "async")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  out = tmp_path_factory.mktemp("replay")
  res = replay_bench.main([
      "--data=synthetic", "--data_options=num_examples=1024,num_eval_examples=256,vocab_size=200",
      "--days=3", "--seeds=1", f"--modes={','.join(MODES)}", "--num_workers=2",
      "--stragglers=none", "--local_batch_size=128", f"--out={out}"])
  return out, res[2]


def _auc(res, direction, mode):
  return next(r for r in res["tables"]["auc"][direction] if r["mode"] == mode)


def test_runs_and_tables(results):
  out, res = results
  runs = [r for r in res["runs"] if not r.get("shared_with")]
  # Bases: sync, gba, async (day 0); from sync: 3 modes (day 1); to sync: 2 (day 1).
  assert len(runs) == 3 + 3 + 2
  for r in runs:
    assert r["status"] == "ok" and 0.0 < r["eval_auc"] < 1.0
    # One pass of 1,024 rows in batches of 128: 8 worker steps, 4 global steps (M = N = 2).
    assert r["pushes"] == 8
    assert r["global_steps"] == (8 if r["mode"] == "async" else 4)
  with open(os.path.join(out, "N2", "results.md")) as f:
    text = f.read()
  assert text.startswith("# Switching benchmark, replayed (N = 2)")
  assert "sync -> mode" in text and "mode -> sync" in text
  for name in ("results.json", "auc_per_day.png", "qps.png"):
    assert os.path.getsize(os.path.join(out, "N2", name)) > 0


def test_gba_equals_sync_without_staleness_and_async_does_not(results):
  _, res = results
  for direction in ("from_sync", "to_sync"):
    sync = _auc(res, direction, "sync")["average_auc"]["mean"]
    gba = _auc(res, direction, "gba")["average_auc"]["mean"]
    asy = _auc(res, direction, "async")["average_auc"]["mean"]
    assert gba == pytest.approx(sync, abs=1e-6), direction
    assert abs(asy - sync) > 1e-4, direction
  stale = next(r for r in res["tables"]["staleness"] if r["mode"] == "gba")
  assert stale["mean_staleness"]["mean"] == 0 and stale["dropped_batches"]["mean"] == 0


@pytest.mark.parametrize("steps_per_day,want", [(0, {"sync": 10, "gba": 9, "async": 9}),
                                                (12, {"sync": 16, "gba": 16, "async": 16})])
def test_day_length_is_one_pass_or_steps_per_day_in_every_mode(steps_per_day, want):
  """A day is one pass through the data list (9 local batches of 1,100 rows; Sync 10: whole
  global steps of N = 2), or --steps_per_day in every mode (rounded up to 4 N = 8: 12 -> 16),
  so that a short day gives Sync no extra global step."""
  args = replay_bench.parse_args([
      "--data=synthetic", "--data_options=num_examples=1100,num_eval_examples=64,vocab_size=50",
      "--days=3", "--num_workers=2", "--local_batch_size=128",
      f"--steps_per_day={steps_per_day}"])
  protocol = replay_bench.make_protocol(args, 2, 128)
  assert {m: replay_bench.day_steps(protocol, m, 2) for m in want} == want


def _run(args, tmp_path):
  """`python -m benchmarks.replay args` as a user runs it (its own stderr, as the terminal)."""
  env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("TF_GBA_BENCH_STDERR", None)
  return subprocess.run([sys.executable, "-m", "benchmarks.replay", *args,
                         f"--out={tmp_path / 'out'}"], capture_output=True, text=True, cwd=_ROOT,
                        env=env, timeout=300, check=False)


def test_a_day_of_fewer_than_a_few_global_steps_is_refused_in_one_line(tmp_path):
  """N = 128 at the default local batch 256: the default synthetic day of 32,768 rows is one
  global step. Refused before anything is replayed, in one line that names the flag to pass."""
  proc = _run(["--num_workers=128", "--modes=sync,gba", "--seeds=1", "--stragglers=paper",
               "--from_sync_only"], tmp_path)
  assert proc.returncode == 2, proc.stderr
  assert proc.stdout == ""
  assert proc.stderr.endswith("\n") and proc.stderr.count("\n") == 1, proc.stderr
  assert proc.stderr.startswith(
      "benchmarks.replay: error: N=128: a day of 32,768 train rows is 1 global step of 128 "
      "workers x local batch 256 = 32,768 examples, fewer than 4"), proc.stderr
  assert "pass --global_batch_size=8192 or less (local batch 64 at N=128)" in proc.stderr
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags,says", [
    # A list of N: the largest global batch that every N divides, at the N that is refused.
    (["--num_workers=8,32,128"],
     "N=128: a day of 32,768 train rows is 1 global step of 128 workers x local batch 256"),
    (["--num_workers=8,32,128"], "--global_batch_size=8192 or less (a multiple of 128, local "
                                 "batch 64 at N=128)"),
    (["--num_workers=8", "--global_batch_size=16384"], "is 2 global steps of 8 workers x local "
                                                       "batch 2048"),
    # A day of --steps_per_day worker steps needs one global batch of rows.
    (["--num_workers=8", "--local_batch_size=8192", "--steps_per_day=64"],
     "a global batch of 8 workers x local batch 8192 = 65,536 examples is larger than a day's "
     "32,768 train rows"),
    (["--num_workers=8", "--local_batch_size=0"], "--local_batch_size must be >= 1, got 0."),
    (["--num_workers=8,128", "--global_batch_size=64"],
     "--global_batch_size=64 is a local batch below 1 at N=128"),
])
def test_protocol_refusals_name_their_flag(flags, says, capsys):
  with pytest.raises(SystemExit) as e:
    replay_bench.main([*flags, "--dry_run"])
  assert e.value.code == 2
  out, err = capsys.readouterr()
  assert err.startswith("benchmarks.replay: error: ") and err.count("\n") == 1, err
  assert says in err and out == ""


def test_dry_run_accepts_a_day_of_enough_global_steps(capsys):
  assert replay_bench.main(["--num_workers=8,32,128", "--global_batch_size=8192",
                            "--dry_run"]) == {}
  assert "dry run: flags and days valid" in capsys.readouterr().out
