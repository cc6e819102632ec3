"""The training job behind examples/train.py: configuration, run, summary, metrics."""

from tf_gba.training.config import TrainConfig
from tf_gba.training.runner import run

__all__ = ["TrainConfig", "run"]
