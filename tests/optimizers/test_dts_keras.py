"""DTS as a tf_keras optimizer: `model.compile(optimizer=DTS(SGD(...)))` and `fit` under a
MirroredStrategy, against NumPy references written here, and checkpoints switched between Sync and
DTS.

The loss `sum(y * model(x))` of a bias-free linear model has the gradient `y * x` whatever the
model, so every replica's gradient at every step is known from the data: replica j of step n
trains on row `n * R + j` (fit splits each global batch of R rows over the R replicas in order).
The references: each replica's model from the paper's closed form (Eq. 6, the SPEC invariant),
and synchronous momentum SGD on the replicas' mean gradients, which every replica holds after the
exchanges are drained.
"""


import tf_gba  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads Keras)
import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tf_gba.distribute.dts_training import make_local_mirrored_strategy
from tf_gba.optimizers import DTS

import logical_cpus

LR = 0.1
M = 0.9
DIM = 3
REPLICAS = 3


logical_cpus.configure(4)


@pytest.fixture(scope="module")
def strategy():
  devices = [d.name for d in tf.config.list_logical_devices("CPU")]
  if len(devices) < REPLICAS:
    pytest.skip(f"needs >= {REPLICAS} logical CPU devices; TensorFlow was initialised with fewer")
  return make_local_mirrored_strategy(REPLICAS)   # the process's one strategy over these devices


# ------------------------------------------------------------------------------------------------
# NumPy references.

def _data(steps, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(steps * REPLICAS, DIM)).astype(np.float32)
  y = rng.normal(size=(steps * REPLICAS, 1)).astype(np.float32)
  return x, y, rng.normal(size=(DIM, 1)).astype(np.float32)


def _grads(x, y):
  """grads[n, j]: replica j's gradient at step n, `y * x` of its row."""
  return (y * x).astype(np.float64).reshape(-1, REPLICAS, DIM)


