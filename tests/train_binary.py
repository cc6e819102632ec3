"""The training binary, examples/train.py, loaded as a module: for tests that call its `main` or
read its flags in process (it is a script, not part of the package)."""

import importlib.util
import os

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name: str = "tf_gba_train_binary"):
  """examples/train.py as module `name`, its flags defined (absl's FLAGS)."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(_ROOT, "examples", "train.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  module.define_flags()
  return module
