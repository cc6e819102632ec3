"""The training binary: main() with flags, on small data, asserting on what it wrote."""

import json
import os

import pytest
from absl import flags

from tests import script_process
from tests import shared_data
from tests import train_binary
from tf_gba.training import preflight


train = train_binary.load()
FLAGS = flags.FLAGS


@pytest.fixture(autouse=True)
def _flags():
  FLAGS.unparse_flags()
  FLAGS(["train.py"])
  yield
  FLAGS.unparse_flags()


def _run(tmp_path, **overrides):
  # No serving export (a few CPU-seconds a run) but in the every-mode test below.
  values = dict(num_workers=2, steps=40, log_every=20, local_batch_size=128,
                eval_examples=2048, model_dir=str(tmp_path / "model"), stragglers="none",
                export_dir="")
  values.update(overrides)
  for k, v in values.items():
    setattr(FLAGS, k, v)
  return train.main(["train.py"])


def _check_summary(model_dir, summary, mode, m):
  with open(os.path.join(model_dir, "summary.json")) as f:
    written = json.load(f)
  assert written["mode"] == mode
  assert written == json.loads(json.dumps(summary))
  assert summary["steps"] == 40
  # Hop-BW: gradients of an older version take no place in a step, and steps released from the
  # per-version barrier at the end of an epoch push nothing.
  released = sum(w.get("released_steps", 0) for w in summary["per_worker"])
  counted = 40 - summary.get("ignored_gradients", 0) - released
  assert summary["global_step"] - summary["start_global_step"] == counted // m
  assert 0.0 <= summary["eval_auc"] <= 1.0 and summary["eval_logloss"] > 0
  assert summary["global_qps"] > 0 and len(summary["per_worker"]) == 2
  assert sum(w["steps"] for w in summary["per_worker"]) >= 40
  assert os.path.exists(summary["checkpoint"] + ".index")
  assert os.listdir(os.path.join(model_dir, "tensorboard"))


@pytest.mark.parametrize("mode,model,m", [("gba", "deepfm", 2), ("async", "dcn", 1),
                                          ("gba", "youtube_dnn", 2), ("sync", "deepfm", 2),
                                          ("bsp", "deepfm", 1), ("hop_bs", "deepfm", 2),
                                          ("hop_bw", "deepfm", 1)])
def test_each_mode_and_model(tmp_path, mode, model, m):
  """Every mode from the same binary and flags (2 workers: default BSP b2 = max(1, round(2 / 5))
  = 1, Hop-BW N - b3 = 2 - 1 = 1)."""
  summary = _run(tmp_path, mode=mode, model=model, export_dir=None)
  _check_summary(str(tmp_path / "model"), summary, mode, m)
  # Every mode writes its serving SavedModel at the end (what stock TensorFlow makes of it:
  # test_serving_export.py).
  export = tmp_path / "model" / "export" / str(summary["global_step"])
  assert (export / "saved_model.pb").exists(), os.listdir(tmp_path / "model")
  assert summary["model"] == model
  assert summary["num_aggregate"] == m
  if mode == "hop_bs":
    assert summary["max_lead"] is not None and summary["max_lead"] <= 2
  if mode == "hop_bw":
    assert summary["ignored_gradients"] >= 0 and summary["dropped_batches"] == summary[
        "ignored_gradients"]
    assert all(w["repeated_versions"] == 0 for w in summary["per_worker"])


