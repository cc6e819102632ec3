"""ShadowSync's rules (S-EASGD, S-MA, S-BMUF) against NumPy references of SPEC section 4.

Three replicas train with fixed gradient sequences (local SGD) and synchronise on a fixed
schedule; every replica is compared with the reference one by one after every event, not only
their average.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_gba.optimizers import shadow_sync

LR = 0.1
SHAPES = [(3, 2), (2,)]
N = 3


def grads(seed, steps):
  rng = np.random.default_rng(seed)
  return [[[rng.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(N)]
          for _ in range(steps)]


def init(seed=0):
  rng = np.random.default_rng(100 + seed)
  # Replicas start apart, so a sync that did nothing would show.
  return [[rng.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(N)]


def make_vars(values):
  return [[tf.Variable(v) for v in r] for r in values]


def local_step(vars_, g):
  for v, gk in zip(vars_, g):
    v.assign_sub(LR * gk)


def assert_replicas(vars_, ref, what):
  for i, (r_tf, r_np) in enumerate(zip(vars_, ref)):
    for k, (a, b) in enumerate(zip(r_tf, r_np)):
      np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6,
                                 err_msg=f"{what}: replica {i} variable {k}")


# ---- NumPy references (written from SPEC section 4, independent of the module) ------------------
def np_easgd(w_ps, w_i, a):
  w_ps = [(1 - a) * p + a * w for p, w in zip(w_ps, w_i)]
  w_i = [(1 - a) * w + a * p for w, p in zip(w_i, w_ps)]
  return w_ps, w_i


def np_ma(reps, a):
  g = [np.mean([r[k] for r in reps], axis=0) for k in range(len(SHAPES))]
  return [[(1 - a) * w + a * gk for w, gk in zip(r, g)] for r in reps]


def np_bmuf(reps, w_global, v, eta, a, mu, nesterov):
  w_c = [np.mean([r[k] for r in reps], axis=0) for k in range(len(SHAPES))]
  v = [mu * vk + eta * (c - g) for vk, c, g in zip(v, w_c, w_global)]
  w_global = [g + vk for g, vk in zip(w_global, v)]
  target = [g + mu * vk for g, vk in zip(w_global, v)] if nesterov else w_global
  return [[(1 - a) * w + a * t for w, t in zip(r, target)] for r in reps], w_global, v


# ---- S-EASGD ------------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [0.3, 1.0])
def test_easgd_sequence(alpha):
  gs = grads(1, 6)
  ref = init()
  ref_ps = [np.zeros(s, np.float32) for s in SHAPES]
  reps = make_vars(ref)
  ps = [tf.Variable(p) for p in ref_ps]
  # Workers sync one at a time, in an irregular order, between local steps.
  schedule = {1: [0], 2: [2, 1], 4: [1], 5: [0, 2, 1]}
  for step, g in enumerate(gs):
    for i in range(N):
      local_step(reps[i], g[i])
      ref[i] = [w - LR * gk for w, gk in zip(ref[i], g[i])]
    for i in schedule.get(step, []):
      snap = shadow_sync.read(reps[i])
      new_ps = shadow_sync.apply_easgd_ps(ps, snap, alpha)
      shadow_sync.pull(reps[i], new_ps, snap, alpha)
      ref_ps, ref[i] = np_easgd(ref_ps, ref[i], alpha)
      assert_replicas(reps, ref, f"easgd step {step} after worker {i}")
      assert_replicas([ps], [ref_ps], "easgd sync PS")


def test_easgd_pure_values():
  ref = init(2)
  w_ps = [np.ones(s, np.float32) for s in SHAPES]
  new_ps, new_w = shadow_sync.easgd_values(w_ps, ref[0], 0.25)
  r_ps, r_w = np_easgd(w_ps, ref[0], 0.25)
  assert_replicas([new_ps, new_w], [r_ps, r_w], "easgd values")


def test_pull_keeps_local_steps_made_during_the_sync():
  """The training thread steps between the synchroniser's read and its pull: the step is kept."""
  ref = init(3)
  reps = make_vars(ref)
  ps = [tf.Variable(np.zeros(s, np.float32)) for s in SHAPES]
  snap = shadow_sync.read(reps[0])
  g = grads(4, 1)[0][0]
  local_step(reps[0], g)  # concurrent local step
  new_ps = shadow_sync.apply_easgd_ps(ps, snap, 0.5)
  shadow_sync.pull(reps[0], new_ps, snap, 0.5)
  r_ps, r_w = np_easgd([np.zeros(s, np.float32) for s in SHAPES], ref[0], 0.5)
  expect = [w - LR * gk for w, gk in zip(r_w, g)]
  assert_replicas([reps[0]], [expect], "pull with a concurrent step")


