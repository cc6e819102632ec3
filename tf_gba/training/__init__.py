"""The training job behind examples/train.py: configuration, mode registry, run, summary.

`TrainConfig` and `run` are loaded on first use, so that `tf_gba.training.mode_registry` (read by
the binary for its flags) can be imported without TensorFlow.
"""

__all__ = ["TrainConfig", "run"]


def __getattr__(name):
  if name == "TrainConfig":
    from tf_gba.training.config import TrainConfig  # pylint: disable=g-import-not-at-top
    return TrainConfig
  if name == "run":
    from tf_gba.training.runner import run  # pylint: disable=g-import-not-at-top
    return run
  raise AttributeError(f"module 'tf_gba.training' has no attribute {name!r}")
