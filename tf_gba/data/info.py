"""`DataInfo`: what a model needs to know about a data source before it sees any data."""

import dataclasses
from typing import Dict, Tuple


@dataclasses.dataclass(frozen=True)
class DataInfo:
  """Feature schema of a data source.

  Attributes:
    categorical: feature name -> vocabulary size, in feature order. The source yields each of these
      as int64 ids already in `[0, vocabulary size)`.
    numeric: names of the float32 features, in feature order.
    num_days: how many days `make_dataset(..., day=d)` accepts (`0 <= d < num_days`).
  """
  categorical: Dict[str, int]
  numeric: Tuple[str, ...] = ()
  num_days: int = 1

  def __post_init__(self):
    for name, size in self.categorical.items():
      if size < 1:
        raise ValueError(f"Vocabulary size of {name!r} must be >= 1, got {size}.")
    if self.num_days < 1:
      raise ValueError(f"num_days must be >= 1, got {self.num_days}.")
    object.__setattr__(self, "numeric", tuple(self.numeric))

  @property
  def categorical_names(self) -> Tuple[str, ...]:
    return tuple(self.categorical)

  @property
  def vocab_sizes(self) -> Tuple[int, ...]:
    return tuple(self.categorical.values())

  @property
  def total_vocab_size(self) -> int:
    """Rows of one table that holds every categorical feature's ids side by side."""
    return sum(self.categorical.values())
