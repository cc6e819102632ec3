"""ASGD without gradient delay (SPEC section 5, seed 003 Algorithms 1 and 2) against NumPy
references written from the pseudo-code, on fixed gradient sequences and a fixed schedule of
events; every worker's model is compared one by one after every event."""

import numpy as np
import pytest
import tensorflow as tf

from tf_gba.optimizers import asgd_nodelay

LR = 0.05
SHAPES = [(2, 2), (3,)]


def gradient(w, i):
  """The fixed gradient of worker w's i-th local step (independent of x: a fixed sequence)."""
  rng = np.random.default_rng(1000 * w + i)
  return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


class RefWorker:
  """Algorithm 1's worker, literally (x, x_init, i, i_init, s), with SPEC's rebase."""

  def __init__(self, tau):
    self.tau = tau
    self.x = [np.zeros(s, np.float32) for s in SHAPES]
    self.x_init = [np.zeros(s, np.float32) for s in SHAPES]
    self.i = self.i_init = 0
    self.s = tau

  def step(self, g):
    assert self.s < self.tau
    self.x = [a - LR * b for a, b in zip(self.x, g)]
    self.i += 1
    self.s += 1

  def transfer(self):
    d = [a - b for a, b in zip(self.x, self.x_init)]
    self.x_init = [a.copy() for a in self.x]
    self.i_init = self.i
    return d

  def receive(self, ps):
    since_sent = [a - b for a, b in zip(self.x, self.x_init)]
    self.x_init = [p.copy() for p in ps]
    self.x = [p + d for p, d in zip(ps, since_sent)]
    self.s = self.i - self.i_init


def tf_step(worker, g):
  for v, gk in zip(worker.x, g):
    v.assign_sub(LR * gk)
  worker.note_step()


def check(workers, refs, master, ref_ps, what):
  for w, (a, b) in enumerate(zip(workers, refs)):
    for k in range(len(SHAPES)):
      np.testing.assert_allclose(a.x[k].numpy(), b.x[k], rtol=1e-5, atol=1e-6,
                                 err_msg=f"{what}: worker {w} variable {k}")
    assert a.staleness == b.s, f"{what}: worker {w} staleness"
  for k in range(len(SHAPES)):
    np.testing.assert_allclose(master.ps_x[k].numpy(), ref_ps[k], rtol=1e-5, atol=1e-6,
                               err_msg=f"{what}: PS variable {k}")


@pytest.mark.parametrize("tau", [1, 3])
def test_algorithm1_schedule(tau):
  n = 3
  rng = np.random.default_rng(tau)
  ps0 = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
  master = asgd_nodelay.AsgdMaster([tf.Variable(p) for p in ps0])
  workers = [asgd_nodelay.AsgdWorker([tf.Variable(np.zeros(s, np.float32)) for s in SHAPES],
                                     tau, name=f"w{w}") for w in range(n)]
  refs = [RefWorker(tau) for _ in range(n)]
  ref_ps = [p.copy() for p in ps0]
  assert all(w.must_wait for w in workers)  # nothing before the first model
  for w, r in zip(workers, refs):
    w.receive(master.ps_x)
    r.receive(ref_ps)
  check(workers, refs, master, ref_ps, "initial model")
  # Random but fixed: each event is a step of a worker that may step, or a merge when every
  # worker has an update; a merged model reaches the workers one by one, later.
  pending = {}  # worker -> PS model not received yet
  steps_done = 0
  for event in range(60):
    ready = [w for w in range(n) if not workers[w].must_wait]
    can_merge = all(wk.has_update for wk in workers) and not pending
    choice = rng.integers(0, 4)
    if choice == 0 and can_merge:
      deltas = [wk.take_update() for wk in workers]
      ref_d = [r.transfer() for r in refs]
      master.merge(deltas)
      ref_ps = [p + sum(d[k] for d in ref_d) / n for k, p in enumerate(ref_ps)]
      pending = {w: [p.copy() for p in ref_ps] for w in range(n)}
      what = f"event {event}: merge"
    elif choice == 1 and pending:
      w = sorted(pending)[rng.integers(0, len(pending))]
      ps = pending.pop(w)
      workers[w].receive([tf.constant(p) for p in ps])
      refs[w].receive(ps)
      what = f"event {event}: worker {w} receives"
    elif ready:
      w = ready[rng.integers(0, len(ready))]
      g = gradient(w, workers[w].i)
      tf_step(workers[w], g)
      refs[w].step(g)
      steps_done += 1
      what = f"event {event}: worker {w} steps"
    else:
      continue
    check(workers, refs, master, ref_ps, what)
    for wk in workers:
      assert 0 <= wk.staleness <= tau
  assert steps_done > 10 and master.version > 2