# ---- S-MA ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_ma_sequence(alpha):
  gs = grads(5, 7)
  ref = init(5)
  reps = make_vars(ref)
  for step, g in enumerate(gs):
    for i in range(N):
      local_step(reps[i], g[i])
      ref[i] = [w - LR * gk for w, gk in zip(ref[i], g[i])]
    if step % 3 == 2:
      snaps = [shadow_sync.read(r) for r in reps]
      w_g = shadow_sync.mean_values(snaps)
      for r, s in zip(reps, snaps):
        shadow_sync.pull(r, w_g, s, alpha)
      ref = np_ma(ref, alpha)
      assert_replicas(reps, ref, f"ma step {step}")
      if alpha == 1.0:  # right after a full pull every replica is the mean
        for r in reps[1:]:
          for a, b in zip(r, reps[0]):
            np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)


def test_ma_pure_values():
  ref = init(6)
  got = shadow_sync.ma_values(ref, 0.3)
  assert_replicas(got, np_ma(ref, 0.3), "ma values")


# ---- S-BMUF -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mu,nesterov", [(0.0, False), (0.5, False), (0.5, True)])
def test_bmuf_sequence(mu, nesterov):
  eta, alpha = 0.8, 0.6
  gs = grads(7, 8)
  ref = init(7)
  reps = make_vars(ref)
  ref_g = [np.mean([r[k] for r in ref], axis=0) for k in range(len(SHAPES))]
  ref_v = [np.zeros(s, np.float32) for s in SHAPES]
  w_global = [tf.Variable(x) for x in ref_g]
  v = [tf.Variable(x) for x in ref_v]
  for step, g in enumerate(gs):
    for i in range(N):
      local_step(reps[i], g[i])
      ref[i] = [w - LR * gk for w, gk in zip(ref[i], g[i])]
    if step % 2 == 1:
      snaps = [shadow_sync.read(r) for r in reps]
      target = shadow_sync.apply_bmuf_global(w_global, v, shadow_sync.mean_values(snaps), eta,
                                             mu, nesterov)
      for r, s in zip(reps, snaps):
        shadow_sync.pull(r, target, s, alpha)
      ref, ref_g, ref_v = np_bmuf(ref, ref_g, ref_v, eta, alpha, mu, nesterov)
      assert_replicas(reps, ref, f"bmuf step {step}")
      assert_replicas([w_global, v], [ref_g, ref_v], f"bmuf global/momentum step {step}")


def test_bmuf_pure_values():
  ref = init(8)
  w_g = [np.ones(s, np.float32) for s in SHAPES]
  v0 = [np.full(s, 0.2, np.float32) for s in SHAPES]
  got, g, v = shadow_sync.bmuf_values(ref, w_g, v0, 0.7, 0.4, 0.9, True)
  r, rg, rv = np_bmuf(ref, w_g, v0, 0.7, 0.4, 0.9, True)
  assert_replicas(got + [g, v], r + [rg, rv], "bmuf values")


def test_bad_parameters():
  with pytest.raises(ValueError, match="alpha must be in"):
    shadow_sync.ma_values(init(), 1.5)
  with pytest.raises(ValueError, match="block momentum"):
    shadow_sync.bmuf_global_values([1.0], [0.0], [0.0], 1.0, momentum=1.0)
  with pytest.raises(ValueError, match="step size eta"):
    shadow_sync.bmuf_global_values([1.0], [0.0], [0.0], 0.0)
