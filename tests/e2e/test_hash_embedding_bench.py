"""benchmarks.hash_embedding on tiny sizes: every measurement runs and reports what it says."""

from benchmarks import hash_embedding


def test_benchmark_runs_and_reports_each_measurement(capsys):
  result = hash_embedding.main(["--keys=20000", "--shards=2", "--dim=8", "--batch=64",
                                "--fields=4", "--vocab=3000", "--steps=2", "--repeats=1"])
  memory = result["memory"]
  assert memory["rows"] == 20000  # random 64-bit keys: no two equal at this size
  assert memory["row_floats_bytes"] == 8 * 2 * 4  # Adagrad: the value and its accumulator
  assert memory["target"] == 1.5 * 64 + 32
  # The table's own count covers at least the row floats, tags, counters and write numbers of
  # every row.
  assert memory["bytes_per_row_table"] >= 64 + 32
  step = result["train_step"]
  assert step["hash_examples_per_s"] > 0 and step["partitioned_examples_per_s"] > 0
  assert abs(step["hash_vs_partitioned"] - step["hash_examples_per_s"] /
             step["partitioned_examples_per_s"]) < 1e-2
  assert result["raw_lookup"]["hash_table_find_keys_per_s"] > 0
  assert '"memory"' in capsys.readouterr().out


def test_budget_stream_stays_within_the_budget(capsys):
  ttl = 6
  result = hash_embedding.main(["--budget_stream", "--stream_keys=40000", "--stream_steps=8",
                                "--repeat_share=0.25", "--max_rows=3000", f"--ttl_steps={ttl}",
                                "--shards=2", "--dim=8"])
  budget = result["budget"]
  assert budget["keys_per_step"] == 5000 and budget["repeats_per_step"] == 1250
  timeline = budget["timeline"]
  assert [t["step"] for t in timeline] == list(range(1, 9))
  # About 1,250 keys a step come back and are admitted, so the rows reach the budget by step 4
  # (3 x 1,250 > 3,000) and stay there; the keys seen once wait as pending counts, which the
  # time-to-live forgets after `ttl` steps.
  assert all(t["rows"] <= 3000 for t in timeline)
  assert [t["rows"] for t in timeline[3:]] == [3000] * 5
  assert all(t["pending"] <= (ttl + 1) * 5000 for t in timeline)
  assert timeline[-1]["evicted"] > 0 and budget["rows_within_budget"]
  assert budget["last_bytes_within_budget_and_pending"]
  assert '"budget"' in capsys.readouterr().out


def test_budget_stream_with_an_admission_filter_writes_its_timeline_and_plot(tmp_path):
  out = tmp_path / "bench"
  result = hash_embedding.main(["--budget_stream", "--stream_keys=40000", "--stream_steps=8",
                                "--repeat_share=0.25", "--max_rows=3000", "--ttl_steps=0",
                                "--admission_filter_cells=20000", "--shards=2", "--dim=8",
                                f"--out={out}"])
  budget = result["budget"]
  # The filters' bytes are part of what the budget implies; no pending count is kept per key.
  assert budget["filter_bytes"] == 2 * 20000 and budget["pending_bytes_bound"] == 0
  assert budget["implied_bytes"] == budget["budget_bytes"] + 2 * 20000
  timeline = budget["timeline"]
  # Each shard's cells in use stay at most its 20,000 whatever the stream; the rows at the budget.
  assert all(t["pending"] <= 2 * 20000 for t in timeline)
  assert budget["rows_within_budget"] and timeline[-1]["rows"] == 3000
  assert budget["max_table_over_implied"] == round(
      max(t["table_bytes"] for t in timeline) / budget["implied_bytes"], 4)
  assert (out / "budget_stream.json").exists()
