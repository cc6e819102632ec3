"""Keras optimizers and wrappers: GBA (and the algorithms around it)."""

from tf_gba.optimizers.gba import GBA
from tf_gba.optimizers.gba import resolve_num_aggregate

__all__ = ["GBA", "resolve_num_aggregate"]
