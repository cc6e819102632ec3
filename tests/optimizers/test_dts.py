"""DTS (SPEC section 3) against NumPy references written here, on scripted gradients.

Each replica's gradient at each step comes from a table: a linear loss `sum(w * c(n, j))` has
gradient `c(n, j)` whatever the model, a quadratic loss `0.5 * a_j * |w - c(n, j)|^2` has a gradient
that depends on the replica's own model. The references are the SPEC's formulas: the invariant
`w(n,j) = w0 - lr*sum_{i<=n-t} avg(i) - lr*sum_{n-t<i<=n-1} grad(i,j)` (and its momentum / period
form from the paper's Eq. 6), the step-by-step recurrences Eq. 3, 7-8, 9, 11, 12, and synchronous
(momentum) SGD.
"""

import os
import sys
import time

import tf_gba  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads Keras)
import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute import collective_cluster
from tf_gba.distribute.dts_training import DTSTrainer
from tf_gba.distribute.dts_training import make_local_mirrored_strategy
from tf_gba.distribute.latency import AsyncAllReduce
from tf_gba.optimizers.dts import DTS
from tf_gba.training.dts_job import train_dts

# The multi-worker test's worker processes load this file by its path, without pytest's sys.path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import logical_cpus  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

LR = 0.1
M = 0.9
DIM = 3


logical_cpus.configure(4)


@pytest.fixture(scope="module")
def strategy():
  devices = [d.name for d in tf.config.list_logical_devices("CPU")]
  if len(devices) < 2:
    pytest.skip("needs >= 2 logical CPU devices; TensorFlow was initialised with one")
  return make_local_mirrored_strategy(3)   # the process's one strategy over these devices


# ------------------------------------------------------------------------------------------------
# NumPy references.

def _c(r, m):
  """sum_{k<r} m**k: weight of a gradient r steps back in the model (paper Eq. 6)."""
  return sum(m ** k for k in range(r))


