"""Sync (all-reduce) with hash rows on real worker processes, against a NumPy reference.

Two MultiWorkerMirroredStrategy workers on 127.0.0.1 each hold a whole HashEmbedding table. Each
step they look up their own batch (the union of both batches is inserted and counted on both),
then `tf_gba.optimizers.hash_rows.apply_replicated` all-gathers the (key, gradient row) pairs,
sums them per key and applies the table's fused SGD, Adagrad or LazyAdam, while a dense bias
takes Keras' all-reduce. The reference below recomputes the same four steps in float64 NumPy
from the batches and the tables' initial rows: per key, the replicas' gradients (of loss / N)
summed, a key missing from one replica's batch counting as zero, then each optimizer's formula;
with a TTL, the rows the table evicts at its eviction interval.
"""

import os

import tf_gba  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads Keras)
import numpy as np
import pytest
import tensorflow as tf

from tf_gba.distribute import collective_cluster
from tf_gba.ops import hash_table_ops

DIM, FIELDS, BATCH, STEPS, SEED = 3, 2, 4, 4, 11
LR = 0.1
KINDS = ("sgd", "adagrad", "adam", "adagrad_admission", "sgd_ttl")
# "adagrad_admission": Adagrad on a table with min_frequency=2 (a key gets its row at its second
# training lookup; before, it reads the zero row and its gradients are dropped).
MIN_FREQUENCY = {"adagrad_admission": 2}
# "sgd_ttl": SGD on a table with ttl_steps=1 that evicts every 3 steps: after step 2, the keys
# that step 2 did not look up and step 1 last did (8, 1001) go; one of them (8) step 3 looks up
# again, and it starts from its initial row.
TTL_STEPS, EVICTION_INTERVAL = {"sgd_ttl": 1}, 3
_ENV = {"CUDA_VISIBLE_DEVICES": ""}
_TARGET = f"{os.path.abspath(__file__)}:worker"
# Per-field weights of the prediction: pred_b = sum_f row(ids[b, f]) . W[f] + bias.
W = np.array([[1.0, -0.5, 0.25], [0.5, 1.0, -1.0]])


def batch(step: int, replica: int):
  """Replica `replica`'s ids and targets at `step`: ids from a pool of 7, so that keys repeat in
  a batch, some are in both replicas' batches and some in one only, and one (1000 + step) is
  drawn at this step only."""
  rng = np.random.RandomState(1000 * step + replica)
  ids = rng.choice([7, 8, 9, 2**40 + 1, -5, 10 + replica * 100, 1000 + step],
                   size=(BATCH, FIELDS))
  return ids.astype(np.int64), rng.uniform(-1, 1, size=BATCH)


def worker(num_steps: int) -> dict:
  """One MWMS worker: for each optimizer kind, a fresh model trained `num_steps` steps as the
  sync job trains (loss / N, hash rows through apply_replicated, the rest through Keras)."""
  import tf_keras as keras  # pylint: disable=g-import-not-at-top
  from tf_gba.layers import HashEmbedding  # pylint: disable=g-import-not-at-top
  from tf_gba.optimizers import hash_rows  # pylint: disable=g-import-not-at-top

  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  n = strategy.num_replicas_in_sync
  task = int(strategy.cluster_resolver.task_id)
  out = {"task": task}
  for kind in KINDS:
    with strategy.scope():
      emb = HashEmbedding(DIM, seed=SEED, name=f"hash_{kind}",
                          min_frequency=MIN_FREQUENCY.get(kind, 0),
                          ttl_steps=TTL_STEPS.get(kind, 0), eviction_interval=EVICTION_INTERVAL)
      bias = tf.Variable(0.0, name="bias")
      optimizer = {"sgd": keras.optimizers.SGD(LR), "adagrad": keras.optimizers.Adagrad(LR),
                   "adam": keras.optimizers.Adam(LR),
                   "adagrad_admission": keras.optimizers.Adagrad(LR),
                   "sgd_ttl": keras.optimizers.SGD(LR)}[kind]
      emb.build((None, FIELDS))
    weights = tf.constant(W, tf.float32)

    def replica_step(ids, targets, emb=emb, bias=bias, optimizer=optimizer, weights=weights):
      variables = [emb.hash_anchor, bias]
      with tf.GradientTape() as tape:
        rows = emb(ids, training=True)  # [B, F, D]
        pred = tf.reduce_sum(rows * weights, axis=[1, 2]) + bias
        loss = tf.reduce_mean(0.5 * tf.square(pred - targets)) / n
      grads = tape.gradient(loss, variables)
      hashed, dense = hash_rows.split_hash_gradients(zip(grads, variables))
      with tf.control_dependencies([hash_rows.apply_replicated(optimizer, hashed)]):
        optimizer.apply_gradients(dense)

    step_fn = tf.function(lambda i, t, f=replica_step: strategy.run(f, args=(i, t)))
    for step in range(num_steps):
      ids, targets = batch(step, task)
      step_fn(tf.constant(ids), tf.constant(targets, tf.float32))
    rows = emb.table.export()
    order = np.argsort(rows["keys"].numpy())
    out[kind] = {f: rows[f].numpy()[order].tolist() for f in hash_table_ops.EXPORT_FIELDS}
    pending = np.argsort(rows["pending_keys"].numpy())
    out[kind].update({f: rows[f].numpy()[pending].tolist()
                      for f in ("pending_keys", "pending_counts")})
    out[kind]["bias"] = float(bias.numpy())
    out[kind]["iterations"] = int(optimizer.iterations.numpy())
  return out


