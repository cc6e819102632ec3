"""Tests of tf_gba.optimizers.AdaptiveRevision against NumPy references written here.

Covers: no delay == AdaGrad (independent NumPy AdaGrad, and tf_keras Adagrad as a second
opinion); the paper's delay patterns through the explicit read_state / apply_with_gbar_old API,
for dense variables and embedding tables; the strategy's pre-step reader path; config and
checkpoint round trips; and a real asynchronous run on a local multi-process PS cluster.
"""

import numpy as np
import pytest

import tf_gba  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is used)
import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute import step_context
from tf_gba.optimizers.adaptive_revision import AdaptiveRevision

# alpha is exactly representable: tf_keras keeps the learning rate in a float32 variable.
ALPHA, G0 = 0.25, 1.0


# ------------------------------------------------------------------------------------------------
# NumPy references.

def ref_update(x, gbar, z, zp, alpha, g, gbar_old, use_max=True):
  """Algorithm 1's Update(g, gbar_old) per coordinate (float64); returns (x, gbar, z, zp)."""
  g_bck = gbar - gbar_old
  eta_old = alpha / np.sqrt(zp)
  z = z + g * g + 2.0 * g * g_bck
  zp = np.maximum(z, zp) if use_max else z
  eta = alpha / np.sqrt(zp)
  x = x - eta * g
  x = x + (eta_old - eta) * g_bck
  return x, gbar + g, z, zp


class Problem:
  """A dense vector w and an embedding table E with loss depending on the parameters read:

      L_i = 0.5 * sum(h_i * (w - c_i)^2) + 0.5 * sum_k |E[ids_ik] - t_ik|^2

  ids may repeat within a step (the IndexedSlices gradient then has duplicate indices).
  """

  def __init__(self, n, seed, dim=3, rows=6, width=2, ids_per_step=3):
    rng = np.random.default_rng(seed)
    self.h = rng.uniform(0.5, 2.0, size=(n, dim))
    self.c = rng.normal(size=(n, dim))
    self.ids = rng.integers(0, rows, size=(n, ids_per_step))
    self.t = rng.normal(size=(n, ids_per_step, width))
    self.w0 = rng.normal(size=dim)
    self.e0 = rng.normal(size=(rows, width))

  def dense_grads(self, i, w, e):
    """Gradients of L_i at (w, e), E's as a dense array (duplicates summed)."""
    gw = self.h[i] * (w - self.c[i])
    ge = np.zeros_like(e)
    np.add.at(ge, self.ids[i], e[self.ids[i]] - self.t[i])
    return gw, ge

  def tf_loss(self, i, w, e):
    ids = tf.constant(self.ids[i])
    return (0.5 * tf.reduce_sum(tf.constant(self.h[i], w.dtype) *
                                tf.square(w - tf.constant(self.c[i], w.dtype))) +
            0.5 * tf.reduce_sum(tf.square(tf.gather(e, ids) - tf.constant(self.t[i], e.dtype))))


def ref_adagrad(problem, steps, alpha, g0):
  """Independent AdaGrad: accumulator starts at G0; x -= alpha g / sqrt(acc)."""
  w, e = problem.w0.copy(), problem.e0.copy()
  acc_w, acc_e = np.full_like(w, g0), np.full_like(e, g0)
  for i in range(steps):
    gw, ge = problem.dense_grads(i, w, e)
    acc_w += gw * gw
    acc_e += ge * ge
    w = w - alpha * gw / np.sqrt(acc_w)
    e = e - alpha * ge / np.sqrt(acc_e)
  return w, e


def ref_simulate(problem, events, alpha, g0, use_max=True):
  """Algorithm 1 under a scripted delay pattern; embedding rows not in a step are untouched
  (their gradient is 0, which leaves every part of the state unchanged)."""
  state = {"w": [problem.w0.copy(), np.zeros(3), np.full(3, g0), np.full(3, g0)],
           "e": [problem.e0.copy(), np.zeros_like(problem.e0), np.full_like(problem.e0, g0),
                 np.full_like(problem.e0, g0)]}
  reads = {}
  for kind, i in events:
    if kind == "r":
      reads[i] = {k: (v[0].copy(), v[1].copy()) for k, v in state.items()}
      continue
    r = reads.pop(i)
    gw, ge = problem.dense_grads(i, r["w"][0], r["e"][0])
    state["w"] = list(ref_update(*state["w"], alpha, gw, r["w"][1], use_max))
    touched = np.unique(problem.ids[i])
    new = ref_update(*(s[touched] for s in state["e"]), alpha, ge[touched],
                     r["e"][1][touched], use_max)
    for s, v in zip(state["e"], new):
      s[touched] = v
  return state