def _compensated(i, n, t, p):
  """True when step i's gradient has been replaced by the mean in the model w(n)."""
  round_end = (i // p) * p + p - 1
  return round_end + t <= n


def closed_form(grads, w0, n, t, p, m):
  """Per-replica (w(n,j), u(n-1,j)) from the gradient history, SPEC invariant / paper Eq. 6.

  `grads[i, j]` for i < n; the mean replaces grad(i, j) once step i is compensated.
  """
  avg = grads.mean(axis=1)
  replicas = grads.shape[1]
  w = np.tile(np.asarray(w0, np.float64), (replicas, 1))
  u = np.zeros_like(w)
  for j in range(replicas):
    for i in range(n):
      g = avg[i] if _compensated(i, n, t, p) else grads[i, j]
      w[j] -= LR * _c(n - i, m) * g
      u[j] += m ** (n - 1 - i) * g
  return w, u


def sync_sgd(avg, w0, n, m):
  """Synchronous (momentum) SGD: u = m*u + avg(i); w -= lr*u."""
  w, u = np.asarray(w0, np.float64).copy(), np.zeros(len(w0))
  for i in range(n):
    u = m * u + avg[i]
    w = w - LR * u
  return w


def spec_recurrence(case, grad_fn, w0, replicas, steps, t, p):
  """The SPEC section 3 recurrences, step by step, for every replica.

  `grad_fn(n, j, w)` is replica j's gradient at step n for model w. Returns the per-replica models
  w(n) for n = 1..steps, after that step's compensation.
  """
  w = [np.asarray(w0, np.float64).copy() for _ in range(replicas)]
  u = [np.zeros(len(w0)) for _ in range(replicas)]
  grads = {}
  history = []
  for n in range(steps + 1):
    if n > 0:
      g_prev = [grads[n - 1, j] for j in range(replicas)]
      avg = {k: np.mean([grads[k, j] for j in range(replicas)], axis=0) for k in range(n)}
      for j in range(replicas):
        d = {k: avg[k] - grads[k, j] for k in range(n)}
        if case == "eq3":      # delayed SGD
          w[j] = w[j] - LR * g_prev[j] - (LR * d[n - t] if n >= t else 0.0)
        elif case == "eq9":    # temporally sparse SGD
          comp = sum(d[k] for k in range(n - p, n)) if n % p == 0 else 0.0
          w[j] = w[j] - LR * (g_prev[j] + comp)
        elif case == "eq12":   # delayed + temporally sparse SGD; rounds end at b, applied at b+t
          b = n - t
          comp = (sum(d[k] for k in range(b - p + 1, b + 1))
                  if b >= 0 and b % p == p - 1 else 0.0)
          w[j] = w[j] - LR * (g_prev[j] + comp)
        elif case == "eq7_8":  # delayed momentum: w' = w - lr * sum_{k<t} m**k * d(n-t)
          w[j] = w[j] - LR * u[j]
          if n >= t:
            w[j] = w[j] - LR * _c(t, M) * d[n - t]
        elif case == "eq11":   # temporally sparse momentum, S restarted each period
          w[j] = w[j] - LR * u[j]
          if n % p == 0:
            s_local, s_mean, sum_local, sum_mean = 0.0, 0.0, 0.0, 0.0
            for k in range(n - p, n):
              s_local = M * s_local + grads[k, j]
              s_mean = M * s_mean + avg[k]
              sum_local, sum_mean = sum_local + s_local, sum_mean + s_mean
            u[j] = u[j] + (s_mean - s_local)
            w[j] = w[j] - LR * (sum_mean - sum_local)
      history.append([x.copy() for x in w])
    if n == steps:
      break
    for j in range(replicas):
      grads[n, j] = grad_fn(n, j, w[j])
      if case == "eq7_8":
        u[j] = M * u[j] + grads[n, j]
        if n >= t:
          d = np.mean([grads[n - t, i] for i in range(replicas)], axis=0) - grads[n - t, j]
          u[j] = u[j] + M ** t * d
      elif case == "eq11":
        u[j] = M * u[j] + grads[n, j]
  return np.array(history)


# ------------------------------------------------------------------------------------------------
# Helpers driving the implementation.

def _dts(strategy, inner="sgd", lr=LR, m=M, delay=1, period=1):
  """DTS wrapping SGD ("sgd") or momentum SGD ("momentum"), made under `strategy`'s scope."""
  with strategy.scope():
    return DTS(keras.optimizers.SGD(lr, momentum=m if inner == "momentum" else 0.0), delay=delay,
               period=period)


def _copies(strategy, var):
  return np.stack([c.numpy() for c in strategy.experimental_local_results(var)])


def _table_iterator(strategy, table, start=0):
  """Distributed iterator giving replica j row table[n, j] at step n (from step `start`)."""
  steps, replicas = table.shape[:2]
  flat = table[start:].reshape((steps - start) * replicas, *table.shape[2:])
  return iter(strategy.distribute_datasets_from_function(
      lambda ctx: tf.data.Dataset.from_tensor_slices(flat).repeat()))


def _run(strategy, opt, var, loss_fn, table, steps, start=0, trainer=None):
  """Runs `steps` steps; returns the per-replica copies of `var` after each."""
  trainer = trainer or DTSTrainer(strategy, opt, [var], loss_fn)
  iterator = _table_iterator(strategy, table, start)
  history = []
  for _ in range(steps):
    trainer.step(iterator)
    history.append(_copies(strategy, var))
  return np.array(history), trainer


# ------------------------------------------------------------------------------------------------
# Tests.

@pytest.mark.parametrize("t,p", [(1, 1), (2, 1), (3, 2), (8, 3), (4, 4), (2, 7)])
def test_schedule(strategy, t, p):
  opt = _dts(strategy, delay=t, period=p)
  assert opt.num_slots == -(-(t - 1) // p) + 1
  consumed = {}
  for n in range(60):
    due = opt.due_round(n)
    if due is not None:
      consumed[due] = n
  for r in range(40 // p):
    assert consumed[r] == (r + 1) * p - 1 + t - 1      # started after step b, done at b + t - 1
  for steps_done in range(40):
    live = opt.rounds_in_flight(steps_done)
    expected = [r for r in range(steps_done) if (r + 1) * p - 1 <= steps_done - 1 < consumed[r]]
    assert live == expected
    assert len(set(opt.slot_of(r) for r in live + [opt.round_of(steps_done)])) == len(
        set(live + [opt.round_of(steps_done)]))   # no two live rounds share a slot


@pytest.mark.parametrize("inner,t,p", [
    ("sgd", 1, 1), ("sgd", 4, 1), ("sgd", 8, 1), ("sgd", 1, 2), ("sgd", 1, 8), ("sgd", 3, 2),
    ("sgd", 8, 8), ("momentum", 1, 1), ("momentum", 5, 1), ("momentum", 1, 3),
    ("momentum", 4, 2), ("momentum", 8, 4)])
def test_invariant_on_scripted_gradients(strategy, inner, t, p):
  replicas = strategy.num_replicas_in_sync
  steps = t + 2 * p + 3
  rng = np.random.default_rng(7 * t + p)
  table = rng.normal(size=(steps, replicas, DIM)).astype(np.float32)
  w0 = rng.normal(size=DIM).astype(np.float32)
  m = M if inner == "momentum" else 0.0
  with strategy.scope():
    w = tf.Variable(w0)
  opt = _dts(strategy, inner, delay=t, period=p)
  history, trainer = _run(strategy, opt, w, lambda c: tf.reduce_sum(w * c), table, steps)
  avg = table.astype(np.float64).mean(axis=1)
  for n in range(1, steps + 1):
    ref_w, ref_u = closed_form(table.astype(np.float64), w0, n, t, p, m)
    np.testing.assert_allclose(history[n - 1], ref_w, atol=2e-5, err_msg=f"w after {n} steps")
    if p == 1 and m == 0.0:  # The SPEC's invariant, literally.
      for j in range(replicas):
        spec = (w0 - LR * sum(avg[i] for i in range(0, n - t + 1))
                - LR * sum(table[i, j] for i in range(max(0, n - t + 1), n)))
        np.testing.assert_allclose(history[n - 1][j], spec, atol=2e-5)
    # The replicas' average is synchronous (momentum) SGD on the same gradients, at every step.
    np.testing.assert_allclose(history[n - 1].mean(axis=0), sync_sgd(avg, w0, n, m), atol=2e-5)
    if m and n == steps:
      np.testing.assert_allclose(opt.local_state(0)["momentum"], ref_u, atol=2e-5)
  trainer.synchronize()
  final = _copies(strategy, w)
  for j in range(replicas):
    np.testing.assert_allclose(final[j], sync_sgd(avg, w0, steps, m), atol=2e-5)
  if m:
    ref_u = sum(M ** (steps - 1 - i) * avg[i] for i in range(steps))
    np.testing.assert_allclose(opt.local_state(0)["momentum"], np.tile(ref_u, (replicas, 1)),
                               atol=2e-5)
  assert not np.any(opt.local_state(0)["sum"])          # every round consumed
  trainer.close()


@pytest.mark.parametrize("case,inner,t,p", [
    ("eq3", "sgd", 3, 1), ("eq7_8", "momentum", 4, 1), ("eq9", "sgd", 1, 3),
    ("eq11", "momentum", 1, 4), ("eq12", "sgd", 3, 2)])
def test_spec_recurrences_with_model_dependent_gradients(strategy, case, inner, t, p):
  replicas = strategy.num_replicas_in_sync
  steps = t + 2 * p + 4
  rng = np.random.default_rng(11 + t + p)
  targets = rng.normal(size=(steps, replicas, DIM))
  scales = np.linspace(0.5, 1.5, replicas)
  table = np.concatenate([np.broadcast_to(scales[None, :, None], (steps, replicas, 1)), targets],
                         axis=2).astype(np.float32)
  w0 = rng.normal(size=DIM).astype(np.float32)
  with strategy.scope():
    w = tf.Variable(w0)

  def loss_fn(row):  # 0.5 * a_j * |w - c(n, j)|^2: gradient a_j * (w - c(n, j))
    return 0.5 * row[0] * tf.reduce_sum(tf.square(w - row[1:]))

  opt = _dts(strategy, inner, delay=t, period=p)
  history, trainer = _run(strategy, opt, w, loss_fn, table, steps)
  trainer.close()
  ref = spec_recurrence(case, lambda n, j, wj: table[n, j, 0] * (wj - table[n, j, 1:]),
                        w0, replicas, steps, t, p)
  np.testing.assert_allclose(history, ref, atol=3e-5)


@pytest.mark.parametrize("inner", ["sgd", "momentum"])
def test_embedding_gradients_are_indexed_slices(strategy, inner):
  replicas = strategy.num_replicas_in_sync
  t, p, steps, rows = 3, 2, 9, 5
  rng = np.random.default_rng(3)
  ids = rng.integers(0, rows, size=(steps, replicas, 2))
  coef = rng.normal(size=(steps, replicas, 2, DIM))
  table0 = rng.normal(size=(rows, DIM)).astype(np.float32)
  with strategy.scope():
    emb = tf.Variable(table0)
  batches = (ids.reshape(steps * replicas, 2), coef.reshape(steps * replicas, 2, DIM))
  iterator = iter(strategy.distribute_datasets_from_function(
      lambda ctx: tf.data.Dataset.from_tensor_slices(batches).repeat()))

  def loss_fn(batch):
    return tf.reduce_sum(tf.gather(emb, batch[0]) * tf.cast(batch[1], tf.float32))

  with tf.GradientTape() as tape:
    probe = loss_fn((ids[0, 0], coef[0, 0]))
  assert isinstance(tape.gradient(probe, emb), tf.IndexedSlices)
  opt = _dts(strategy, inner, delay=t, period=p)
  trainer = DTSTrainer(strategy, opt, [emb], loss_fn)
  history = []
  for _ in range(steps):
    trainer.step(iterator)
    history.append(_copies(strategy, emb))
  trainer.synchronize()
  final = _copies(strategy, emb)
  trainer.close()
  # Dense per-step gradients of the table: rows ids get coef, duplicates summed.
  dense = np.zeros((steps, replicas, rows, DIM))
  for n in range(steps):
    for j in range(replicas):
      for k in range(2):
        dense[n, j, ids[n, j, k]] += coef[n, j, k]
  m = M if inner == "momentum" else 0.0
  flat = dense.reshape(steps, replicas, rows * DIM)
  for n in range(1, steps + 1):
    ref_w, _ = closed_form(flat, table0.reshape(-1), n, t, p, m)
    np.testing.assert_allclose(history[n - 1].reshape(replicas, -1), ref_w, atol=2e-5)
  sync = sync_sgd(flat.mean(axis=1), table0.reshape(-1), steps, m)
  np.testing.assert_allclose(final.reshape(replicas, -1), np.tile(sync, (replicas, 1)),
                             atol=2e-5)


def test_checkpoint_round_trip_restores_compensation_state(strategy, tmp_path):
  replicas = strategy.num_replicas_in_sync
  t, p, first, more = 3, 2, 5, 7
  steps = first + more
  rng = np.random.default_rng(5)
  table = np.concatenate([np.ones((steps, replicas, 1)), rng.normal(size=(steps, replicas, DIM))],
                         axis=2).astype(np.float32)
  w0 = rng.normal(size=DIM).astype(np.float32)

  def make():
    with strategy.scope():
      w = tf.Variable(w0)
    opt = _dts(strategy, "momentum", delay=t, period=p)
    trainer = DTSTrainer(strategy, opt, [w],
                         lambda row: 0.5 * row[0] * tf.reduce_sum(tf.square(w - row[1:])))
    return w, opt, trainer

  w, opt, trainer = make()
  _run(strategy, opt, w, None, table, first, trainer=trainer)
  assert opt.rounds_in_flight(first)             # exchanges in flight at save time
  path = tf.train.Checkpoint(w=w, optimizer=opt).write(str(tmp_path / "ckpt"))
  saved_state, saved_w = opt.local_state(0), _copies(strategy, w)
  assert np.any(saved_state["sum"]) and np.ptp(saved_w, axis=0).max() > 0  # copies differ
  continued, _ = _run(strategy, opt, w, None, table, more, start=first, trainer=trainer)
  trainer.close()

  w2, opt2, trainer2 = make()
  tf.train.Checkpoint(w=w2, optimizer=opt2).read(path).assert_consumed()
  trainer2.resume()
  assert trainer2.steps == first
  restored = opt2.local_state(0)
  for key in saved_state:
    np.testing.assert_array_equal(restored[key], saved_state[key])
  np.testing.assert_array_equal(_copies(strategy, w2), saved_w)
  resumed, _ = _run(strategy, opt2, w2, None, table, more, start=first, trainer=trainer2)
  trainer2.close()
  np.testing.assert_allclose(resumed, continued, atol=1e-6)


def test_config_round_trip_and_validation(strategy):
  opt = _dts(strategy, "momentum", lr=0.05, m=0.8, delay=4, period=2)
  with strategy.scope():
    clone = DTS.from_config(opt.get_config())
  assert clone.get_config() == opt.get_config()
  assert clone.num_slots == 3
  with pytest.raises(ValueError, match="inner"):
    DTS(keras.optimizers.Adam())
  with pytest.raises(ValueError, match="delay"):
    DTS(keras.optimizers.SGD(), delay=0)
  with pytest.raises(ValueError, match="period"):
    DTS(keras.optimizers.SGD(), period=0)


def test_exchange_is_non_blocking_and_latency_is_pipelined(strategy):
  values = strategy.run(
      lambda: tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32))
  with AsyncAllReduce(strategy, latency_ms=400) as exchange:
    exchange.start(values).result()                  # warm-up: traces the all-reduce
    begin = time.perf_counter()
    first, second = exchange.start(values), exchange.start(values)
    assert time.perf_counter() - begin < 0.2          # start() does not wait
    assert not first.done()
    first.result()
    first_seen = time.perf_counter()
    means = [x.numpy() for x in strategy.experimental_local_results(second.result())]
    second_seen = time.perf_counter()
    elapsed = second_seen - begin
  assert elapsed >= 0.4                               # nothing delivered before its latency
  # In flight together, not 0.8 s in a row: in a row the second would be delivered a whole
  # latency after the first; together, its latency ran during the first's and it follows after
  # its own compute. Timed between the two deliveries, not as the pair's total against a fixed
  # 0.75 s: on a loaded machine the two exchanges' compute alone can pass 0.35 s.
  assert second_seen - first_seen < 0.4, (second_seen - first_seen, elapsed)
  expected = np.mean(np.arange(strategy.num_replicas_in_sync))
  np.testing.assert_allclose(means, expected)
  assert exchange.num_started == 3


def test_train_dts_on_keras_model_with_embedding(strategy, tmp_path):
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 20, size=(512, 2))
  labels = (ids[:, 0] % 2).astype(np.float32)

  def dataset_fn(ctx):
    return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(16)

  def model_fn():
    inputs = keras.Input(shape=(2,), dtype=tf.int64)
    x = keras.layers.Flatten()(keras.layers.Embedding(20, 4)(inputs))
    return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(x))

  eval_fn = lambda: tf.data.Dataset.from_tensor_slices((ids, labels)).batch(128)
  common = dict(delay=2, period=2, strategy=strategy, inner="momentum", learning_rate=0.2,
                eval_dataset_fn=eval_fn, checkpoint_dir=str(tmp_path))
  summary = train_dts(model_fn, dataset_fn, steps=30, **common)
  assert summary["steps"] == 30 and summary["steps_run"] == 30
  assert summary["steps_per_sec"] > 0 and np.isfinite(summary["final_loss"])
  assert summary["eval_auc"] > 0.9
  resumed = train_dts(model_fn, dataset_fn, steps=34, **common)   # restores step 30
  assert resumed["steps"] == 34 and resumed["steps_run"] == 4