def initial_rows(keys) -> np.ndarray:
  """The table's first value of each key (a function of (seed, key) only)."""
  table = hash_table_ops.ShardedHashTable(DIM, seed=SEED)
  return table.find(tf.constant(keys, tf.int64)).numpy().astype(np.float64)


def reference(kind: str, num_steps: int, replicas=(0, 1)) -> dict:
  """float64: rows, slots, frequency, last_seen, pending counts, bias after `num_steps` steps."""
  n = len(replicas)
  min_frequency = MIN_FREQUENCY.get(kind, 0)
  ttl = TTL_STEPS.get(kind, 0)
  seen = sorted({int(k) for s in range(num_steps) for r in replicas
                 for k in batch(s, r)[0].flat})
  initial = dict(zip(seen, initial_rows(seen)))
  rows, slots, counts, last_seen = {}, {}, {}, {}
  bias, acc_b, m_b, v_b = 0.0, 0.1, 0.0, 0.0
  eps = 1e-7
  for step in range(num_steps):
    # The training lookup: each key of the union of the replicas' batches, counted once.
    for k in {int(k) for r in replicas for k in batch(step, r)[0].flat}:
      counts[k] = counts.get(k, 0) + 1
      last_seen[k] = step
      if k not in rows and counts[k] >= min_frequency:  # inserted (admitted) now
        rows[k] = initial[k]
        slots[k] = ([np.full(DIM, 0.1)] if "adagrad" in kind  # Keras' initial accumulator
                    else [np.zeros(DIM), np.zeros(DIM)])
    grads, bias_grad = {}, 0.0
    for r in replicas:
      ids, targets = batch(step, r)
      row = lambda k: rows.get(int(k), np.zeros(DIM))  # not admitted: the zero row
      pred = np.array([sum(row(ids[b, f]) @ W[f] for f in range(FIELDS))
                       for b in range(BATCH)]) + bias
      err = (pred - targets) / BATCH / n  # d(loss / N) / d pred_b
      for b in range(BATCH):
        for f in range(FIELDS):
          k = int(ids[b, f])
          grads[k] = grads.get(k, np.zeros(DIM)) + err[b] * W[f]
      bias_grad += err.sum()
    t = step + 1
    for k, g in grads.items():
      if k not in rows:
        continue  # no row (admission): the gradient is dropped
      if kind.startswith("sgd"):
        rows[k] = rows[k] - LR * g
      elif "adagrad" in kind:
        slots[k][0] = slots[k][0] + g * g
        rows[k] = rows[k] - LR * g / np.sqrt(slots[k][0] + eps)
      else:  # LazyAdam: only the rows in the step's keys move
        m, v = slots[k]
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        slots[k] = [m, v]
        alpha = LR * np.sqrt(1 - 0.999**t) / (1 - 0.9**t)
        rows[k] = rows[k] - alpha * m / (np.sqrt(v) + eps)
    # TTL eviction after the apply, at the table's step t: a row not looked up for more than
    # `ttl` steps goes with its slots and counts.
    if ttl and t % EVICTION_INTERVAL == 0:
      for k in [k for k in rows if t - last_seen[k] > ttl]:
        del rows[k], slots[k], counts[k], last_seen[k]
    # The bias: Keras' optimizer on the all-reduced (summed) gradient.
    if kind.startswith("sgd"):
      bias -= LR * bias_grad
    elif "adagrad" in kind:
      acc_b += bias_grad**2
      bias -= LR * bias_grad / np.sqrt(acc_b + eps)
    else:
      m_b, v_b = 0.9 * m_b + 0.1 * bias_grad, 0.999 * v_b + 0.001 * bias_grad**2
      bias -= LR * np.sqrt(1 - 0.999**t) / (1 - 0.9**t) * m_b / (np.sqrt(v_b) + eps)
  keys = sorted(rows)
  num_slots = hash_table_ops.NUM_SLOTS["adagrad" if "adagrad" in kind else kind.split("_")[0]]
  pending = sorted(set(counts) - set(rows))
  return {"keys": np.array(keys), "values": np.array([rows[k] for k in keys]),
          "slots": np.array([np.concatenate(slots[k][:num_slots]) if num_slots else []
                             for k in keys]).reshape(len(keys), num_slots * DIM),
          "frequency": np.array([counts[k] for k in keys]),
          "last_seen": np.array([last_seen[k] for k in keys]), "bias": bias,
          "pending_keys": np.array(pending, np.int64),
          "pending_counts": np.array([counts[k] for k in pending], np.int64)}


