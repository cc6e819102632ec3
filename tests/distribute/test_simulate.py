"""The cluster simulator: the real ops' decisions, exactly-once accounting, each mode's invariant
and the throughput of simple profiles against closed forms (NumPy references written here)."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from tf_gba.distribute import stragglers
from tf_gba.ops import gba_ops
from tf_gba.simulate import SimConfig, simulate
from tf_gba.simulate import cluster, logic

PROFILE = "compute:100+transient:0.2:4+persistent:2@0"
BUFFERED = ("async", "gba", "bsp", "hop_bs", "hop_bw")


def _replay_through_ops(ev, push_order, config: gba_ops.BufferConfig, version_tokens: bool):
  """Replays a run's fetches and pushes, in time order, through the real token generator and
  dense buffer (eager, one process). A push's gradient is the one-hot vector of its position, so
  each aggregate shows exactly which pushes it holds and with what weight.

  Returns per push (in push order): token, ready, global step after, and the weight the op gave it
  (read off the aggregate that contains it; 0 if dropped), plus the buffer's final statistics.
  """
  n_push = push_order.size
  gen = gba_ops.TokenGenerator(config.num_aggregate)
  buf = gba_ops.DenseBuffer([n_push], tf.float64, config)
  fetch_order = np.lexsort((ev.worker, ev.start))
  # Merge by time; at equal times a push comes first (a worker pushes, then starts its next step).
  events = [(ev.start[i], 1, int(ev.worker[i]), "fetch", int(i)) for i in fetch_order]
  events += [(ev.finish[i], 0, int(ev.worker[i]), "push", j) for j, i in enumerate(push_order)]
  events.sort(key=lambda e: (e[0], e[1], e[2]))
  token_of, ticket_of = {}, {}
  tokens = np.empty(n_push, np.int64)
  ready = np.zeros(n_push, bool)
  step_after = np.empty(n_push, np.int64)
  weight = np.zeros(n_push)
  divisors = []
  batch = []
  for _, _, _, kind, i in events:
    if kind == "fetch":
      token, ticket = gen.fetch()
      if version_tokens:  # Hop-BW: the token is the version read with the parameters
        token = buf.global_step()
      token_of[i], ticket_of[i] = int(token), int(ticket)
      continue
    step_index = int(push_order[i])
    tokens[i] = token_of[step_index]
    grad = np.zeros(n_push)
    grad[i] = 1.0
    r, agg, step = buf.push(tokens[i], ticket_of[step_index], tf.constant(grad))
    ready[i], step_after[i] = bool(r), int(step)
    batch.append(i)
    if ready[i]:
      agg = agg.numpy()
      nonzero = agg[agg != 0]
      # Every kept gradient has weight 1 under the threshold decay: 1 / divisor reveals it.
      divisors.append(int(round(1.0 / nonzero.min())) if config.decay == "threshold"
                      and nonzero.size else None)
      for j in batch:
        weight[j] = agg[j]
      batch = []
  return tokens, ready, step_after, weight, divisors, buf.stats()


@pytest.mark.parametrize("mode,overrides", [
    ("gba", {}),
    ("gba", {"iota": 1, "gba_num_aggregate": 3}),
    ("async", {}),
    ("bsp", {"bsp_aggregate": 3}),
    ("hop_bs", {}),
    ("hop_bw", {"hop_bw_backup": 1}),
    ("gba", {"delay_after_push": True, "work_ms": 30.0}),
    ("hop_bw", {"delay_after_push": True, "work_ms": 30.0, "hop_bw_backup": 2}),
])
def test_decisions_are_those_of_the_real_ops(mode, overrides):
  config = SimConfig(num_workers=4, steps=40, stragglers="transient:0.3:4.5+persistent:2.7@1",
                     seed=3, **overrides)
  result = simulate(mode, config)
  ev, push_order, dec = (result.extra[k] for k in ("events", "push_order", "decisions"))
  buf_config = result.extra["buffer"].config
  tokens, ready, step_after, weight, divisors, stats = _replay_through_ops(
      ev, push_order, buf_config, version_tokens=(mode == "hop_bw"))
  np.testing.assert_array_equal(ev.token[push_order], tokens)
  np.testing.assert_array_equal(dec.ready, ready)
  np.testing.assert_array_equal(dec.step_after, step_after)
  # The op's aggregate holds weight / divisor for each push of the batch.
  div = np.zeros(push_order.size)
  agg_of = dec.aggregation
  for a, d in enumerate(dec.divisors):
    div[agg_of == a] = d
  complete = (agg_of >= 0) & (agg_of < len(dec.divisors))
  np.testing.assert_allclose(weight[complete] * div[complete], dec.weight[complete], atol=1e-12)
  assert np.all(weight[~complete] == 0)
  assert [d for d in divisors if d is not None] == [
      d for d, o in zip(dec.divisors, divisors) if o is not None]
  buf = result.extra["buffer"]
  assert (stats.pushes, stats.aggregations, stats.dropped, stats.staleness_sum,
          stats.staleness_max) == (buf.pushes, buf.aggregations, buf.dropped, buf.staleness_sum,
                                   buf.staleness_max)
  np.testing.assert_array_equal(stats.histogram, buf.histogram)
  # The sequence exercised what it is meant to: stale pushes for GBA, aggregations for all.
  # (With the slowdown after the push every push window is equally long, and a gradient is never
  # older than its token: see test_slowdown_after_the_push.)
  assert stats.aggregations >= 10
  if mode == "hop_bw" or (mode == "gba" and not config.delay_after_push):
    assert stats.dropped > 0


@pytest.mark.parametrize("config", [
    gba_ops.BufferConfig(num_aggregate=4, staleness_threshold=1),
    gba_ops.BufferConfig(num_aggregate=3, staleness_threshold=0, count_dropped=False),
    gba_ops.BufferConfig(num_aggregate=5, staleness_threshold=1, decay="exponential",
                         decay_alpha=0.3, normalize="kept"),
    gba_ops.BufferConfig(num_aggregate=2, staleness_threshold=2, normalize="kept",
                         count_dropped=False),
])
def test_logic_matches_ops_on_random_tokens(config):
  """Decisions, weights and divisors of every push against the op, option by option."""
  rng = np.random.default_rng(0)
  n = 60
  op = gba_ops.DenseBuffer([n], tf.float64, config)
  sim = logic.DenseBufferLogic(config)
  batch = []
  for i in range(n):
    # Tokens around the current step: some fresh, some stale, some ahead.
    token = max(0, sim.step + int(rng.integers(-4, 2)))
    s, w, counted, r, step, divisor = sim.push(token)
    grad = np.zeros(n)
    grad[i] = 1.0
    r_op, agg, step_op = op.push(token, i, tf.constant(grad))
    assert (bool(r_op), int(step_op)) == (r, step)
    batch.append((i, w))
    if r:
      agg = agg.numpy()
      np.testing.assert_allclose([agg[j] * divisor for j, _ in batch], [w for _, w in batch],
                                 rtol=1e-6)
      batch = []
  st = op.stats()
  assert (st.pushes, st.aggregations, st.dropped, st.staleness_sum) == (
      sim.pushes, sim.aggregations, sim.dropped, sim.staleness_sum)


def test_token_logic_matches_the_generator():
  gen = gba_ops.TokenGenerator(3)
  sim = logic.TokenLogic(3)
  got = [tuple(int(x) for x in gen.fetch()) for _ in range(10)]
  assert got == [sim.fetch() for _ in range(10)]
  np.testing.assert_array_equal(logic.TokenLogic(3, initial_count=10).fetch_many(7),
                                [(10 + i) // 3 for i in range(7)])


@pytest.mark.parametrize("config", [
    gba_ops.BufferConfig(num_aggregate=7, staleness_threshold=2),
    gba_ops.BufferConfig(num_aggregate=4, staleness_threshold=0, count_dropped=False),
    gba_ops.BufferConfig(num_aggregate=3, staleness_threshold=1, normalize="kept"),
])
def test_push_many_equals_pushes_one_at_a_time(config):
  rng = np.random.default_rng(1)
  tokens = np.maximum(0, np.arange(300) // 5 + rng.integers(-6, 2, 300))
  many = logic.DenseBufferLogic(config)
  dec = many.push_many(tokens[:137])
  dec2 = many.push_many(tokens[137:])  # a call may end inside a global batch
  one = logic.DenseBufferLogic(config)
  singles = [one.push(t) for t in tokens]
  np.testing.assert_array_equal(np.concatenate([dec.weight, dec2.weight]),
                                [x[1] for x in singles])
  np.testing.assert_array_equal(np.concatenate([dec.ready, dec2.ready]), [x[3] for x in singles])
  np.testing.assert_array_equal(np.concatenate([dec.step_after, dec2.step_after]),
                                [x[4] for x in singles])
  assert dec.divisors + dec2.divisors == [x[5] for x in singles if x[5] is not None]
  assert many.staleness_sum == one.staleness_sum and many.dropped == one.dropped


@pytest.mark.parametrize("mode", BUFFERED)
def test_every_push_is_aggregated_or_dropped_exactly_once(mode):
  config = SimConfig(num_workers=16, steps=200, stragglers=PROFILE, seed=1)
  result = simulate(mode, config)
  ev, order, dec = (result.extra[k] for k in ("events", "push_order", "decisions"))
  m = result.extra["buffer"].config.num_aggregate
  assert order.size == result.pushes == config.steps * config.num_workers
  # Each worker step is pushed once, and only steps that finished by the end.
  pairs = ev.worker[order].astype(np.int64) * 10**6 + ev.index[order]
  assert np.unique(pairs).size == order.size
  assert np.all(ev.finish[order] <= result.seconds)
  aggregated = dec.counted & (dec.weight != 0)
  dropped = dec.weight == 0
  complete = dec.aggregation < result.global_steps
  pending = dec.counted & ~complete
  # Aggregated, dropped, or (at the end of the run) pending: exactly one of them.
  assert np.all(aggregated.astype(int) + dropped.astype(int) == 1)
  assert int(np.count_nonzero(aggregated & complete) + np.count_nonzero(dropped)
             + np.count_nonzero(pending & ~dropped)) == order.size
  # Every completed global step holds exactly M places; the unfinished one fewer.
  per_step = np.bincount(dec.aggregation[dec.counted], minlength=result.global_steps + 1)
  assert np.all(per_step[:result.global_steps] == m)
  assert per_step[result.global_steps:].sum() < m
  assert result.dropped_batches == int(np.count_nonzero(dropped))


def test_sync_has_no_staleness_and_steps_together():
  config = SimConfig(num_workers=8, steps=100, stragglers=PROFILE)
  result = simulate("sync", config)
  ev = result.extra["events"]
  for s in (0, 50, 99):
    assert np.unique(ev.start[ev.index == s]).size == 1
  assert result.mean_staleness == 0 and result.staleness_histogram[0] == 800
  assert result.idle_fraction > 0.3  # workers wait for the slowest


def _lead_brute_force(ev, end):
  """At every step start: own finished steps minus the fewest finished by any worker."""
  n = int(ev.worker.max()) + 1
  lead = 0
  for i in np.flatnonzero(ev.start <= end):
    counts = [np.count_nonzero((ev.worker == w) & (ev.finish <= ev.start[i])) for w in range(n)]
    lead = max(lead, int(ev.index[i]) - min(counts))
  return lead


@pytest.mark.parametrize("b1", [0, 2])
def test_hop_bs_lead_is_bounded(b1):
  config = SimConfig(num_workers=5, steps=30, stragglers="persistent:3@2", hop_bs_bound=b1)
  result = simulate("hop_bs", config)
  ev = result.extra["events"]
  assert _lead_brute_force(ev, result.seconds) == result.max_lead <= b1
  assert result.blocked_seconds > 0
  # Without the barrier the fast workers run far ahead: the bound is what holds them.
  free = simulate("bsp", dataclasses.replace(config, bsp_aggregate=5))
  assert _lead_brute_force(free.extra["events"], free.seconds) > b1 + 5


def test_hop_bw_one_gradient_per_version_and_first_n_minus_b3():
  config = SimConfig(num_workers=10, steps=60, stragglers=PROFILE, hop_bw_backup=3, seed=2)
  result = simulate("hop_bw", config)
  ev, order, dec = (result.extra[k] for k in ("events", "push_order", "decisions"))
  tokens = ev.token[order]
  pairs = ev.worker[order].astype(np.int64) * 10**6 + tokens
  assert np.unique(pairs).size == order.size  # at most one gradient per worker and version
  kept = dec.weight != 0
  # Version k's aggregate is the first 7 gradients computed on version k, all others dropped.
  for k in range(result.global_steps):
    on_k = np.flatnonzero(tokens == k)
    assert np.all(kept[on_k[:7]]) and not np.any(kept[on_k[7:]])
    assert np.all(dec.aggregation[on_k[:7]] == k)
  assert np.all(dec.staleness[kept] == 0) and np.all(dec.staleness[~kept] > 0)
  # A worker that pushed on time starts its next step only when the next version exists.
  version_time = ev.finish[order][dec.ready]
  starts_after = ev.start[ev.token >= 1]
  assert np.all(starts_after >= version_time[ev.token[ev.token >= 1] - 1] - 1e-12)


def _step_s(config):
  c = config.compute_ms * 1e-3
  comm = (2 * config.latency_ms + (config.pull_ms + config.push_ms) / config.num_ps) * 1e-3
  return c, comm


@pytest.mark.parametrize("num_ps", [1, 4])
def test_qps_without_stragglers(num_ps):
  config = SimConfig(num_workers=12, num_ps=num_ps, steps=50, hop_bw_backup=2)
  c, comm = _step_s(config)
  expected = 12 * config.local_batch_size / (c + comm)
  for mode in cluster.MODES:
    r = simulate(mode, config)
    assert r.global_qps == pytest.approx(expected, rel=1e-9), mode
    assert r.mean_staleness == pytest.approx(0.0 if mode != "hop_bw" else 2 / 12), mode
  # Hop-BW drops the b3 backup gradients of every version even when nobody is slow.
  assert simulate("hop_bw", config).effective_qps == pytest.approx(expected * 10 / 12)


def test_qps_with_one_persistent_straggler():
  config = SimConfig(num_workers=10, steps=600, stragglers="persistent:3@4")
  c, comm = _step_s(config)
  fast, slow = c + comm, 3 * c + comm
  b = config.local_batch_size
  sync = 10 * b / slow             # paced by the slowest every step
  free = b * (9 / fast + 1 / slow)  # the sum of the workers' rates
  assert simulate("sync", config).global_qps == pytest.approx(sync, rel=1e-9)
  for mode in ("async", "gba", "bsp"):
    assert simulate(mode, config).global_qps == pytest.approx(free, rel=0.01), mode
  # Hop-BS: the fast workers stay within b1 steps of the slow one, so the pace is the slowest's.
  assert simulate("hop_bs", config).global_qps == pytest.approx(sync, rel=0.02)


def test_qps_with_transient_stragglers():
  p, f, n = 0.2, 4.0, 8
  config = SimConfig(num_workers=n, steps=3000, stragglers=f"transient:{p}:{f:g}", seed=5)
  c, comm = _step_s(config)
  b = config.local_batch_size
  e_max = 1 + (f - 1) * (1 - (1 - p) ** n)   # expected largest factor of n workers
  e_one = 1 + (f - 1) * p
  assert simulate("sync", config).global_qps == pytest.approx(n * b / (comm + c * e_max),
                                                               rel=0.03)
  assert simulate("gba", config).global_qps == pytest.approx(n * b / (comm + c * e_one),
                                                              rel=0.03)


def test_factors_are_the_profile_s():
  """The simulator's slowdowns are the op's draw: p of the steps, the persistent worker 2x."""
  dur = cluster._Durations(SimConfig(stragglers="compute:50+transient:0.25:3+persistent:2@1"))
  workers = np.repeat(np.arange(4), 20000)
  f, floor = dur.factors(workers, np.tile(np.arange(20000), 4), np.zeros(workers.size))
  assert floor == pytest.approx(0.05)
  assert dur.compute == pytest.approx(0.1)  # compute_ms 100 > the 50 ms floor
  base = f / np.where(workers == 1, 2.0, 1.0)
  assert set(np.unique(base)) == {1.0, 3.0}
  assert np.mean(base == 3.0) == pytest.approx(0.25, abs=0.01)
  same = cluster._Durations(SimConfig(stragglers="transient:0.25:3"))
  again, _ = same.factors(workers, np.tile(np.arange(20000), 4), np.zeros(workers.size))
  np.testing.assert_array_equal(again, base)  # same seed, same draws


@pytest.mark.parametrize("kwargs,message", [
    ({"num_workers": 0}, "num_workers"), ({"hop_bw_backup": 8}, "hop_bw_backup"),
    ({"stragglers": "slow"}, "Unknown straggler profile"), ({"compute_ms": -1}, "compute_ms"),
])
def test_bad_configuration(kwargs, message):
  with pytest.raises(ValueError, match=message):
    SimConfig(**kwargs)


def test_bad_mode():
  with pytest.raises(ValueError, match="mode must be one of"):
    simulate("ssp", SimConfig())


def test_trace_profile_slows_the_window_it_names(tmp_path):
  trace = tmp_path / "trace.json"
  trace.write_text('{"window_seconds": 5, "workers": {"2": [1, 3, 1]}}')
  config = SimConfig(num_workers=4, steps=150, stragglers=f"trace:{trace}")
  ev = simulate("sync", config).extra["events"]
  c, comm = _step_s(config)
  for s in range(config.steps):
    t = ev.start[ev.index == s][0]
    slow = 3.0 if 5.0 <= t < 10.0 else 1.0
    assert ev.finish[ev.index == s].max() - t == pytest.approx(comm + c * slow), s
  assert np.any((ev.start >= 5.0) & (ev.start < 10.0)) and ev.start.max() > 10.0


def test_slowdown_after_the_push():
  """The project's injected stragglers sleep after the push: the pace is that of the stretched
  compute, but a gradient is only as stale as the pushes during pull + work + push."""
  config = SimConfig(num_workers=6, steps=400, stragglers="persistent:3@0",
                     delay_after_push=True, work_ms=10.0)
  c, comm = _step_s(config)
  b = config.local_batch_size
  assert simulate("sync", config).global_qps == pytest.approx(6 * b / (3 * c), rel=1e-9)
  gba = simulate("gba", config)
  assert gba.global_qps == pytest.approx(b * (5 / c + 1 / (3 * c)), rel=0.01)
  # Every push window (pull + work + push) is equally long: a gradient whose token was taken
  # before another's is also pushed before it, so no gradient is older than its token.
  assert gba.max_staleness == 0
  inside = simulate("gba", dataclasses.replace(config, delay_after_push=False))
  assert inside.max_staleness >= 2  # the same straggler, slowed before its push


def test_benchmark_writes_rows_and_plots(tmp_path):
  from benchmarks import simulate as bench  # pylint: disable=g-import-not-at-top
  rows = bench.main(["--num_workers=4,8", "--steps=20", "--modes=sync,gba,hop_bw",
                     "--stragglers=dedicated", f"--plots={tmp_path / 'img'}",
                     f"--out={tmp_path / 'out'}"])
  assert [(r["num_workers"], r["mode"]) for r in rows] == [
      (4, "sync"), (4, "gba"), (4, "hop_bw"), (8, "sync"), (8, "gba"), (8, "hop_bw")]
  assert rows[1]["vs_sync"] == pytest.approx(rows[1]["global_qps"] / rows[0]["global_qps"])
  assert rows[0]["stragglers"] == "compute:100+transient:0.2:4+persistent:2@0"
  assert (tmp_path / "out" / "results.json").exists()
  assert sorted(p.name for p in (tmp_path / "img").iterdir()) == [
      "sim_drops.png", "sim_idle.png", "sim_qps.png", "sim_staleness.png"]
  with pytest.raises(SystemExit):
    bench.main(["--modes=gba,ssp", f"--out={tmp_path / 'out'}"])


def test_factors_are_those_step_end_sleeps():
  """`slowdown_factors` and GBA>StepEnd draw the same slowdown for the same (worker, step)."""
  ops = stragglers._ops()  # pylint: disable=protected-access
  floor_s = 0.05
  profile = stragglers.parse(f"compute:{floor_s * 1000:g}+transient:0.5:3")
  # One step first: its kernel is created inside the timed step, which would stretch it.
  ops.gba_step_end(ops.gba_step_begin(), profile=profile, seed=11)
  # This process's position in its straggler sequence (its step count, moved by any
  # GBA>SetStepPosition an earlier test in the process made).
  first = int(ops.gba_worker_step_stats().numpy()[4])
  slept = []
  for _ in range(24):
    start = ops.gba_step_begin()
    slept.append(float(ops.gba_step_end(start, profile=profile, seed=11)))
  # A step of little work (busy < floor) is padded to the floor, then stretched: it sleeps
  # floor x factor - busy, so factor = ceil(sleep / floor) whenever busy < floor.
  measured = np.ceil(np.array(slept) / floor_s - 1e-9)
  expected, floor = stragglers.slowdown_factors(
      np.zeros(24, np.int64), np.arange(first, first + 24), np.zeros(24), profile, 11)
  assert floor == pytest.approx(floor_s)
  np.testing.assert_array_equal(measured, expected)
  assert set(expected) == {1.0, 3.0}


def test_defaults_are_those_of_the_real_modes():
  # b2, b3, b1 and M as a real run of each mode would resolve them for N workers.
  from tf_gba.distribute import modes as modes_lib  # pylint: disable=g-import-not-at-top
  from tf_gba.training.config import TrainConfig  # pylint: disable=g-import-not-at-top
  for n in (1, 2, 3, 4, 7, 8, 13, 100, 1024):
    cfg = SimConfig(num_workers=n)
    assert cfg.b2 == modes_lib.num_aggregate_for("bsp", n) == TrainConfig(
        mode="bsp", num_workers=n).num_aggregate
    assert cfg.hop_bs_bound == TrainConfig(mode="hop_bs").hop_bs_bound
    assert cfg.m == TrainConfig(mode="gba", num_workers=n).num_aggregate
    if n > 1:
      assert n - cfg.b3 == modes_lib.num_aggregate_for("hop_bw", n) == TrainConfig(
          mode="hop_bw", num_workers=n).num_aggregate


# The coordinator and the parameter servers' cores (`coord_ms_per_closure`, `coord_ms_per_step`,
# `steps_per_execution`, `ps_cores`, `ps_ms_per_closure`).


def _reference_queues(compute, comm, k, closure, ps_push, ps_apply, ps_closure, m, cores,
                      num_ps, pushes):
  """An event-by-event reference of one coordinator and P servers of `cores` cores each.

  Each worker has one next event: asking the coordinator for a closure of k steps, or its push
  arriving. The earliest event goes first (pushes before requests at a tie, then the lower worker).
  The coordinator serves requests one at a time for `closure` s; a push takes the core free
  first for ps_push / P, the m-th push ps_apply / P more, the push ending a closure ps_closure / P
  more. Returns {(worker, step): (start, finish)} and the busy seconds of the coordinator and of
  the servers (one server's share)."""
  n = compute.size
  at = np.zeros(n)
  kind = np.ones(n, np.int64) if closure > 0 else np.zeros(n, np.int64)  # 0 push, 1 request
  start = np.zeros(n)
  at[kind == 0] = comm + compute[kind == 0]
  step = np.zeros(n, np.int64)
  left = np.full(n, k)
  core_free = np.zeros(cores)
  coord_free = 0.0
  busy = {"coordinator": 0.0, "ps": 0.0}
  out = {}
  served = 0
  while served < pushes:
    w = int(np.lexsort((np.arange(n), kind, at))[0])
    if kind[w] == 1:
      coord_free = max(at[w], coord_free) + closure
      busy["coordinator"] += closure
      left[w] = k
      start[w] = coord_free
      at[w], kind[w] = coord_free + comm + compute[w], 0
      continue
    served += 1
    c = int(np.argmin(core_free))
    service = ps_push / num_ps + (ps_apply / num_ps if served % m == 0 else 0.0)
    service += ps_closure / num_ps if left[w] == 1 else 0.0
    finish = max(at[w], core_free[c]) + service
    busy["ps"] += service
    core_free[c] = finish
    out[(w, int(step[w]))] = (float(start[w]), finish)
    step[w] += 1
    left[w] -= 1
    if left[w] == 0 and closure > 0:
      at[w], kind[w] = finish, 1
    else:
      left[w] = left[w] or k
      start[w] = finish
      at[w] = finish + comm + compute[w]
  return out, busy


def _by_step(ev):
  return {(int(w), int(i)): (float(s), float(f))
          for w, i, s, f in zip(ev.worker, ev.index, ev.start, ev.finish)}


@pytest.mark.parametrize("mode,m", [("gba", 5), ("async", 1)])
@pytest.mark.parametrize("k,closure,cores,num_ps", [(1, 4.0, 1, 1), (3, 7.0, 2, 1),
                                                    (4, 0.0, 3, 2), (2, 25.0, 1, 3)])
def test_coordinator_and_ps_cores_match_a_reference(mode, m, k, closure, cores, num_ps):
  # Persistent stragglers (deterministic): worker 0 twice as slow, worker 3 three times.
  config = SimConfig(num_workers=5, steps=24, compute_ms=40, pull_ms=2, push_ms=3, latency_ms=0.5,
                     stragglers="persistent:2@0+persistent:3@3", num_ps=num_ps, ps_push_ms=6,
                     ps_apply_ms=9, ps_ms_per_closure=2, ps_cores=cores,
                     coord_ms_per_closure=closure, steps_per_execution=k)
  r = simulate(mode, config)
  compute = np.full(5, 0.040)
  compute[0] *= 2
  compute[3] *= 3
  comm = (1.0 + 5 / num_ps) * 1e-3
  want, busy = _reference_queues(compute, comm, k, closure * 1e-3, 6e-3, 9e-3, 2e-3, m, cores,
                                 num_ps, r.pushes)
  got = _by_step(r.extra["events"])
  for key, value in want.items():
    assert got[key] == pytest.approx(value, abs=1e-9), key
  done = sorted(f for _, f in want.values())
  assert r.seconds == pytest.approx(done[r.pushes - 1], abs=1e-9)


def _flat(**kw):
  """No stragglers, no transfer times: a worker step is compute_ms exactly."""
  return dict(pull_ms=0, push_ms=0, latency_ms=0, local_batch_size=10, **kw)


@pytest.mark.parametrize("n,k,closure_ms", [(4, 1, 2.0), (4, 1, 5.0), (8, 5, 4.0), (30, 5, 4.0),
                                            (16, 20, 0.5)])
def test_coordinator_closed_form(n, k, closure_ms):
  # Workers of T = 10 ms steps ask for closures of k steps; the coordinator dispatches one in
  # s ms. Unsaturated (N s <= k T + s) each worker cycles in k T + s; saturated, the coordinator
  # dispatches 1 / s closures per ms. Closures per ms = min(N / (k T + s), 1 / s).
  t = 10.0
  # Enough closures per worker that the ones in flight at the cut weigh under 1 %.
  r = simulate("gba", SimConfig(num_workers=n, steps=max(400, 100 * k), compute_ms=t,
                                coord_ms_per_closure=closure_ms, steps_per_execution=k,
                                **_flat()))
  rate = min(n / (k * t + closure_ms), 1 / closure_ms)   # closures per ms
  assert r.global_qps == pytest.approx(1e3 * rate * k * 10, rel=0.01)
  # Utilisation = rate x service time; CPU per worker step = s / k.
  assert r.coordinator_utilisation == pytest.approx(rate * closure_ms, rel=0.01)
  assert r.coordinator_ms_per_step == pytest.approx(closure_ms / k, rel=0.01)
  assert r.ps_ms_per_step == 0 and r.ps_utilisation == 0


def test_coordinator_per_step_cost_is_charged_per_closure():
  # 2 ms per closure + 0.25 ms per step, k = 4: a dispatch takes 3 ms, 0.75 ms per step.
  a = simulate("gba", SimConfig(num_workers=40, steps=200, compute_ms=10, coord_ms_per_closure=2,
                                coord_ms_per_step=0.25, steps_per_execution=4, **_flat()))
  b = simulate("gba", SimConfig(num_workers=40, steps=200, compute_ms=10, coord_ms_per_closure=3,
                                steps_per_execution=4, **_flat()))
  assert a.global_qps == b.global_qps
  assert a.coordinator_ms_per_step == pytest.approx(0.75, rel=0.01)
  assert a.global_qps == pytest.approx(1e3 / 3 * 4 * 10, rel=0.01)   # saturated: 40 s > 43 ms


@pytest.mark.parametrize("n,cores,num_ps", [(3, 4, 1), (4, 4, 1), (64, 1, 1), (64, 4, 1),
                                            (64, 4, 2), (300, 16, 1)])
def test_ps_cores_closed_form(n, cores, num_ps):
  # A push takes p = 2 ms of one core (p / P of each server's); workers compute T = 20 ms. With
  # N <= c nobody queues (each worker cycles in T + p / P); saturated, c P / p pushes per ms.
  t, p = 20.0, 2.0
  r = simulate("gba", SimConfig(num_workers=n, steps=300, compute_ms=t, ps_push_ms=p,
                                ps_cores=cores, num_ps=num_ps, **_flat()))
  own = n / (t + p / num_ps)
  cap = cores * num_ps / p
  if n <= cores:
    assert r.global_qps == pytest.approx(1e3 * own * 10, rel=1e-9)
  if n * p / num_ps >= 2 * cores * (t + p / num_ps):
    assert r.global_qps == pytest.approx(1e3 * cap * 10, rel=0.01)
  rate = r.global_qps / 10 / 1e3   # pushes per ms
  assert r.ps_utilisation == pytest.approx(rate * (p / num_ps) / cores, rel=0.01)
  assert r.ps_ms_per_step == pytest.approx(p, rel=0.01)
  assert r.global_qps <= 1e3 * min(own, cap) * 10 * (1 + 1e-9)


def test_ps_cpu_per_step_is_push_plus_aggregation_over_m_plus_closure_over_k():
  r = simulate("gba", SimConfig(num_workers=8, steps=200, compute_ms=50, ps_push_ms=1.5,
                                ps_apply_ms=4, ps_ms_per_closure=3, steps_per_execution=5,
                                ps_cores=2, num_ps=2, gba_num_aggregate=4, **_flat()))
  assert r.ps_ms_per_step == pytest.approx(1.5 + 4 / 4 + 3 / 5, rel=0.01)


def test_zero_costs_leave_every_figure_unchanged():
  # k and the cores change nothing while the costs they scale are 0: the unqueued model's
  # figures, exactly, with and without the PS service times.
  for extra in ({}, {"ps_push_ms": 0.11, "ps_apply_ms": 3.9}):
    base = SimConfig(num_workers=16, steps=40, stragglers="compute:100+transient:0.1:4",
                     **extra)
    want = simulate("gba", base).as_dict()
    got = simulate("gba", dataclasses.replace(base, steps_per_execution=20,
                                              ps_cores=1)).as_dict()
    assert got == want
  plain = SimConfig()
  assert not plain.queued and plain.closure_ms == 0 and plain.ps_cores == 1
  r = simulate("gba", SimConfig(num_workers=8, steps=20))
  assert (r.coordinator_ms_per_step, r.ps_ms_per_step, r.coordinator_utilisation,
          r.ps_utilisation) == (0, 0, 0, 0)


@pytest.mark.parametrize("kwargs,message", [
    ({"ps_cores": 0}, "ps_cores"), ({"steps_per_execution": 0}, "steps_per_execution"),
    ({"coord_ms_per_closure": -1}, "coord_ms_per_closure"),
    ({"ps_ms_per_closure": -1}, "ps_ms_per_closure"),
])
def test_bad_cost_configuration(kwargs, message):
  with pytest.raises(ValueError, match=message):
    SimConfig(**kwargs)


def test_coordinator_cost_refused_for_modes_without_it():
  with pytest.raises(ValueError, match="not hop_bw"):
    simulate("hop_bw", SimConfig(num_workers=4, steps=2, coord_ms_per_closure=1))
  a = simulate("sync", SimConfig(num_workers=4, steps=5, coord_ms_per_closure=1))
  assert a.global_qps == simulate("sync", SimConfig(num_workers=4, steps=5)).global_qps


def test_largest_is_the_edge_of_a_monotone_predicate():
  from benchmarks import sim_capacity  # pylint: disable=g-import-not-at-top
  for edge in (1, 2, 3, 37, 64, 65, 1000):
    calls = []
    assert sim_capacity.largest(lambda n, e=edge: calls.append(n) or n <= e, 4096) == edge
    assert len(calls) <= 2 * np.log2(edge + 1) + 2
  assert sim_capacity.largest(lambda n: False, 100) == 0
  assert sim_capacity.largest(lambda n: True, 100) == 100


def test_largest_workers_is_the_coordinator_s_closed_form():
  # Flat 10 ms steps, s ms per closure of one step. Nothing queueing, a worker cycles in T + s;
  # with one coordinator the QPS over that is min(1, (T + s) / (N s)), at least 0.9 up to
  # N = (T + s) / (0.9 s) = 106.4 for s = 0.1055.
  from benchmarks import sim_capacity  # pylint: disable=g-import-not-at-top
  n = sim_capacity.largest_workers(dict(coord_ms_per_closure=0.1055), 0.9, 4096, steps=300,
                                   compute_ms=10, **_flat())
  assert abs(n - 106) <= 1
  # The PS's: c = 4 cores, p = 2 ms pushes, workers of T = 20 ms steps: min(1, c (T + p) / (N p)),
  # at least 0.9 up to N = c (T + p) / (0.9 p) = 48.9.
  n = sim_capacity.largest_workers(dict(ps_push_ms=2.0, ps_cores=4), 0.9, 4096, steps=300,
                                   compute_ms=20, **_flat())
  assert abs(n - 48) <= 1


def test_coordinator_cores_serve_closures_in_parallel():
  # Two dispatchers of 5 ms closures: saturated at 2 / 5 closures per ms.
  r = simulate("gba", SimConfig(num_workers=40, steps=300, compute_ms=10, coord_ms_per_closure=5,
                                coordinator_cores=2, **_flat()))
  assert r.global_qps == pytest.approx(1e3 * 2 / 5 * 10, rel=0.01)
  assert r.coordinator_utilisation == pytest.approx(1.0, rel=0.01)
