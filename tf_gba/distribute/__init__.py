"""Distribution: GBAStrategy, the local clusters, the server entry point, DTS's exchanges."""

from tf_gba.distribute.collective_cluster import ClusterError
from tf_gba.distribute.collective_cluster import run_collective_cluster
from tf_gba.distribute.dts_training import DTSExchangeCallback
from tf_gba.distribute.dts_training import DTSTrainer
from tf_gba.distribute.dts_training import make_local_mirrored_strategy
from tf_gba.distribute.latency import AsyncAllReduce
from tf_gba.distribute.local_cluster import LocalCluster
from tf_gba.distribute.strategy import GBAStrategy
from tf_gba.distribute.strategy import MODES

__all__ = ["AsyncAllReduce", "ClusterError", "DTSExchangeCallback", "DTSTrainer", "GBAStrategy",
           "LocalCluster", "MODES", "make_local_mirrored_strategy", "run_collective_cluster"]