def constant_pattern(n, d):
  events = []
  for i in range(n):
    events.append(("r", i))
    if i >= d:
      events.append(("u", i - d))
  return events + [("u", i) for i in range(max(0, n - d), n)]


def minibatch_pattern(n, d):
  b, events = 2 * d + 1, []
  for start in range(0, n, b):
    block = range(start, min(n, start + b))
    events += [("r", i) for i in block] + [("u", i) for i in block]
  return events


def random_pattern(n, d, seed):
  rng = np.random.default_rng(seed)
  delays = rng.integers(0, 2 * d + 1, size=n)
  events, pending = [], []
  for t in range(n):
    events.append(("r", t))
    pending.append((t + delays[t], t))
    pending.sort()
    while pending and pending[0][0] <= t:
      events.append(("u", pending.pop(0)[1]))
  return events + [("u", i) for _, i in pending]


def make_vars(problem, dtype=tf.float64):
  return tf.Variable(problem.w0, dtype=dtype), tf.Variable(problem.e0, dtype=dtype)


def grads_at(problem, i, w, e):
  with tf.GradientTape() as tape:
    loss = problem.tf_loss(i, w, e)
  return tape.gradient(loss, [w, e])


# ------------------------------------------------------------------------------------------------
# No delay == AdaGrad.

@pytest.mark.parametrize("use_max", [True, False])
def test_no_delay_is_adagrad(use_max):
  n = 12
  problem = Problem(n, seed=1)
  w, e = make_vars(problem)
  opt = AdaptiveRevision(alpha=ALPHA, g0=G0, use_max=use_max)
  for i in range(n):
    gw, ge = grads_at(problem, i, w, e)
    assert isinstance(ge, tf.IndexedSlices)
    opt.apply_gradients([(gw, w), (ge, e)])
  want_w, want_e = ref_adagrad(problem, n, ALPHA, G0)
  np.testing.assert_allclose(w.numpy(), want_w, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(e.numpy(), want_e, rtol=1e-12, atol=1e-12)
  assert opt.iterations.numpy() == n

  # Second opinion: tf_keras Adagrad with the same initial accumulator and no epsilon.
  w2, e2 = make_vars(problem)
  adagrad = keras.optimizers.Adagrad(learning_rate=ALPHA, initial_accumulator_value=G0,
                                     epsilon=0.0, jit_compile=False)
  for i in range(n):
    adagrad.apply_gradients(zip(grads_at(problem, i, w2, e2), [w2, e2]))
  np.testing.assert_allclose(w.numpy(), w2.numpy(), rtol=1e-6)
  np.testing.assert_allclose(e.numpy(), e2.numpy(), rtol=1e-6)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32, tf.float64],
                         ids=lambda d: d.name)
def test_every_dtype(dtype):
  n = 4
  problem = Problem(n, seed=2)
  problem.w0 = tf.cast(tf.constant(problem.w0, dtype), tf.float64).numpy()
  problem.e0 = tf.cast(tf.constant(problem.e0, dtype), tf.float64).numpy()
  w, e = make_vars(problem, dtype)
  opt = AdaptiveRevision(alpha=0.25, g0=G0)
  for i in range(n):
    opt.apply_gradients(zip(grads_at(problem, i, w, e), [w, e]))
  for var in (w, e):
    for slot in ("gbar", "z", "z_prime"):
      assert opt.get_slot(var, slot).dtype == dtype
  want_w, want_e = ref_adagrad(problem, n, 0.25, G0)
  rtol = {tf.float16: 2e-2, tf.bfloat16: 1e-1, tf.float32: 1e-5, tf.float64: 1e-12}[dtype]
  np.testing.assert_allclose(tf.cast(w, tf.float64).numpy(), want_w, rtol=rtol, atol=rtol)
  np.testing.assert_allclose(tf.cast(e, tf.float64).numpy(), want_e, rtol=rtol, atol=rtol)


