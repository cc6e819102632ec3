"""benchmarks/switching.py end to end on tiny data: tables, plots, and their consistency.

Synthetic data split into three days: the base models train on day 0, the switched modes on day
1, evaluated on day 2. One seed and three of the modes (sync, gba and hop_bw, in both
directions), 2 workers: 8 training runs of real local clusters, a few minutes on two CPU cores.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import switching

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("sync", "gba", "hop_bw")
DIRECTIONS = ("from_sync", "to_sync")
PLOTS = ("auc_per_day.png", "qps.png", "staleness_histogram.png")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
  out = tmp_path_factory.mktemp("switching")
  results = switching.main([
      "--data=synthetic", "--data_options=num_examples=1024,num_eval_examples=256,vocab_size=200",
      "--days=3", "--base_days=1", "--seeds=1", f"--modes={','.join(MODES)}",
      # 1,024 rows a day in global batches of 2 x 128: 4 global steps, the fewest accepted.
      "--num_workers=2", "--local_batch_size=128", "--stragglers=none", f"--out={out}"])
  with open(out / "results.md") as f:
    md = f.read()
  with open(out / "results.json") as f:
    saved = json.load(f)
  return out, results, saved, md


def _md_tables(md: str) -> dict:
  """{section title: [rows as {header: cell}]} for the first table of each "## " section."""
  tables = {}
  for section in md.split("\n## ")[1:]:
    title, _, body = section.partition("\n")
    lines = [l for l in body.splitlines() if l.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = []
    for line in lines[2:]:
      if line.startswith("|---"):
        break
      cells = [c.strip() for c in line.strip("|").split("|")]
      if len(cells) != len(header):
        break  # the next table of the section
      rows.append(dict(zip(header, cells)))
    tables[title] = rows
  return tables


def _mean_of(cell: str) -> float:
  return float(cell.split("±")[0].replace(",", ""))


def test_outputs_exist_and_every_run_succeeded(bench):
  out, results, saved, md = bench
  for name in ("results.md", "results.json") + PLOTS:
    assert os.path.getsize(out / name) > 0, name
  for name in PLOTS:
    with open(out / name, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
  failed = [r for r in saved["runs"] if r["status"] != "ok"]
  assert not failed, failed[0].get("error")
  assert saved["tables"] == json.loads(json.dumps(results["tables"]))
  assert saved["protocol"]["train_days"] == [1] and saved["protocol"]["eval_days"] == [2]
  # One run per (direction, mode, day): 3 bases, 3 from sync, 2 to sync (+ the shared sync -> sync
  # chain listed again under to_sync).
  assert len(saved["runs"]) == 3 + 3 + 2 + 1


def test_every_mode_trains_the_same_examples_and_evaluates_on_the_next_day(bench):
  _, _, saved, md = bench
  p = saved["protocol"]
  if saved["args"]["input"] == "shared":
    batches = -(-p["train_rows"] // saved["args"]["local_batch_size"])
    assert p["one_pass_batches"] == batches
    assert f"{p['train_rows']:,} train rows: the parameter-server modes {batches} local" in md
  for r in saved["runs"]:
    if r["mode"] != "sync" and saved["args"]["input"] == "shared":
      # The shared data list: one pass over the day, every train row once.
      assert r["examples"] == p["train_rows"], r
    elif r["mode"] == "sync" and saved["args"]["input"] == "shared":
      # The same pass in whole global steps: at most num_workers - 1 local batches more.
      batch, workers = saved["args"]["local_batch_size"], saved["args"]["num_workers"]
      assert r["examples"] == p["pass_steps"] * batch, r
      assert p["pass_steps"] % workers == 0
      assert 0 <= r["examples"] - p["train_rows"] < workers * batch, r
    else:
      assert r["examples"] == p["steps_per_day"] * saved["args"]["local_batch_size"], r
    assert r["eval_day"] == r["day"] + 1
    # The whole next day: its train rows (1024) and its eval rows (256).
    assert r["eval_examples"] == 1024 + 256
    assert 0.0 < r["eval_auc"] < 1.0
    assert np.isfinite(r["eval_logloss"]) and r["eval_logloss"] > 0
    # The loss of the day's last training interval, not that of the epochs of no-op reads that
    # end a day on the shared list (their metric is reset, 0).
    assert np.isfinite(r["final_train_loss"]) and r["final_train_loss"] > 0.1, r


def test_differences_to_the_reference_itself_are_exactly_zero(bench):
  _, results, _, _ = bench
  for direction in DIRECTIONS:
    rows = {r["mode"]: r for r in results["tables"]["auc"][direction]}
    for key in ("first", "last", "average"):
      assert rows["sync"]["delta_vs_sync"][key]["mean"] == 0.0
      assert rows["gba"]["delta_vs_gba"][key]["mean"] == 0.0
  qps = {r["mode"]: r for r in results["tables"]["qps"]}
  assert qps["sync"]["vs_sync"]["mean"] == 1.0


def test_auc_summaries_recomputed_from_the_runs(bench):
  _, _, saved, _ = bench
  for direction in DIRECTIONS:
    rows = {r["mode"]: r for r in saved["tables"]["auc"][direction]}
    for mode in MODES:
      runs = sorted((r for r in saved["runs"] if r["direction"] == direction and
                     (r["base_mode"] if direction == "to_sync" else r["mode"]) == mode),
                    key=lambda r: r["day"])
      assert [r["day"] for r in runs] == [1]
      if direction == "to_sync":
        assert all(r["mode"] == "sync" for r in runs)
      aucs = np.array([r["eval_auc"] for r in runs])
      row = rows[mode]
      assert row["average_auc"]["mean"] == pytest.approx(np.mean(aucs), abs=1e-12)
      assert row["first_day_auc"]["mean"] == pytest.approx(aucs[0], abs=1e-12)
      assert row["last_day_auc"]["mean"] == pytest.approx(aucs[-1], abs=1e-12)
      assert [d["mean"] for d in row["per_day_auc"]] == pytest.approx(aucs, abs=1e-12)
      gba = [r["eval_auc"] for r in sorted(
          (r for r in saved["runs"] if r["direction"] == direction and
           (r["base_mode"] if direction == "to_sync" else r["mode"]) == "gba"),
          key=lambda r: r["day"])]
      assert row["delta_vs_gba"]["average"]["mean"] == pytest.approx(
          np.mean(aucs) - np.mean(gba), abs=1e-12)
  # sync -> sync is one chain, the sync row of both directions.
  fwd = {r["mode"]: r for r in saved["tables"]["auc"]["from_sync"]}
  rev = {r["mode"]: r for r in saved["tables"]["auc"]["to_sync"]}
  assert fwd["sync"]["average_auc"] == rev["sync"]["average_auc"]


def test_staleness_table_matches_the_runs(bench):
  _, _, saved, _ = bench
  rows = {r["mode"]: r for r in saved["tables"]["staleness"]}
  assert rows["sync"]["mean_staleness"]["mean"] == 0.0 and rows["sync"]["staleness_histogram"] == []
  for mode in ("gba", "hop_bw"):
    runs = [r for r in saved["runs"] if r["direction"] == "from_sync" and r["mode"] == mode]
    pushes = sum(r["pushes"] for r in runs)
    hist = np.array(rows[mode]["staleness_histogram"])
    assert hist.sum() == pushes == rows[mode]["pushes"]["mean"]
    assert rows[mode]["mean_staleness"]["mean"] == pytest.approx(
        (hist * np.arange(len(hist))).sum() / pushes, abs=1e-9)
    assert rows[mode]["max_staleness"]["mean"] == max(np.nonzero(hist)[0])
    assert rows[mode]["dropped_batches"]["mean"] == sum(r["dropped_batches"] for r in runs)


def test_markdown_shows_the_json_numbers(bench):
  _, results, _, md = bench
  tables = _md_tables(md)
  titles = {d: next(t for t in tables if t.startswith("AUC after switching: " +
                                                       switching.TITLES[d][:12]))
            for d in DIRECTIONS}
  for direction in DIRECTIONS:
    md_rows = tables[titles[direction]]
    first = "mode" if direction == "from_sync" else "base mode"
    assert [r[first] for r in md_rows] == list(MODES)
    for md_row, row in zip(md_rows, results["tables"]["auc"][direction]):
      for col, stat in (("first-day AUC", row["first_day_auc"]),
                        ("last-day AUC", row["last_day_auc"]),
                        ("average AUC", row["average_auc"]),
                        ("average logloss", row["average_logloss"]),
                        ("Δ average vs GBA", row["delta_vs_gba"]["average"]),
                        ("Δ average vs sync", row["delta_vs_sync"]["average"])):
        assert _mean_of(md_row[col]) == pytest.approx(stat["mean"], abs=5.1e-5), (col, md_row)
        assert "±" not in md_row[col]  # one seed: no spread to show
  qps_rows = tables[next(t for t in tables if t.startswith("Global QPS"))]
  for md_row, row in zip(qps_rows, results["tables"]["qps"]):
    assert md_row["mode"] == row["mode"]
    assert _mean_of(md_row["global QPS"]) == pytest.approx(row["global_qps"]["mean"], abs=0.51)
  st_rows = tables[next(t for t in tables if t.startswith("Dense staleness"))]
  for md_row, row in zip(st_rows, results["tables"]["staleness"]):
    assert md_row["mode"] == row["mode"]
    assert _mean_of(md_row["mean staleness"]) == pytest.approx(row["mean_staleness"]["mean"],
                                                               abs=0.0051)
    assert _mean_of(md_row["dropped batches"]) == row["dropped_batches"]["mean"]
  assert not re.search(r"\bnan\b", md)


def test_tables_over_seeds_and_days_match_numpy():
  """The aggregation alone, on made-up runs: two seeds, two switched days, a failed chain."""
  rng = np.random.default_rng(0)
  modes, seeds, days = ["sync", "gba", "async"], [0, 1], [1, 2]
  protocol = switching.Protocol(data_options="", num_days=4, base_days=[0], train_days=days,
                                eval_days=[2, 3], next_day=True, train_rows=100,
                                eval_examples=100, steps_per_day=16)
  auc = {(d, m, s, day): rng.uniform(0.6, 0.8) for d in DIRECTIONS for m in modes
         for s in seeds for day in days}
  records = []
  for (direction, mode, seed, day), value in auc.items():
    failed = direction == "to_sync" and mode == "async" and seed == 1 and day == 2
    records.append({
        "direction": direction, "mode": "sync" if direction == "to_sync" else mode,
        "base_mode": mode if direction == "to_sync" else "sync", "seed": seed, "day": day,
        "status": "failed" if failed else "ok", "error": "exit status 1", "eval_auc": value,
        "eval_logloss": 1 - value, "global_qps": 1000.0 * (1 + modes.index(mode)) + seed,
        "pushes": 16, "mean_staleness": 0.0 if mode == "sync" else 0.5,
        "max_staleness": 0 if mode == "sync" else 2,
        "dropped_batches": 1 if mode == "async" else 0,
        "staleness_histogram": [] if mode == "sync" else [8, 8]})
  tables = switching.build_tables(records, modes, seeds, protocol)
  for direction in DIRECTIONS:
    rows = {r["mode"]: r for r in tables["auc"][direction]}
    for mode in modes:
      complete = [s for s in seeds if not (direction == "to_sync" and mode == "async" and s == 1)]
      per_seed = np.array([[auc[(direction, mode, s, d)] for d in days] for s in complete])
      averages = per_seed.mean(axis=1)
      assert rows[mode]["seeds"] == complete
      assert rows[mode]["average_auc"]["mean"] == pytest.approx(averages.mean(), abs=1e-12)
      if len(complete) > 1:
        assert rows[mode]["average_auc"]["std"] == pytest.approx(np.std(averages, ddof=1),
                                                                 abs=1e-12)
      assert rows[mode]["last_day_auc"]["mean"] == pytest.approx(per_seed[:, -1].mean(),
                                                                 abs=1e-12)
      sync = np.array([[auc[(direction, "sync", s, d)] for d in days] for s in complete])
      assert rows[mode]["delta_vs_sync"]["average"]["mean"] == pytest.approx(
          (averages - sync.mean(axis=1)).mean(), abs=1e-12)
    assert rows["sync"]["delta_vs_sync"]["average"]["mean"] == 0.0
    assert rows["gba"]["delta_vs_gba"]["average"]["std"] == 0.0
  qps = {r["mode"]: r for r in tables["qps"]}
  assert qps["gba"]["vs_sync"]["mean"] == pytest.approx(np.mean([2000 / 1000, 2001 / 1001]))
  stale = {r["mode"]: r for r in tables["staleness"]}
  assert stale["async"]["dropped_batches"]["mean"] == 2
  assert stale["gba"]["max_staleness"]["mean"] == 2
  assert stale["gba"]["staleness_histogram"] == [32, 32]
  md = switching.markdown({"args": vars(switching.parse_args([])), "protocol":
                           dataclasses.asdict(protocol), "stragglers": "none", "seeds": seeds,
                           "tables": tables, "runs": records, "wall_seconds": 1.0})
  row = next(l for l in md.splitlines() if l.startswith("| gba |"))
  gba = {r["mode"]: r for r in tables["auc"]["from_sync"]}["gba"]["average_auc"]
  assert f"{gba['mean']:.4f} ± {gba['std']:.4f}" in row


def test_sweep_grid_and_settings_as_modes():
  assert switching.sweep_grid(8) == {"hop_bs": [1, 2, 4], "bsp": [1, 2, 4], "hop_bw": [1, 2]}
  # N = 4: N/8 rounds to 0 -> 1; repeats dropped.
  assert switching.sweep_grid(4) == {"hop_bs": [1, 2, 4], "bsp": [1, 2], "hop_bw": [1]}
  args = switching.parse_args(["--sweep", "--num_workers=8",
                               "--modes=sync,gba,bsp,hop_bs,hop_bw,async_tuned"])
  assert args.modes_list == ["sync", "gba", "bsp@1", "bsp@2", "bsp@4", "hop_bs@1", "hop_bs@2",
                             "hop_bs@4", "hop_bw@1", "hop_bw@2", "async_tuned"]
  assert switching.parse_args(["--modes=sync,bsp@3"]).modes_list == ["sync", "bsp@3"]
  for bad in ("gba@2", "gba@sum", "bsp@per_id"):
    with pytest.raises(SystemExit):
      switching.parse_args([f"--modes={bad}"])
  protocol = switching.Protocol(data_options="num_days=3", num_days=3, base_days=[0],
                                train_days=[1], eval_days=[2], next_day=True, train_rows=100,
                                eval_examples=100, steps_per_day=32)
  from tf_gba.training import TrainConfig  # pylint: disable=g-import-not-at-top
  for name, field, value in (("bsp@4", "bsp_aggregate", 4), ("hop_bs@1", "hop_bs_bound", 1),
                             ("hop_bw@2", "hop_bw_backup", 2),
                             ("gba@per_id", "sparse_normalize", "per_id")):
    config = switching.run_config(args, protocol, name, 0, 1, 2, "/tmp/x")
    assert config["mode"] == name.split("@")[0] and config[field] == value
    TrainConfig(**config).validate()


def test_sweep_reports_each_baseline_at_its_best_average_auc():
  modes, seeds, days = ["sync", "gba", "bsp@1", "bsp@2", "hop_bw@1", "hop_bw@2"], [0, 1], [1, 2]
  protocol = switching.Protocol(data_options="", num_days=4, base_days=[0], train_days=days,
                                eval_days=[2, 3], next_day=True, train_rows=100,
                                eval_examples=100, steps_per_day=16)
  # Average AUC by mode (the same in every seed, day and direction, plus a small seed offset).
  level = {"sync": 0.75, "gba": 0.74, "bsp@1": 0.70, "bsp@2": 0.72, "hop_bw@1": 0.73,
           "hop_bw@2": 0.71}
  records = []
  for direction in DIRECTIONS:
    for mode in modes:
      for seed in seeds:
        for day in days:
          records.append({
              "direction": direction, "mode": "sync" if direction == "to_sync" else mode,
              "base_mode": mode if direction == "to_sync" else "sync", "seed": seed, "day": day,
              "status": "ok", "eval_auc": level[mode] + 0.001 * seed, "eval_logloss": 0.5,
              "global_qps": 1000.0, "pushes": 16, "mean_staleness": 0.0, "max_staleness": 0,
              "dropped_batches": 0, "staleness_histogram": []})
  tables = switching.build_tables(records, modes, seeds, protocol)
  for direction in DIRECTIONS:
    sweep = {e["baseline"]: e for e in tables["sweep"][direction]}
    assert set(sweep) == {"bsp", "hop_bw"}
    assert sweep["bsp"]["best"] == "bsp@2" and sweep["hop_bw"]["best"] == "hop_bw@1"
    assert [s["mode"] for s in sweep["bsp"]["settings"]] == ["bsp@2", "bsp@1"]
    best = sweep["hop_bw"]["settings"][0]
    assert best["average_auc"]["mean"] == pytest.approx(0.7305, abs=1e-12)
    assert best["delta_vs_gba"]["mean"] == pytest.approx(0.73 - 0.74, abs=1e-12)
  md = switching.markdown({"args": vars(switching.parse_args([])), "protocol":
                           dataclasses.asdict(protocol), "stragglers": "none", "seeds": seeds,
                           "tables": tables, "runs": records, "wall_seconds": 1.0})
  section = md.split("## Each baseline at its best setting (sweep)")[1]
  row = next(l for l in section.splitlines() if l.startswith("| from_sync | bsp |"))
  assert "bsp_aggregate = 2" in row and "bsp@1: 0.7005" in row


def test_gba_on_its_own_cluster_shape():
  """Sync 4 workers x 256 (G = 1024); GBA with Ba = 128: M = 8 workers, twice the steps."""
  # Static shards: a day is a step count, which GBA's smaller batch doubles.
  args = switching.parse_args(["--num_workers=4", "--local_batch_size=256", "--input=sharded",
                               "--gba_local_batch_size=128", "--modes=sync,gba,bsp"])
  protocol = switching.Protocol(data_options="num_days=3", num_days=3, base_days=[0],
                                train_days=[1], eval_days=[2], next_day=True, train_rows=100,
                                eval_examples=100, steps_per_day=32)
  from tf_gba.training import TrainConfig  # pylint: disable=g-import-not-at-top
  shared = switching.run_config(
      switching.parse_args(["--num_workers=4", "--local_batch_size=256", "--input=shared",
                            "--gba_local_batch_size=128", "--modes=sync,gba"]),
      dataclasses.replace(protocol, one_pass_batches=1), "gba", 0, 1, 2, "/tmp/x")
  # The shared data list: a day is one pass over its rows, whatever the local batch.
  assert (shared["num_workers"], shared["local_batch_size"], shared["steps"]) == (8, 128, None)
  gba = switching.run_config(args, protocol, "gba", 0, 1, 2, "/tmp/x")
  assert (gba["num_workers"], gba["local_batch_size"], gba["global_batch_size"]) == (8, 128, 1024)
  assert gba["steps"] == 64 and gba["log_every"] == 16
  assert TrainConfig(**gba).num_aggregate == 8
  for mode in ("sync", "bsp"):
    other = switching.run_config(args, protocol, mode, 0, 1, 2, "/tmp/x")
    assert (other["num_workers"], other["local_batch_size"], other["steps"]) == (4, 256, 32)
  with pytest.raises(SystemExit):
    switching.parse_args(["--num_workers=4", "--local_batch_size=256",
                          "--gba_local_batch_size=300"])


def test_resume_reuses_a_finished_run_of_the_same_config_wherever_the_out_directory_moved(
    tmp_path):
  config = {"mode": "gba", "seed": 0, "local_batch_size": 64, "model_dir": "/old/out/day0"}
  model_dir = tmp_path / "day0"
  model_dir.mkdir()
  (model_dir / switching._CONFIG_FILE).write_text(json.dumps(config))  # pylint: disable=protected-access
  (model_dir / "summary.json").write_text(json.dumps({"eval_auc": 0.7}))
  moved = dict(config, model_dir=str(model_dir))
  assert switching._finished(str(model_dir), moved) == {"eval_auc": 0.7}  # pylint: disable=protected-access
  # A field recorded before it existed matches its default, and only its default.
  assert switching._finished(str(model_dir), dict(moved, straggler_delay="after_push")) == {  # pylint: disable=protected-access
      "eval_auc": 0.7}
  assert switching._finished(str(model_dir), dict(moved, straggler_delay="before_push")) is None  # pylint: disable=protected-access
  # Any other difference runs it again.
  other = dict(moved, local_batch_size=128)
  assert switching._finished(str(model_dir), other) is None  # pylint: disable=protected-access


def test_a_day_of_fewer_than_a_few_global_steps_is_refused_in_one_line(tmp_path):
  """128 workers x 256 on the default synthetic day of 32,768 rows: one global step. Refused
  before any run starts, in one line naming the flag that fixes it."""
  env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("TF_GBA_BENCH_STDERR", None)
  proc = subprocess.run([sys.executable, "-m", "benchmarks.switching", "--num_workers=128",
                         "--modes=sync,gba", f"--out={tmp_path / 'out'}"], capture_output=True,
                        text=True, cwd=_ROOT, env=env, timeout=300, check=False)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.count("\n") == 1, proc.stderr
  assert proc.stderr.startswith(
      "benchmarks.switching: error: a day of 32,768 train rows is 1 global step of 128 workers "
      "x local batch 256 = 32,768 examples, fewer than 4"), proc.stderr
  assert "pass --local_batch_size=64 or less, or fewer --num_workers." in proc.stderr
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags,says", [
    (["--num_workers=4", "--local_batch_size=0"], "--local_batch_size must be >= 1, got 0."),
    (["--num_workers=4", "--local_batch_size=16384", "--steps_per_day=64"],
     "a global batch of 4 workers x local batch 16384 = 65,536 examples is larger than a day's "
     "32,768 train rows"),
    (["--num_workers=4", "--data_options=num_examples=8,num_eval_examples=8"],
     "a day of 8 train rows is 0.0078 global steps of 4 workers x local batch 256 = 1,024 "
     "examples, fewer than 4: its next-day AUC cannot mean anything; pass fewer --num_workers or "
     "longer days (--data_options=num_examples=... for synthetic data, fewer --days for the "
     "others)."),
])
def test_protocol_refusals_name_their_flag(flags, says, capsys):
  with pytest.raises(SystemExit) as e:
    switching.main([*flags, "--dry_run"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("benchmarks.switching: error: ") and err.count("\n") == 1, err
  assert says in err
