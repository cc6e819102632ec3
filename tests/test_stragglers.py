"""Straggler profiles: parsing, and real slowdowns on the async path of a local cluster."""

import json

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute import GBAStrategy
from tf_gba.distribute import LocalCluster
from tf_gba.distribute import stragglers


def test_parse_profiles(tmp_path):
  assert stragglers.parse("none") == "none"
  assert stragglers.parse("persistent:3") == "persistent;0=3.0"
  assert stragglers.parse("persistent:2.5@1,3") == "persistent;1=2.5,3=2.5"
  assert stragglers.parse("transient:0.2:4") == "transient;0.2;4.0"
  trace = tmp_path / "trace.json"
  trace.write_text(json.dumps({"window_seconds": 5, "workers": {"1": [1, 3, 3, 1]}}))
  assert stragglers.parse(f"trace:{trace}") == "trace;5.0;1=1.0:3.0:3.0:1.0"
  assert stragglers.parse("transient:0.1:3+persistent:2@1") == (
      "transient;0.1;3.0+persistent;1=2.0")


@pytest.mark.parametrize("bad,message", [
    ("slow", "Unknown straggler profile"), ("persistent:0.5", ">= 1"),
    ("persistent:3@x", "integers"), ("transient:2:3", "probability"),
    ("transient:0.5", "transient:<p>:<factor>"), ("trace:/nonexistent.json", "does not exist"),
])
def test_bad_profiles_are_refused(bad, message):
  with pytest.raises(ValueError, match=message):
    stragglers.parse(bad)


def test_transient_draws_are_reproducible_and_match_p():
  # Outside a cluster the op acts as worker 0; with p=0.3, about 30% of steps sleep.
  ops = stragglers._ops()
  delays = []
  for _ in range(300):
    start = ops.gba_step_begin()
    delays.append(float(ops.gba_step_end(start, profile="transient;0.3;1.5", seed=7)))
  slow = np.array(delays) > 0
  assert 0.2 < slow.mean() < 0.4


def test_persistent_straggler_runs_a_third_as_many_steps_async():
  with LocalCluster(num_ps=1, num_workers=3) as cluster:
    strategy = GBAStrategy(cluster.resolver(), mode="async", stragglers="persistent:3@0")
    with strategy.scope():
      inp = keras.Input((3,), dtype=tf.int64)
      x = keras.layers.Flatten()(keras.layers.Embedding(1000, 8)(inp))
      # Enough compute per step that the step's own time, which the profile stretches, is most
      # of a worker's cycle (not the RPCs around it).
      x = keras.layers.Dense(1024, activation="relu")(x)
      x = keras.layers.Dense(512, activation="relu")(x)
      model = keras.Model(inp, keras.layers.Dense(1, activation="sigmoid")(x))
      model.compile(keras.optimizers.Adam(0.01), loss="binary_crossentropy")

    def dataset_fn(_):
      ids = np.random.default_rng(0).integers(0, 1000, (4096, 3))
      y = (ids.sum(1) % 2).astype(np.float32)
      return tf.data.Dataset.from_tensor_slices((ids, y)).repeat().batch(1024)

    model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
              steps_per_epoch=120, verbose=0)
    stats = strategy.worker_step_stats()
  slow, fast = stats[0], stats[1:]
  fast_mean = np.mean([w["steps"] for w in fast])
  ratio = slow["steps"] / fast_mean
  # 1/3 exactly only if compute were the whole cycle: the profile stretches the step's compute,
  # not the RPCs around it, and with 2 shared cores the fast workers speed up while the slow one
  # sleeps. Seen here: 0.42 under load, 0.55 on an idle machine. Accept 0.2-0.65; the exact
  # stretch is checked on the delay itself below.
  assert 0.2 < ratio < 0.65, stats
  # The injected delay is (3 - 1) x the slow worker's own step time.
  assert slow["delay_seconds"] == pytest.approx(2 * slow["busy_seconds"], rel=0.05)
  assert all(w["delay_seconds"] == 0 for w in fast)
