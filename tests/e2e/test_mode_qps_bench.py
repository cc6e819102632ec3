"""benchmarks/mode_qps.py: the parameter-server limit computed from a straggler profile."""

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
