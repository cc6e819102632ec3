"""Keras optimizers and wrappers: GBA, AdaptiveRevision, DTS."""

from tf_gba.optimizers.adaptive_revision import AdaptiveRevision
from tf_gba.optimizers.dts import DTS
from tf_gba.optimizers.gba import GBA
from tf_gba.optimizers.gba import resolve_num_aggregate

__all__ = ["AdaptiveRevision", "DTS", "GBA", "resolve_num_aggregate"]
