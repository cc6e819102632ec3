"""What every training job is evaluated on (the metrics themselves: tf_gba.common.metrics)."""

import math

import tensorflow as tf

from tf_gba import data as data_lib
from tf_gba.training.config import TrainConfig


def eval_dataset(cfg: TrainConfig, data_kwargs: dict) -> tf.data.Dataset:
  """What a run is evaluated on: batches of 1024, about `eval_examples` examples at most.

  The eval split of `cfg.day`, or with `cfg.eval_day` every example of that day (its train rows,
  then its eval rows, in order), as in the next-day protocol.
  """
  batches = max(1, math.ceil(cfg.eval_examples / 1024))
  common = dict(batch_size=1024, shuffle_seed=None, strict=cfg.strict_data, **data_kwargs)
  if cfg.eval_day is None:
    ds = data_lib.make_dataset(cfg.data, split="eval", day=cfg.day, **common)
  else:
    ds = data_lib.make_dataset(cfg.data, split="train", day=cfg.eval_day, **common).concatenate(
        data_lib.make_dataset(cfg.data, split="eval", day=cfg.eval_day, **common))
  return ds.take(batches)
