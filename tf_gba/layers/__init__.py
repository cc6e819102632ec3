"""Keras layers of tf_gba: the expandable hash embedding (SPEC section 6)."""

from tf_gba.layers.hash_embedding import HashEmbedding
from tf_gba.layers.hash_embedding import table_of

__all__ = ["HashEmbedding", "table_of"]
