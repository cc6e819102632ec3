"""The lowest layer: helpers every other layer may use (they import nothing of tf_gba)."""