def test_latency_benchmark_runs_on_tiny_settings(strategy, tmp_path):
  from benchmarks import dts_latency  # pylint: disable=g-import-not-at-top

  config = dts_latency.Config(steps=6, per_replica_batch=16, latencies=(0.0, 20.0),
                              configs=("sync", "t2p2"), eval_examples=512,
                              output_dir=str(tmp_path))
  results = dts_latency.run(config, strategy)
  assert len(results["runs"]) == 4
  assert set(results["target"]["checks"]) == {"t2p2"}
  by_key = {(r["config"], r["latency_ms"]): r for r in results["runs"]}
  # The trajectory does not depend on timing: same AUC at every latency.
  assert by_key[("t2p2", 0.0)]["eval_auc"] == by_key[("t2p2", 20.0)]["eval_auc"]
  assert (tmp_path / "dts_latency.md").exists() and (tmp_path / "dts_latency.json").exists()


# ------------------------------------------------------------------------------------------------
# Two worker processes, MultiWorkerMirroredStrategy on localhost.

_MW = dict(steps=9, delay=3, period=2, latency_ms=20.0, seed=13)


def _mw_table(steps, seed):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(steps, 2, DIM)).astype(np.float32), rng.normal(size=DIM).astype(
      np.float32)


def multi_worker_scripted(steps, delay, period, latency_ms, seed):
  """Runs in each worker process (see test below); returns the worker's model after each step."""
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  task = strategy.cluster_resolver.task_id
  table, w0 = _mw_table(steps, seed)
  with strategy.scope():
    w = tf.Variable(w0)
  iterator = iter(strategy.distribute_datasets_from_function(
      lambda ctx: tf.data.Dataset.from_tensor_slices(table[:, ctx.input_pipeline_id]).repeat()))
  opt = _dts(strategy, "momentum", delay=delay, period=period)
  history = []
  with DTSTrainer(strategy, opt, [w], lambda c: tf.reduce_sum(w * c),
                  latency_ms=latency_ms, exchange_timeout_s=60) as trainer:
    for _ in range(steps):
      trainer.step(iterator)
      history.append(_copies(strategy, w)[0].tolist())
    trainer.synchronize()
    final = _copies(strategy, w)[0].tolist()
  return {"task": task, "history": history, "final": final,
          "replicas": strategy.num_replicas_in_sync}


def test_multi_worker_mirrored_two_processes():
  results = collective_cluster.run_collective_cluster(
      f"{os.path.abspath(__file__)}:multi_worker_scripted", num_workers=2, kwargs=_MW,
      timeout_s=150, env={"CUDA_VISIBLE_DEVICES": ""})
  table, w0 = _mw_table(_MW["steps"], _MW["seed"])
  table = table.astype(np.float64)
  assert [r["task"] for r in results] == [0, 1]
  for n in range(1, _MW["steps"] + 1):
    ref_w, _ = closed_form(table, w0, n, _MW["delay"], _MW["period"], M)
    got = np.array([r["history"][n - 1] for r in results])
    assert results[0]["replicas"] == 2
    np.testing.assert_allclose(got, ref_w, atol=2e-5, err_msg=f"after {n} steps")
    np.testing.assert_allclose(got.mean(axis=0), sync_sgd(table.mean(axis=1), w0, n, M),
                               atol=2e-5)
  sync = sync_sgd(table.mean(axis=1), w0, _MW["steps"], M)
  for r in results:
    np.testing.assert_allclose(r["final"], sync, atol=2e-5)