def test_slots_start_at_zero_and_g0():
  w = tf.Variable(tf.ones([3]))
  opt = AdaptiveRevision(g0=2.5)
  opt.build([w])
  np.testing.assert_array_equal(opt.get_slot(w, "gbar").numpy(), np.zeros(3))
  np.testing.assert_array_equal(opt.get_slot(w, "z").numpy(), np.full(3, 2.5))
  np.testing.assert_array_equal(opt.get_slot(w, "z_prime").numpy(), np.full(3, 2.5))
  with pytest.raises(ValueError, match="Unknown slot"):
    opt.get_slot(w, "accumulator")


def test_apply_gradients_in_tf_function_matches_eager():
  n = 6
  problem = Problem(n, seed=3)
  w, e = make_vars(problem)
  opt = AdaptiveRevision(alpha=ALPHA, g0=G0)

  @tf.function
  def step(i_h, i_c, ids, t):
    with tf.GradientTape() as tape:
      loss = (0.5 * tf.reduce_sum(i_h * tf.square(w - i_c)) +
              0.5 * tf.reduce_sum(tf.square(tf.gather(e, ids) - t)))
    opt.apply_gradients(zip(tape.gradient(loss, [w, e]), [w, e]))

  for i in range(n):
    step(problem.h[i], problem.c[i], problem.ids[i], problem.t[i])
  want_w, want_e = ref_adagrad(problem, n, ALPHA, G0)
  np.testing.assert_allclose(w.numpy(), want_w, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(e.numpy(), want_e, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# Delays through the explicit API.

PATTERNS = {
    "constant": lambda n: constant_pattern(n, 3),
    "minibatch": lambda n: minibatch_pattern(n, 2),
    "random": lambda n: random_pattern(n, 3, seed=7),
}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("row_snapshots", [False, True], ids=["full-gbar", "gbar-rows"])
def test_delay_patterns_explicit_api(pattern, row_snapshots):
  n = 24
  problem = Problem(n, seed=4)
  events = PATTERNS[pattern](n)
  w, e = make_vars(problem)
  opt = AdaptiveRevision(alpha=ALPHA, g0=G0)
  reads = {}
  for kind, i in events:
    if kind == "r":
      # The Read: parameters and gbar together. Embedding rows only, or the whole table.
      indices = [None, problem.ids[i]] if row_snapshots else None
      reads[i] = (tf.identity(w), tf.identity(e), opt.read_state([w, e], indices=indices))
      continue
    w_read, e_read, gbar_olds = reads.pop(i)
    # Gradients at the parameters as read (the stale copies are plain tensors).
    w_at, e_at = tf.Variable(w_read), tf.Variable(e_read)
    gw, ge = grads_at(problem, i, w_at, e_at)
    opt.apply_with_gbar_old([(gw, w), (ge, e)], gbar_olds)
  want = ref_simulate(problem, events, ALPHA, G0)
  for var, key in ((w, "w"), (e, "e")):
    got = [var.numpy()] + [opt.get_slot(var, s).numpy() for s in ("gbar", "z", "z_prime")]
    for g, r, name in zip(got, want[key], ("x", "gbar", "z", "z'")):
      np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12, err_msg=f"{key} {name}")
  # The delays changed the result: it is not AdaGrad's.
  assert not np.allclose(w.numpy(), ref_adagrad(problem, n, ALPHA, G0)[0])


def test_use_max_false_follows_z():
  n = 15
  problem = Problem(n, seed=5)
  events = minibatch_pattern(n, 2)
  w, e = make_vars(problem)
  opt = AdaptiveRevision(alpha=ALPHA, g0=5.0, use_max=False)
  reads = {}
  for kind, i in events:
    if kind == "r":
      reads[i] = (tf.identity(w), tf.identity(e), opt.read_state([w, e]))
      continue
    w_read, e_read, gbar_olds = reads.pop(i)
    gw, ge = grads_at(problem, i, tf.Variable(w_read), tf.Variable(e_read))
    opt.apply_with_gbar_old([(gw, w), (ge, e)], gbar_olds)
  want = ref_simulate(problem, events, ALPHA, 5.0, use_max=False)
  np.testing.assert_allclose(w.numpy(), want["w"][0], rtol=1e-10)
  np.testing.assert_allclose(e.numpy(), want["e"][0], rtol=1e-10)
  np.testing.assert_array_equal(opt.get_slot(w, "z").numpy(), opt.get_slot(w, "z_prime").numpy())


def test_row_snapshot_must_cover_the_gradient_rows():
  e = tf.Variable(tf.zeros([5, 2]))
  opt = AdaptiveRevision()
  gbar_old = opt.read_state([e], indices=[[0, 1]])
  grad = tf.IndexedSlices(tf.ones([2, 2]), tf.constant([1, 4]), tf.constant([5, 2]))
  with pytest.raises(tf.errors.InvalidArgumentError, match="has no row for some index"):
    opt.apply_with_gbar_old([(grad, e)], gbar_old)


def test_apply_with_gbar_old_needs_one_per_pair():
  w = tf.Variable(tf.ones([2]))
  opt = AdaptiveRevision()
  with pytest.raises(ValueError, match="pass one per pair"):
    opt.apply_with_gbar_old([(tf.ones([2]), w)], [])


# ------------------------------------------------------------------------------------------------
# The strategy hook: a pre-step reader registered in build, consumed through step_context.

class HookStrategy(tf.distribute.OneDeviceStrategy):
  """A one-device strategy with GBAStrategy's pre-step reader hook (and nothing else)."""

  def __init__(self):
    super().__init__("/cpu:0")
    self.readers = {}

  def register_pre_step_reader(self, name, fn):
    self.readers[name] = fn

  def begin_step(self):
    return step_context.StepInfo(token=None, ticket=None,
                                 reads={k: fn() for k, fn in self.readers.items()})


def test_pre_step_reader_snapshot_is_used():
  n = 10
  problem = Problem(n, seed=6)
  events = constant_pattern(n, 2)
  strategy = HookStrategy()
  with strategy.scope():
    w, e = make_vars(problem)
    opt = AdaptiveRevision(alpha=ALPHA, g0=G0)
    opt.build([w, e])
  assert list(strategy.readers) == [opt.pre_step_reader_name]

  steps = {}
  for kind, i in events:
    if kind == "r":  # the step starts: the strategy runs the readers, the model reads w and e
      steps[i] = (strategy.begin_step(), tf.identity(w), tf.identity(e))
      continue
    info, w_read, e_read = steps.pop(i)
    gw, ge = grads_at(problem, i, tf.Variable(w_read), tf.Variable(e_read))
    with step_context.scope(info):
      strategy.run(lambda gw=gw, ge=ge: opt.apply_gradients([(gw, w), (ge, e)]))
  want = ref_simulate(problem, events, ALPHA, G0)
  np.testing.assert_allclose(w.numpy(), want["w"][0], rtol=1e-10)
  np.testing.assert_allclose(e.numpy(), want["e"][0], rtol=1e-10)
  np.testing.assert_allclose(opt.get_slot(e, "z").numpy(), want["e"][2], rtol=1e-10)


def test_without_snapshot_falls_back_to_adagrad():
  """A step with a StepInfo but no snapshot (optimizer built too late) applies AdaGrad."""
  n = 5
  problem = Problem(n, seed=7)
  w, e = make_vars(problem)
  opt = AdaptiveRevision(alpha=ALPHA, g0=G0)
  for i in range(n):
    with step_context.scope(step_context.StepInfo(token=None, ticket=None, reads={})):
      opt.apply_gradients(zip(grads_at(problem, i, w, e), [w, e]))
  want_w, want_e = ref_adagrad(problem, n, ALPHA, G0)
  np.testing.assert_allclose(w.numpy(), want_w, rtol=1e-12)
  np.testing.assert_allclose(e.numpy(), want_e, rtol=1e-12)


# ------------------------------------------------------------------------------------------------
# Config and checkpoints.

def test_config_round_trip():
  opt = AdaptiveRevision(alpha=0.05, g0=3.0, use_max=False, name="ar", clipnorm=2.0)
  config = opt.get_config()
  assert (config["alpha"], config["g0"], config["use_max"], config["name"]) == (
      pytest.approx(0.05), 3.0, False, "ar")
  assert config["jit_compile"] is False
  again = AdaptiveRevision.from_config(config)
  assert again.get_config() == config
  # Through Keras serialisation, which finds the class by its registered name.
  restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
  assert isinstance(restored, AdaptiveRevision) and restored.get_config() == config


def test_config_round_trip_with_schedule():
  schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
  opt = AdaptiveRevision(alpha=schedule)
  again = AdaptiveRevision.from_config(opt.get_config())
  assert isinstance(again._learning_rate, keras.optimizers.schedules.ExponentialDecay)
  assert again.get_config() == opt.get_config()


def test_bad_arguments():
  with pytest.raises(ValueError, match="g0"):
    AdaptiveRevision(g0=0.0)
  with pytest.raises(ValueError, match="XLA"):
    AdaptiveRevision(jit_compile=True)
  with pytest.raises(TypeError, match="alpha"):
    AdaptiveRevision(learning_rate=0.1)


def _train_with_delay(problem, opt, w, e, steps, start=0):
  reads = []
  for i in range(start, start + steps):
    reads.append((i, tf.identity(w), tf.identity(e), opt.read_state([w, e])))
    if len(reads) > 2:   # constant delay 2
      j, w_read, e_read, gbar_olds = reads.pop(0)
      gw, ge = grads_at(problem, j, tf.Variable(w_read), tf.Variable(e_read))
      opt.apply_with_gbar_old([(gw, w), (ge, e)], gbar_olds)


@pytest.mark.parametrize("build_before_restore", [True, False])
def test_checkpoint_round_trip(tmp_path, build_before_restore):
  problem = Problem(12, seed=8)
  w, e = make_vars(problem)
  opt = AdaptiveRevision(alpha=ALPHA, g0=G0)
  _train_with_delay(problem, opt, w, e, 6)
  path = tf.train.Checkpoint(optimizer=opt, w=w, e=e).save(str(tmp_path / "ckpt"))

  w2, e2 = tf.Variable(tf.zeros_like(w)), tf.Variable(tf.zeros_like(e))
  opt2 = AdaptiveRevision(alpha=ALPHA, g0=G0)
  if build_before_restore:
    opt2.build([w2, e2])
    tf.train.Checkpoint(optimizer=opt2, w=w2, e=e2).restore(path).assert_consumed()
  else:  # deferred restoration: the slots are restored when build creates them
    status = tf.train.Checkpoint(optimizer=opt2, w=w2, e=e2).restore(path)
    opt2.build([w2, e2])
    status.assert_consumed()
  for a, b in ((w, w2), (e, e2)):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    for slot in ("gbar", "z", "z_prime"):
      np.testing.assert_array_equal(opt.get_slot(a, slot).numpy(), opt2.get_slot(b, slot).numpy())
  assert opt2.iterations.numpy() == opt.iterations.numpy()
  # Both continue identically.
  _train_with_delay(problem, opt, w, e, 4, start=6)
  _train_with_delay(problem, opt2, w2, e2, 4, start=6)
  np.testing.assert_array_equal(w.numpy(), w2.numpy())
  np.testing.assert_array_equal(e.numpy(), e2.numpy())


def test_keras_model_fit():
  rng = np.random.default_rng(9)
  ids = rng.integers(0, 20, size=(256, 3))
  labels = (ids.sum(axis=1) % 2).astype(np.float32)
  model = keras.Sequential([keras.Input(shape=(3,), dtype="int64"),
                            keras.layers.Embedding(20, 4), keras.layers.Flatten(),
                            keras.layers.Dense(1, activation="sigmoid")])
  model.compile(optimizer=AdaptiveRevision(alpha=0.2), loss="binary_crossentropy")
  history = model.fit(ids, labels, batch_size=32, epochs=3, verbose=0)
  assert np.all(np.isfinite(history.history["loss"]))
  assert history.history["loss"][-1] < history.history["loss"][0]


# ------------------------------------------------------------------------------------------------
# A real asynchronous run: one parameter server and two worker processes.

def _read_op_behind(tensor):
  """The ReadVariableOp a tensor was taken from, through identities and row gathers."""
  op = tensor.op
  while op.type in ("Identity", "GatherV2"):
    op = op.inputs[0].op
  return op


def test_async_multi_process_cluster():
  """Two workers update concurrently through GBAStrategy(mode="async").

  With constant gradients (G per coordinate) the final state does not depend on the order the
  updates arrive in: after S updates gbar = S G and z = G0 + G^2 (S^2 - 2 sum_t r_t), where
  r_t G is the gbar snapshot step t read before its forward pass (the update applied t-th sees
  gbar = (t - 1) G, so g_bck = (t - 1 - r_t) G). Each step returns its snapshot, so the test
  checks that every update used exactly the snapshot its step read, atomically.
  """
  distribute = pytest.importorskip("tf_gba.distribute")
  steps, c_w, c_e, ids = 24, 0.5, 0.25, [1, 3, 3]
  with distribute.LocalCluster(num_ps=1, num_workers=2) as cluster:
    strategy = distribute.GBAStrategy(cluster.resolver(), mode="async")
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
      w = tf.Variable(tf.zeros([4]))
      e = tf.Variable(tf.zeros([6, 2]))
      opt = AdaptiveRevision(alpha=0.1, g0=G0)
      opt.build([w, e])
    assert opt.pre_step_reader_name is not None
    snapshot_tensors = []

    @tf.function
    def step():

      def replica_fn():
        with tf.GradientTape() as tape:
          loss = c_w * tf.reduce_sum(w) + c_e * tf.reduce_sum(tf.gather(e, ids))
        opt.apply_gradients(zip(tape.gradient(loss, [w, e]), [w, e]))
        snapshot = step_context.current().reads[opt.pre_step_reader_name]
        snapshot_tensors[:] = snapshot
        return snapshot[0], tf.gather(snapshot[1], [1, 3])

      return strategy.run(replica_fn)

    # The updates must take gbar_old from the step's pre-step snapshot, not from a read at apply
    # time (which is AdaGrad; the optimizer's update runs in the strategy's merge_call, on
    # another thread than the step).
    graph = step.get_concrete_function().graph
    applies = {op.type: op for op in graph.get_operations() if "AdaptiveRevision" in op.type}
    assert set(applies) == {"GBA>ResourceApplyAdaptiveRevision",
                            "GBA>ResourceSparseApplyAdaptiveRevision"}
    snapshot_reads = {_read_op_behind(t).name for t in snapshot_tensors}
    assert len(snapshot_reads) == 2
    assert {_read_op_behind(applies["GBA>ResourceApplyAdaptiveRevision"].inputs[6]).name,
            _read_op_behind(applies["GBA>ResourceSparseApplyAdaptiveRevision"].inputs[7]).name
            } == snapshot_reads

    results = [coordinator.schedule(step) for _ in range(steps)]
    coordinator.join()
    snaps_w = np.stack([r.fetch()[0] for r in results])   # [S, 4]
    snaps_e = np.stack([r.fetch()[1] for r in results])   # [S, 2, 2]: rows 1 and 3
    final = {}
    for var, prefix in ((w, "w"), (e, "e")):
      for slot in ("gbar", "z", "z_prime"):
        final[f"{prefix}_{slot}"] = opt.get_slot(var, slot).numpy()
    w_value = w.numpy()

  s = steps
  for grad, snaps, gbar, z, zp in (
      (np.full(4, c_w), snaps_w, final["w_gbar"], final["w_z"], final["w_z_prime"]),
      (np.array([[c_e, c_e], [2 * c_e, 2 * c_e]]), snaps_e, final["e_gbar"][[1, 3]],
       final["e_z"][[1, 3]], final["e_z_prime"][[1, 3]])):
    np.testing.assert_array_equal(gbar, s * grad)
    sum_r = snaps.sum(axis=0) / grad
    assert np.all(sum_r <= s * (s - 1) / 2)   # no step read an update that came after it
    np.testing.assert_allclose(z, G0 + grad * grad * (s * s - 2 * sum_r), rtol=1e-6)
    np.testing.assert_array_equal(zp, z)
  np.testing.assert_array_equal(final["e_gbar"][[0, 2, 4, 5]], 0.0)   # rows never looked up
  assert np.all(np.isfinite(w_value)) and np.all(w_value < 0)


# ------------------------------------------------------------------------------------------------
# The delay benchmark, on tiny data.

def test_delay_benchmark_runs(tmp_path):
  from benchmarks import adaptive_revision_delay as bench  # pylint: disable=g-import-not-at-top
  results = bench.run(bench.Config(num_examples=300, delays=(0, 5), patterns=("constant",),
                                   alpha_grid=(0.1, 0.2), output_dir=str(tmp_path), plot=False))
  assert {(r["delay"], r["algorithm"]) for r in results["runs"]} == {
      (0, "adaptive_revision"), (0, "adagrad"), (5, "adaptive_revision"), (5, "adagrad")}
  by_key = {(r["delay"], r["algorithm"]): r for r in results["runs"]}
  # No delay: AdaptiveRevision and tf_keras Adagrad are the same algorithm.
  assert by_key[(0, "adaptive_revision")]["logloss"] == pytest.approx(
      by_key[(0, "adagrad")]["logloss"], rel=1e-5)
  assert (tmp_path / "results.md").exists() and (tmp_path / "results.json").exists()
  assert "constant" in results["target"]
