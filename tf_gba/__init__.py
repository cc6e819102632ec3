"""tf_gba: Global Batch gradients Aggregation for TensorFlow 2 parameter-server training.

Switch a recommendation model between synchronous and asynchronous training without retuning:
`tf_gba.optimizers.GBA` wraps a tf_keras optimizer, `tf_gba.distribute.GBAStrategy` runs it on
parameter servers.
"""

import os
import sys

# tf_gba is built on Keras 2 (tf_keras): Keras 3, TF 2.21's default tf.keras, has no
# ParameterServerStrategy support and tensorflow-recommenders refuses it. This must be set before
# anything touches `tf.keras`.
if os.environ.get("TF_USE_LEGACY_KERAS", "1") != "1":
  raise ImportError(
      "tf_gba needs Keras 2 (tf_keras) but TF_USE_LEGACY_KERAS is set to "
      f"{os.environ['TF_USE_LEGACY_KERAS']!r}. Unset it or set TF_USE_LEGACY_KERAS=1.")
os.environ["TF_USE_LEGACY_KERAS"] = "1"

# TensorFlow's C++ INFO lines (start-up notices, "Started server with target", and on a parameter
# server cluster one "Ignoring error status when releasing multi-device function handle" per
# checkpoint a callback writes) are for debugging TensorFlow; warnings and errors stay. Read once,
# when TensorFlow loads: set TF_CPP_MIN_LOG_LEVEL=0 to see them again.
if "tensorflow" not in sys.modules:
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

__version__ = "0.1.0"

_SUBPACKAGES = ("data", "distribute", "layers", "models", "ops", "optimizers", "simulate",
                "training")


def __getattr__(name):
  # `import tf_gba` stays light (TensorFlow is imported only when a subpackage is used), and
  # `tf_gba.optimizers.GBA` still works without importing the subpackage first.
  if name in _SUBPACKAGES:
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module(f"tf_gba.{name}")
  raise AttributeError(f"module 'tf_gba' has no attribute {name!r}")