@pytest.fixture(scope="module")
def results():
  return collective_cluster.run_collective_cluster(
      _TARGET, num_workers=2, kwargs={"num_steps": STEPS}, timeout_s=240, env=_ENV)


def test_the_batches_overlap_partly():
  """The reference exercises what it claims: shared keys, one-replica keys, repeats."""
  for step in range(STEPS):
    a, b = (set(batch(step, r)[0].flat) for r in (0, 1))
    assert a & b and a - b and b - a
    assert len(a) < BATCH * FIELDS


@pytest.mark.parametrize("kind", KINDS)
def test_all_gathered_update_matches_numpy(results, kind):
  ref = reference(kind, STEPS)
  for r in results:
    got = {f: np.array(v) for f, v in r[kind].items() if f != "bias"}
    assert r[kind]["iterations"] == STEPS
    np.testing.assert_array_equal(got["keys"], ref["keys"])
    np.testing.assert_array_equal(got["pending_keys"], ref["pending_keys"])
    np.testing.assert_array_equal(got["pending_counts"], ref["pending_counts"])
    # Every key of either replica's batches has its row on both, counted once per step.
    np.testing.assert_array_equal(got["frequency"], ref["frequency"])
    np.testing.assert_array_equal(got["last_seen"], ref["last_seen"])
    np.testing.assert_allclose(got["values"], ref["values"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["slots"].reshape(ref["slots"].shape), ref["slots"],
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(r[kind]["bias"], ref["bias"], rtol=1e-5, atol=1e-6)
  # Bit-identical tables on both workers.
  assert results[0][kind] == results[1][kind]
  # The comparison can tell: one replica's rows alone (no all-gather) are far off.
  alone = reference(kind, STEPS, replicas=(0,))
  shared = np.isin(ref["keys"], alone["keys"])
  assert np.max(np.abs(np.array(results[0][kind]["values"])[shared] -
                       alone["values"][np.isin(alone["keys"], ref["keys"])])) > 1e-3


def test_admission_counts_each_key_once_per_step():
  """With min_frequency=2 the reference admits only keys looked up in both steps: a key in both
  replicas' batches of one step is counted once, not admitted (a per-replica count would)."""
  ref = reference("adagrad_admission", STEPS)
  assert len(ref["keys"]) and len(ref["pending_keys"])
  # 1001: in both replicas' batches of step 1 and of no other step.
  assert all(1001 in batch(1, r)[0] for r in (0, 1))
  assert 1001 in ref["pending_keys"].tolist() and 1001 not in ref["keys"].tolist()


def test_eviction_under_sync_drops_rows_and_a_returning_key_starts_again():
  """The TTL reference evicts after step 2 what it claims, and an evicted key returns at step 3
  (so the test above compares a re-initialised row, not only a missing one)."""
  keys = lambda step: {int(k) for r in (0, 1) for k in batch(step, r)[0].flat}
  evicted = (keys(0) | keys(1)) - keys(2)
  assert evicted == {8, 1001} and evicted & keys(3) == {8}
  ref, kept = reference("sgd_ttl", STEPS), reference("sgd", STEPS)
  assert 1001 not in ref["keys"].tolist() and 1001 in kept["keys"].tolist()
  back = sorted(evicted & keys(3))
  at = lambda r, k: r["values"][r["keys"].tolist().index(k)]
  for k in back:  # counted from its return only, and moved from its initial row by step 3 alone
    assert ref["frequency"][ref["keys"].tolist().index(k)] == 1
    assert not np.allclose(at(ref, k), at(kept, k))