def test_hop_bs_holds_fast_workers_behind_a_5x_slower_one(tmp_path):
  """A real barrier on a real cluster: worker 0 is 5x slower (500 ms steps vs 100 ms); b1 = 1.

  Without the barrier (GBA, same profile) the fast workers run far more steps than worker 0; with
  it they wait for worker 0, never more than b1 completed steps ahead when they start a step.
  """
  # On a 100 ms compute floor, so that the slowdown, not the machine's load, sets the pace.
  common = dict(num_workers=3, steps=60, log_every=30, stragglers="compute:100+persistent:5@0",
                hop_bs_bound=1, local_batch_size=64)
  # One step per scheduled function in both (Hop-BS's own): the fast workers take steps one by
  # one, not in functions of 20 that a 60-step run has too few of to share out.
  free = _run(tmp_path / "gba", mode="gba", steps_per_execution=1, **common)
  held = _run(tmp_path / "hop_bs", mode="hop_bs", **common)
  free_steps = [w["steps"] for w in free["per_worker"]]
  held_steps = [w["steps"] for w in held["per_worker"]]
  assert min(free_steps[1:]) >= 2 * free_steps[0], free_steps
  # A worker starts a step only with a lead <= b1, so it ends at most b1 + 1 ahead; except that
  # at the run's end, once every step is scheduled, a fast worker still blocked there has nobody
  # left to release it, and the strategy lets it go (docs/training_binary.md): its one last step
  # then starts with a lead of b1 + 1 (seen once on a loaded machine: [18, 21, 21]). The clock's
  # own statistics must still show leads <= b1 (the release resets the clock, so a released wait
  # counts with lead 0).
  assert max(held_steps) - held_steps[0] <= 1 + 1 + 1, held_steps
  assert held["max_lead"] <= 1
  slow, fast = held["per_worker"][0], held["per_worker"][1:]
  assert all(w["barrier_timeouts"] == 0 for w in held["per_worker"])
  assert all(w["blocked_seconds"] > 0.2 for w in fast), fast
  assert slow["blocked_seconds"] < min(w["blocked_seconds"] for w in fast)
  assert held["blocked_seconds"] == pytest.approx(
      sum(w["blocked_seconds"] for w in held["per_worker"]), abs=0.01)
  # The time inside steps: each step lasts the floor x the worker's factor (its compute is under
  # the floor), so over the measured window a worker is in a step for at least factor x 0.1 s x
  # its steps (qps / 64 a second); at most the window and the one step that ends inside it but
  # began before it (counted whole): a worker's steps run one after another, so at most the
  # window plus its longest step (seen: 2.0 s in steps for worker 0's three steps in a 1.63 s
  # window; 3.37 s for four in 2.08 s beside a test suite, where a step outlasts the floor and the
  # factor stretches it: 0.84 s a step on average). Held fast workers wait at the barrier,
  # outside their steps.
  for run in (free, held):
    for w in run["per_worker"]:
      factor = 5 if w["worker"] == 0 else 1
      assert factor * 0.1 * w["qps"] / 64 <= w["in_step_fraction"] * 1.001 + 1e-3, w
      assert factor * 0.1 <= w["max_step_seconds"] * 1.001, w
      window = run["qps_measured_over_steps"] * 64 / run["global_qps"]
      assert w["in_step_fraction"] * window <= window + w["max_step_seconds"] + 2e-3, w
  assert slow["in_step_fraction"] > max(w["in_step_fraction"] for w in fast) + 0.2, held


def test_async_tuned_has_its_own_optimizer_and_batch_and_inherits_a_sync_model(tmp_path):
  """The paper's Async row: Adagrad, its own lr and local batch; from a Sync (Adam) checkpoint
  it keeps the parameters and starts its optimizer afresh."""
  sync = _run(tmp_path, mode="sync", steps=20)
  summary = _run(tmp_path, mode="async_tuned", async_tuned_learning_rate=0.02,
                 async_tuned_local_batch_size=64, steps=20)
  assert summary["mode"] == "async_tuned" and summary["num_aggregate"] == 1
  assert summary["local_batch_size"] == 64 and summary["examples"] == 20 * 64
  assert summary["start_global_step"] == 0 and summary["global_step"] == 20
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def slots(path):
    return sum(n.startswith("model/optimizer/_variables/") for n, _ in tf.train.list_variables(path))

  # Adam keeps two slots per variable, Adagrad one.
  assert slots(sync["checkpoint"]) == 2 * slots(summary["checkpoint"]) > 0


def test_plain_async_without_buffers(tmp_path):
  summary = _run(tmp_path, mode="async", async_staleness_stats=False)
  _check_summary(str(tmp_path / "model"), summary, "async", 1)
  assert summary["pushes"] == 40 and summary["mean_staleness"] == 0.0


def test_dts_mode_trains_on_local_workers(tmp_path):
  summary = _run(tmp_path, mode="dts", dts_delay=2, dts_period=2, learning_rate=0.05)
  assert summary["mode"] == "dts" and summary["steps"] == 40
  assert summary["global_qps"] > 0 and summary["eval_auc"] > 0.55
  with open(tmp_path / "model" / "summary.json") as f:
    assert json.load(f)["dts_delay"] == 2


