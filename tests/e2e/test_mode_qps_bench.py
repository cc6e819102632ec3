"""benchmarks/mode_qps.py: the parameter-server limit and the Sync bound computed from a straggler
profile."""

import numpy as np
import pytest

from benchmarks import mode_qps


def test_ps_limit_of_the_dedicated_profile_by_hand():
  # compute:100+transient:0.2:4+persistent:2@0, 8 workers x 256: a step takes 0.1 s x
  # (1 + 0.2 x 3) = 0.16 s on 7 workers (1,600 examples/s each) and twice that on worker 0 (800).
  assert mode_qps.ps_limit_qps("dedicated", 8, 256) == pytest.approx(7 * 1600 + 800)


def test_ps_limit_multiplies_factors_and_ignores_absent_workers():
  # Worker 1: 0.05 s x 1.5 (transient 0.25:3) x 3 x 2 (two persistent entries); worker 5 absent.
  got = mode_qps.ps_limit_qps("compute:50+transient:0.25:3+persistent:3@1,5+persistent:2@1",
                              3, 100)
  step = 0.05 * 1.5
  assert got == pytest.approx(2 * 100 / step + 100 / (step * 6))


def test_no_limit_without_a_compute_floor():
  assert mode_qps.ps_limit_qps("transient", 8, 256) is None
  assert mode_qps.ps_limit_qps("none", 4, 256) is None


def test_extra_flags_go_only_to_the_modes_that_read_them():
  extra = ["--bsp_aggregate=2", "--hop_bw_backup=2", "--straggler_delay=before_push",
           "--noasync_staleness_stats", "--learning_rate=0.01"]
  # Sync reads none of the parameter-server modes' flags; the common ones pass.
  assert mode_qps.flags_for("sync", extra) == ["--learning_rate=0.01"]
  assert mode_qps.flags_for("bsp", extra) == ["--bsp_aggregate=2", "--straggler_delay=before_push",
                                              "--learning_rate=0.01"]
  assert mode_qps.flags_for("async", extra) == ["--straggler_delay=before_push",
                                                "--noasync_staleness_stats",
                                                "--learning_rate=0.01"]


def _sync_bound_by_sampling(floor_s, transients, persistent, num_workers, batch, draws=400_000):
  """Independent reference: draw every worker's step time, take the slowest of each step."""
  rng = np.random.default_rng(7)
  factors = np.ones((draws, num_workers))
  for p, f in transients:
    factors *= np.where(rng.random((draws, num_workers)) < p, f, 1.0)
  for w, f in persistent.items():
    factors[:, w] *= f
  return num_workers * batch / (floor_s * factors.max(axis=1).mean())


def test_sync_bound_of_the_dedicated_profile():
  # By hand: worker 0 takes 0.2 s or 0.8 s (p 0.2), the others 0.1 s or 0.4 s. The slowest is
  # 0.2 s when no worker is slow (0.8^8), 0.8 s when worker 0 is (0.2), else 0.4 s.
  p_all_fast = 0.8 ** 8
  expected_max = 0.2 * p_all_fast + 0.4 * (0.8 - p_all_fast) + 0.8 * 0.2
  got = mode_qps.sync_bound_qps("dedicated", 8, 256)
  assert got == pytest.approx(8 * 256 / expected_max)
  assert got == pytest.approx(_sync_bound_by_sampling(0.1, [(0.2, 4.0)], {0: 2.0}, 8, 256),
                              rel=0.005)
  # Below the PS limit: a synchronous step waits for the slowest, the limit for nobody.
  assert got < mode_qps.ps_limit_qps("dedicated", 8, 256)


def test_sync_bound_with_two_transient_draws_and_an_absent_worker():
  # Two independent transient draws per worker multiply (factors 1, 3, 2 and 6); worker 7 absent.
  got = mode_qps.sync_bound_qps("compute:50+transient:0.25:3+transient:0.5:2+persistent:3@7",
                                3, 100)
  assert got == pytest.approx(_sync_bound_by_sampling(0.05, [(0.25, 3.0), (0.5, 2.0)], {}, 3, 100),
                              rel=0.005)


def test_no_sync_bound_without_a_compute_floor():
  assert mode_qps.sync_bound_qps("transient", 8, 256) is None
  assert mode_qps.bound_line("transient", 8, 256, 4000.0) is None


def test_bound_line_gives_the_ratios_it_names():
  line = mode_qps.bound_line("dedicated", 8, 256, 4000.0)
  limit = mode_qps.ps_limit_qps("dedicated", 8, 256)
  bound = mode_qps.sync_bound_qps("dedicated", 8, 256)
  assert f"{limit / bound:.2f}x an ideal Sync" in line
  assert f"{4000.0 / bound:.2f} of its bound" in line
  assert f"{limit / 4000.0:.2f}x it" in line
