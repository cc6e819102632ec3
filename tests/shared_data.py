"""Where tests find the shared real data sets, and a skip when they are absent.

The data (Criteo rows, MovieLens-100K) may not be redistributed, so it never enters the
repository: tests read it from `<repo>/../shared/data/` and skip, saying why, where it is absent.
"""

import os

import pytest

DATA_DIR = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data"))


def require(*parts: str) -> str:
  """The path of `parts` under the shared data directory; skips the test if it is absent."""
  path = os.path.join(DATA_DIR, *parts)
  if not os.path.exists(path):
    pytest.skip(f"needs the shared real data at {path}, which is not part of the repository "
                "(its terms forbid redistribution)")
  return path