def test_switch_changes_the_cluster_shape(tmp_path):
  """Sync on 2 workers x 128 (G = 256), then GBA on M = 256 / 64 = 4 workers x 64, same lr and
  optimizer, from Sync's checkpoint: parameters, slots and the global step carry over."""
  sync = _run(tmp_path, mode="sync", steps=20, local_batch_size=128)
  gba = _run(tmp_path, mode="gba", num_workers=4, local_batch_size=64, global_batch_size=256,
             steps=40)
  assert (gba["num_workers"], gba["num_aggregate"], gba["global_batch_size"]) == (4, 4, 256)
  assert gba["start_global_step"] == sync["global_step"] == 10
  assert gba["global_step"] == 10 + 40 // 4 and len(gba["per_worker"]) == 4


def test_restores_from_model_dir(tmp_path):
  first = _run(tmp_path)
  second = _run(tmp_path, steps=20)
  assert second["start_global_step"] == first["global_step"] == 20
  assert second["global_step"] == 30


def test_sparse_normalize_flag_is_recorded(tmp_path):
  summary = _run(tmp_path, mode="gba", sparse_normalize="per_id", steps=20)
  assert summary["sparse_normalize"] == "per_id" and summary["global_step"] == 10


def test_bad_sparse_normalize_is_refused():
  from tf_gba.training import TrainConfig  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="--sparse_normalize must be one of"):
    TrainConfig(sparse_normalize="mean").validate()


def test_bad_flag_combination_is_refused(tmp_path):
  with pytest.raises(preflight.InputError, match="not a multiple"):
    _run(tmp_path, global_batch_size=1000, local_batch_size=300)
  with pytest.raises(preflight.InputError, match="straggler"):
    _run(tmp_path, global_batch_size=None, stragglers="sometimes")


def test_trains_on_real_criteo_rows(tmp_path):
  path = shared_data.require("criteo_sample")
  summary = _run(tmp_path, data=f"criteo:{path}", model="dcn")
  assert summary["eval_examples"] == 2000  # the eval_2k file
  assert summary["global_step"] == 20


def test_trains_on_real_movielens(tmp_path):
  path = shared_data.require("movielens_100k")
  summary = _run(tmp_path, data=f"movielens100k:{path}", mode="async")
  assert summary["global_step"] == 40 and summary["eval_examples"] > 1000


def test_a_barrier_modes_day_on_the_shared_list_ends_when_only_blocked_workers_hold_batches(
    tmp_path):
  """Hop-BW, one pass over a day (no --steps), worker 0 4x slower. Near the end the fast workers
  see the end of the list while a worker that holds the last batches waits at the per-version
  barrier for gradients only they could push: nothing can let it go. The day must end there
  (its step released, pushing nothing) rather than run no-op reads forever; in a subprocess,
  under a time limit, since the failure is a run that never ends."""
  model_dir = tmp_path / "model"
  proc = script_process.run(
      ["--mode=hop_bw", "--num_workers=3", "--local_batch_size=64",
       "--data_options=num_examples=3200", "--stragglers=compute:50+persistent:4@0",
       "--log_every=10", "--eval_examples=512", f"--model_dir={model_dir}"], timeout=240)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(model_dir / "summary.json") as f:
    summary = json.load(f)
  data_list = summary["data_list"]
  assert data_list["num_batches"] == 50 and data_list["stalled"] is None
  # Every batch of the day trained once (a released step's batch counts: it was read and its
  # step ran, pushing nothing), but for the one each released worker had fetched ahead.
  released = sum(w["released_steps"] for w in summary["per_worker"])
  assert data_list["duplicates"] == 0
  assert data_list["batches"] + data_list["missed"] == 50
  assert data_list["missed"] <= released <= 3, (data_list["missed"], released)
  # No progress line repeats itself while the exhausted workers run no-op reads.
  lines = [l.split("  ")[0] for l in proc.stdout.splitlines() if l.startswith("step ")]
  assert len(lines) == len(set(lines)), lines