def test_algorithm1_blocks_at_tau():
  worker = asgd_nodelay.AsgdWorker([tf.Variable(np.zeros(2, np.float32))], tau=2)
  worker.receive([tf.zeros(2)])
  worker.x[0].assign_sub([1.0, 1.0])
  worker.note_step()
  worker.note_step()
  assert worker.must_wait
  with pytest.raises(RuntimeError, match="had to wait"):
    worker.note_step()
  delta = worker.take_update()
  np.testing.assert_allclose(delta[0].numpy(), [-1.0, -1.0])
  assert worker.must_wait  # handing in does not unblock: only a new model does
  worker.receive([tf.constant([5.0, 5.0])])
  assert worker.staleness == 0 and not worker.must_wait
  np.testing.assert_allclose(worker.x[0].numpy(), [5.0, 5.0])


def test_bad_tau():
  with pytest.raises(ValueError, match="tau .* must be >= 1"):
    asgd_nodelay.check_tau(0)
  with pytest.raises(ValueError, match="tau must be even"):
    asgd_nodelay.check_tau(3, algorithm=2)


# ---- Algorithm 2 --------------------------------------------------------------------------------
def ref_algorithm2(n, tau, cycles, ps0):
  """Algorithm 2 literally: per cycle every worker waits for the PS model of the last merge,
  hands in x - x_init, and sets x = x_init = PS.x + update; the master merges each boundary's
  updates (pipelined: the model received at boundary j holds the updates of boundary j - 1)."""
  beta = tau // 2
  x = [[np.zeros(s, np.float32) for s in SHAPES] for _ in range(n)]
  x_init = [[np.zeros(s, np.float32) for s in SHAPES] for _ in range(n)]
  ps = [p.copy() for p in ps0]
  history = []
  for j in range(cycles):
    deltas = []
    for w in range(n):
      d = [a - b for a, b in zip(x[w], x_init[w])]
      deltas.append(d)
      x[w] = [p + dk for p, dk in zip(ps, d)]
      x_init[w] = [a.copy() for a in x[w]]
    # The master merges this boundary's updates while the workers run the cycle.
    ps = [p + sum(d[k] for d in deltas) / n for k, p in enumerate(ps)]
    for w in range(n):
      for t in range(beta):
        g = gradient(w, j * beta + t)
        x[w] = [a - LR * b for a, b in zip(x[w], g)]
    history.append(([[a.copy() for a in r] for r in x], [p.copy() for p in ps]))
  return history


@pytest.mark.parametrize("tau", [2, 4])
def test_algorithm2_cycles(tau):
  n, cycles = 3, 5
  rng = np.random.default_rng(7)
  ps0 = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
  ref = ref_algorithm2(n, tau, cycles, ps0)
  master = asgd_nodelay.AsgdMaster([tf.Variable(p) for p in ps0])
  workers = [asgd_nodelay.Alg2Worker([tf.Variable(np.zeros(s, np.float32)) for s in SHAPES],
                                     tau, name=f"a2w{w}") for w in range(n)]
  beta = tau // 2
  for j in range(cycles):
    # master.ps_x holds the model of the previous boundary's merge (the initial one at j = 0).
    deltas = [wk.boundary(master.ps_x) for wk in workers]
    master.merge(deltas)
    for wk in workers:
      for _ in range(beta):
        assert wk.staleness <= tau
        g = gradient(workers.index(wk), wk.i)
        for v, gk in zip(wk.x, g):
          v.assign_sub(LR * gk)
        wk.note_step()
      assert wk.staleness == (tau if j >= 1 else beta)
    ref_x, ref_ps = ref[j]
    for w, wk in enumerate(workers):
      for k in range(len(SHAPES)):
        np.testing.assert_allclose(wk.x[k].numpy(), ref_x[w][k], rtol=1e-5, atol=1e-6,
                                   err_msg=f"cycle {j} worker {w} variable {k}")
    for k in range(len(SHAPES)):
      np.testing.assert_allclose(master.ps_x[k].numpy(), ref_ps[k], rtol=1e-5, atol=1e-6)
