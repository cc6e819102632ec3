"""benchmarks/replay.py end to end on tiny data: both directions, switching's tables, and the
zero-staleness invariant at the scale of a whole day.

Synthetic data in three days, 2 workers without stragglers: every worker step of a day has the
same length, so the buffered modes see no staleness and GBA's day must equal Sync's (SPEC section
1, zero-staleness equivalence) in next-day AUC; async (M = 1) must not.
"""

import os

import pytest

from benchmarks import replay as replay_bench

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