def _closed_form(grads, w0, n, t, p, m):
  """Each replica's model after n steps: the mean replaces grad(i, j) once round(i) is consumed."""
  avg = grads.mean(axis=1)
  out = []
  for j in range(grads.shape[1]):
    w = np.asarray(w0, np.float64).reshape(-1).copy()
    for i in range(n):
      consumed = (i // p) * p + p - 1 + t <= n
      g = avg[i] if consumed else grads[i, j]
      w -= LR * sum(m ** k for k in range(n - i)) * g
    out.append(w)
  return np.array(out)


def _sync(grads, w0, n, m):
  """Synchronous momentum SGD on the mean gradients: (model, SGD's velocity slot)."""
  w, v = np.asarray(w0, np.float64).reshape(-1).copy(), np.zeros(DIM)
  for g in grads.mean(axis=1)[:n]:
    v = m * v - LR * g
    w = w + v
  return w, v


# ------------------------------------------------------------------------------------------------
# Helpers.

def _loss(y_true, y_pred):
  return y_true * y_pred   # gradient wrt the kernel: y * x, independent of the model


def _model(w0):
  return keras.Sequential([
      keras.Input(shape=(DIM,)),
      keras.layers.Dense(1, use_bias=False, kernel_initializer=keras.initializers.Constant(w0))])


def _dataset(x, y, first_step):
  return tf.data.Dataset.from_tensor_slices((x, y)).skip(first_step * REPLICAS).batch(REPLICAS)


def _copies(strategy, var):
  return np.stack([c.numpy().reshape(-1) for c in strategy.experimental_local_results(var)])


class _Recorder(keras.callbacks.Callback):
  """Every replica's kernel after each step (listed after DTS's exchange callback)."""

  def __init__(self, strategy):
    super().__init__()
    self.strategy, self.history = strategy, []

  def on_train_batch_end(self, batch, logs=None):
    self.history.append(_copies(self.strategy, self.model.trainable_variables[0]))


# ------------------------------------------------------------------------------------------------
# Tests.

@pytest.mark.parametrize("momentum,t,p", [(M, 2, 2), (0.0, 3, 1), (M, 1, 3), (M, 4, 2)])
def test_fit_matches_numpy_reference(strategy, momentum, t, p):
  steps = 9
  x, y, w0 = _data(steps, seed=int(10 * t + p))
  grads = _grads(x, y)
  with strategy.scope():
    model = _model(w0)
    opt = DTS(keras.optimizers.SGD(LR, momentum=momentum), delay=t, period=p)
    model.compile(optimizer=opt, loss=_loss)
  recorder = _Recorder(strategy)
  model.fit(_dataset(x, y, 0), epochs=1, steps_per_epoch=steps, verbose=0,
            callbacks=[opt.exchange_callback(), recorder])
  assert int(opt.iterations.numpy()) == steps
  for n in range(1, steps):   # the last step's record is taken before fit's final drain
    np.testing.assert_allclose(recorder.history[n - 1], _closed_form(grads, w0, n, t, p, momentum),
                               atol=2e-5, err_msg=f"after {n} steps")
  # fit drained the exchanges at its end: every replica holds synchronous SGD's model and slot.
  want_w, want_v = _sync(grads, w0, steps, momentum)
  np.testing.assert_allclose(_copies(strategy, model.trainable_variables[0]),
                             np.tile(want_w, (REPLICAS, 1)), atol=2e-5)
  if momentum:
    slot = opt.inner_optimizer.momentums[0]
    np.testing.assert_allclose(_copies(strategy, slot), np.tile(want_v, (REPLICAS, 1)), atol=2e-5)


def test_sync_checkpoint_to_dts_and_back(strategy, tmp_path):
  """Sync (SGD momentum) -> DTS(same SGD) resume -> checkpoint -> Sync resume: one trajectory."""
  first, middle, last = 4, 6, 3
  steps = first + middle + last
  x, y, w0 = _data(steps, seed=3)
  grads = _grads(x, y)

  def sync_model():
    with strategy.scope():
      model = _model(w0)
      model.compile(optimizer=keras.optimizers.SGD(LR, momentum=M), loss=_loss)
    return model

  sync = sync_model()
  sync.fit(_dataset(x, y, 0), epochs=1, steps_per_epoch=first, verbose=0)
  sync_path = tf.train.Checkpoint(model=sync, optimizer=sync.optimizer).write(
      str(tmp_path / "sync"))

  with strategy.scope():
    model = _model(w0)
    dts = DTS(keras.optimizers.SGD(LR, momentum=M), delay=2, period=2)
    model.compile(optimizer=dts, loss=_loss)
    dts.build(model.trainable_variables)
  # DTS's own state is not in a synchronous checkpoint; the model, iterations and slots are.
  tf.train.Checkpoint(model=model, optimizer=dts).read(sync_path).expect_partial()
  assert int(dts.iterations.numpy()) == first
  want_w, want_v = _sync(grads, w0, first, M)
  np.testing.assert_allclose(_copies(strategy, model.trainable_variables[0]),
                             np.tile(want_w, (REPLICAS, 1)), atol=2e-5)
  np.testing.assert_allclose(_copies(strategy, dts.inner_optimizer.momentums[0]),
                             np.tile(want_v, (REPLICAS, 1)), atol=2e-5)
  model.fit(_dataset(x, y, first), epochs=1, steps_per_epoch=middle, verbose=0,
            callbacks=[dts.exchange_callback()])
  want_w, want_v = _sync(grads, w0, first + middle, M)
  np.testing.assert_allclose(_copies(strategy, model.trainable_variables[0]),
                             np.tile(want_w, (REPLICAS, 1)), atol=2e-5)
  dts_path = tf.train.Checkpoint(model=model, optimizer=dts).write(str(tmp_path / "dts"))
  saved = dict(tf.train.list_variables(dts_path))
  sync_saved = dict(tf.train.list_variables(sync_path))
  # Same names for the model and the inner optimizer's variables; DTS adds only its own entry.
  assert set(sync_saved) <= set(saved)
  assert all(n.startswith("optimizer/dts/") for n in set(saved) - set(sync_saved))

  back = sync_model()
  with strategy.scope():  # (built outside the scope, tf_keras SGD stops all-reducing gradients)
    back.optimizer.build(back.trainable_variables)
  tf.train.Checkpoint(model=back, optimizer=back.optimizer).read(dts_path).expect_partial()
  assert int(back.optimizer.iterations.numpy()) == first + middle
  np.testing.assert_allclose(back.optimizer.momentums[0].numpy().reshape(-1), want_v, atol=2e-5)
  back.fit(_dataset(x, y, first + middle), epochs=1, steps_per_epoch=last, verbose=0)
  want_w, _ = _sync(grads, w0, steps, M)
  np.testing.assert_allclose(_copies(strategy, back.trainable_variables[0]),
                             np.tile(want_w, (REPLICAS, 1)), atol=3e-5)


def test_misuse_raises_clear_errors(strategy):
  with pytest.raises(RuntimeError, match=r"strategy\.scope\(\)"):
    DTS(keras.optimizers.SGD(LR, momentum=M), delay=2, period=2)
  outside = keras.optimizers.SGD(LR)
  with strategy.scope():
    with pytest.raises(RuntimeError, match="outside the strategy's scope"):
      DTS(outside)
    with pytest.raises(ValueError, match="must be a tf_keras.optimizers.SGD"):
      DTS(keras.optimizers.Adam(LR))
    with pytest.raises(ValueError, match="constant learning rate"):
      DTS(keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)))
    x, y, w0 = _data(2)
    model = _model(w0)
    opt = DTS(keras.optimizers.SGD(LR, momentum=M), delay=2, period=2)
    model.compile(optimizer=opt, loss=_loss)
  with pytest.raises(RuntimeError, match=r"callbacks=\[optimizer.exchange_callback\(\)\]"):
    model.fit(_dataset(x, y, 0), epochs=1, steps_per_epoch=1, verbose=0)


def test_fit_resumes_a_dts_checkpoint_taken_between_exchanges(strategy, tmp_path):
  """Saved with rounds in flight and replicas apart; restored, fit continues the same trajectory."""
  first, more, t, p = 5, 6, 3, 2
  x, y, w0 = _data(first + more, seed=9)
  grads = _grads(x, y)

  def make():
    with strategy.scope():
      model = _model(w0)
      opt = DTS(keras.optimizers.SGD(LR, momentum=M), delay=t, period=p)
      model.compile(optimizer=opt, loss=_loss)
      opt.build(model.trainable_variables)
    return model, opt

  model, opt = make()
  model.fit(_dataset(x, y, 0), epochs=1, steps_per_epoch=first, verbose=0,
            callbacks=[opt.exchange_callback(synchronize_at_end=False)])
  assert opt.rounds_in_flight(first)
  saved = _copies(strategy, model.trainable_variables[0])
  np.testing.assert_allclose(saved, _closed_form(grads, w0, first, t, p, M), atol=2e-5)
  assert np.ptp(saved, axis=0).max() > 0           # the replicas are apart at the save
  path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "ckpt"))

  restored, opt2 = make()
  tf.train.Checkpoint(model=restored, optimizer=opt2).read(path).assert_consumed()
  restored.fit(_dataset(x, y, first), epochs=1, steps_per_epoch=more, verbose=0,
               callbacks=[opt2.exchange_callback()])
  want_w, _ = _sync(grads, w0, first + more, M)
  np.testing.assert_allclose(_copies(strategy, restored.trainable_variables[0]),
                             np.tile(want_w, (REPLICAS, 1)), atol=2e-5)
