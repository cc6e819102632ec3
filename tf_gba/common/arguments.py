"""One-line checks of a public constructor's arguments (a number where one is expected, finite,
in range), so that a wrong value fails where it is passed, naming the argument, and not later as
an AttributeError, a NaN model or an op error.

Example:

  alpha = arguments.number("alpha", alpha, minimum=0.0, inclusive=False,
                           owner="AdaptiveRevision")
"""

import math
import numbers
from typing import Optional


def _where(owner: Optional[str], name: str) -> str:
  return f"{owner}: {name}" if owner else name


def number(name: str, value, minimum: Optional[float] = None, inclusive: bool = True,
           owner: Optional[str] = None) -> float:
  """`value` as a float: a real number (not a bool), finite, >= `minimum` (> if not inclusive).

  Raises:
    TypeError: not a number.
    ValueError: not finite, or out of range.
  """
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{_where(owner, name)} must be a number, got {type(value).__name__} "
                    f"{value!r}.")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"{_where(owner, name)} must be a finite number, got {value}.")
  if minimum is not None and (value < minimum if inclusive else value <= minimum):
    raise ValueError(f"{_where(owner, name)} must be {'>=' if inclusive else '>'} {minimum:g}, "
                     f"got {value:g}.")
  return value


def integer(name: str, value, minimum: Optional[int] = None, owner: Optional[str] = None) -> int:
  """`value` as an int: an integer (not a bool; a float with an integer value is accepted),
  >= `minimum`.

  Raises:
    TypeError: not an integer.
    ValueError: out of range.
  """
  if isinstance(value, float) and math.isfinite(value) and value == int(value):
    value = int(value)
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{_where(owner, name)} must be an integer, got {type(value).__name__} "
                    f"{value!r}.")
  value = int(value)
  if minimum is not None and value < minimum:
    raise ValueError(f"{_where(owner, name)} must be >= {minimum}, got {value}.")
  return value
