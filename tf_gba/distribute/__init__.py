"""Distribution: GBAStrategy, the local multi-process cluster, and the server entry point."""

from tf_gba.distribute.local_cluster import LocalCluster
from tf_gba.distribute.strategy import GBAStrategy
from tf_gba.distribute.strategy import MODES

__all__ = ["GBAStrategy", "LocalCluster", "MODES"]
