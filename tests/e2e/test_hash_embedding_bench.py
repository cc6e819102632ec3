"""benchmarks.hash_embedding on tiny sizes: every measurement runs and reports what it says."""

from benchmarks import hash_embedding


def test_benchmark_runs_and_reports_each_measurement(capsys):
  result = hash_embedding.main(["--keys=20000", "--shards=2", "--dim=8", "--batch=64",
                                "--fields=4", "--vocab=3000", "--steps=2", "--repeats=1"])
  memory = result["memory"]
  assert memory["rows"] == 20000  # random 64-bit keys: no two equal at this size
  assert memory["row_floats_bytes"] == 8 * 2 * 4  # Adagrad: the value and its accumulator
  assert memory["target"] == 1.5 * 64 + 32
  # The table's own count covers at least the row floats, tags and counters of every row.
  assert memory["bytes_per_row_table"] >= 64 + 24
  step = result["train_step"]
  assert step["hash_examples_per_s"] > 0 and step["partitioned_examples_per_s"] > 0
  assert abs(step["hash_vs_partitioned"] - step["hash_examples_per_s"] /
             step["partitioned_examples_per_s"]) < 1e-2
  assert result["raw_lookup"]["hash_table_find_keys_per_s"] > 0
  assert '"memory"' in capsys.readouterr().out
