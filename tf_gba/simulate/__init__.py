"""A discrete-event simulator of GBA and its baselines on N workers and P parameter servers.

`simulate(mode, SimConfig(...))` returns a `SimResult` (global QPS, dense staleness, dropped
batches, idle time); `python -m benchmarks.simulate` runs it over modes and cluster sizes. GBA's
token and buffer decisions are `tf_gba.simulate.logic`, the rules of the real ops (a test replays
one event sequence through both). `tf_gba.simulate.auto` replays `--mode=auto`'s decisions on
given step times, with measured efficiencies and a switch cost.
"""

from tf_gba.simulate.cluster import (MODES, SimConfig, SimResult, free_running_rate,
                                     predicted_qps, simulate, sync_seconds)
from tf_gba.simulate.logic import DenseBufferLogic, TokenLogic
from tf_gba.simulate import auto

__all__ = ["MODES", "auto", "SimConfig", "SimResult", "simulate", "DenseBufferLogic", "TokenLogic",
           "free_running_rate", "predicted_qps", "sync_seconds"]
