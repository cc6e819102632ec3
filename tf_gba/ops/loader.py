"""Finds and loads the compiled op libraries, lazily and with one actionable error.

Every process that runs or places a tf_gba op must have loaded its library: parameter servers (which
run the kernels) and workers (which instantiate the multi-device functions) alike. `load_all()` is
what `tf_gba.distribute.server` calls right after starting a TF server.
"""

import glob
import os
import threading
from typing import Dict, List

import tensorflow as tf

from tf_gba.common import autograph

# One entry per folder custom_ops/<area>/cc; setup.py and BUILD build each into _<area>_ops.so.
AREAS = ("gba", "adaptive_revision")

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(os.path.dirname(_PACKAGE_DIR))
_lock = threading.Lock()
_loaded: Dict[str, object] = {}
_paths: Dict[str, str] = {}  # area -> the file each loaded library came from

REBUILD_COMMAND = ("pip install --no-build-isolation -e .   (or: make build; "
                   "or: bazel build //:ops and set TF_GBA_OPS_DIR=bazel-bin)")


class OpLibraryNotFoundError(ImportError):
  """Raised when an op library is missing or was built for another TensorFlow."""


def _candidates(area: str) -> List[str]:
  name = f"_{area}_ops"
  paths = []
  env_dir = os.environ.get("TF_GBA_OPS_DIR")
  if env_dir:
    paths += sorted(glob.glob(os.path.join(env_dir, f"{name}*.so")))
    paths += sorted(glob.glob(os.path.join(env_dir, "**", f"{name}*.so"), recursive=True))
  paths += sorted(glob.glob(os.path.join(_PACKAGE_DIR, f"{name}*.so")))
  # A Bazel build in the source tree: bazel-bin/custom_ops/<area>/_<area>_ops.so
  paths += sorted(glob.glob(os.path.join(_REPO_ROOT, "bazel-bin", "custom_ops", area,
                                         f"{name}*.so")))
  seen, unique = set(), []
  for p in paths:
    if p not in seen:
      seen.add(p)
      unique.append(p)
  return unique


def build_info() -> dict:
  try:
    from tf_gba.ops import _build_info  # pylint: disable=g-import-not-at-top
    return dict(_build_info.BUILD_INFO)
  except ImportError:
    return {}


@autograph.framework_function  # called inside traced steps
def load_op_library(area: str):
  """Returns the loaded op module of `area` ("gba", "adaptive_revision"), loading it once."""
  if area not in AREAS:
    raise ValueError(f"Unknown op library area {area!r}; expected one of {AREAS}.")
  with _lock:
    if area in _loaded:
      return _loaded[area]
    tried = []
    for path in _candidates(area):
      try:
        module = tf.load_op_library(path)
      except (tf.errors.NotFoundError, OSError) as e:
        tried.append(f"{path}: {str(e).strip().splitlines()[0][:300]}")
        continue
      _loaded[area] = module
      _paths[area] = path
      return module
    info = build_info()
    searched = [
        os.path.join(_PACKAGE_DIR, f"_{area}_ops*.so"),
        os.path.join(_REPO_ROOT, "bazel-bin", "custom_ops", area, f"_{area}_ops*.so"),
    ]
    if os.environ.get("TF_GBA_OPS_DIR"):
      searched.insert(0, os.path.join(os.environ["TF_GBA_OPS_DIR"], f"_{area}_ops*.so"))
    lines = [f"tf_gba could not load its '{area}' op library.",
             "Searched: " + "; ".join(searched)]
    if tried:
      lines.append("Found but failed to load:\n  " + "\n  ".join(tried))
    else:
      lines.append("No library file was found there.")
    lines.append(f"Built for TensorFlow {info.get('tf_version', 'unknown (no build stamp)')} "
                 f"with {info.get('compiler', 'unknown compiler')}; running TensorFlow "
                 f"{tf.__version__}.")
    lines.append(f"Rebuild with: {REBUILD_COMMAND}")
    raise OpLibraryNotFoundError("\n".join(lines))


def library_path(area: str) -> str:
  """The file the op library of `area` was loaded from (loading it if needed)."""
  load_op_library(area)
  return _paths[area]


def op_names(area: str) -> List[str]:
  """The op types the library of `area` registers, e.g. "GBA>DenseBufferPush"."""
  from tensorflow.core.framework import op_def_pb2  # pylint: disable=g-import-not-at-top
  from tensorflow.python.client import pywrap_tf_session  # pylint: disable=g-import-not-at-top
  handle = pywrap_tf_session.TF_LoadLibrary(library_path(area))  # already loaded: no-op
  try:
    op_list = op_def_pb2.OpList.FromString(bytes(pywrap_tf_session.TF_GetOpList(handle)))
  finally:
    pywrap_tf_session.TF_DeleteLibraryHandle(handle)
  return [op.name for op in op_list.op]


def no_gradient(*op_types: str) -> None:
  """Declares that the ops `op_types` have no gradient (`tf.no_gradient`).

  A tape or `tf.gradients` that reaches such an op then gets None for its inputs, as for
  TensorFlow's own stateful ops, instead of failing with "No gradient defined". Registering needs
  no compiled library (it is by op type name), and a second registration is skipped.
  """
  for op_type in op_types:
    try:
      tf.no_gradient(op_type)
    except KeyError:  # registered before: this module was imported again
      pass


def load_all() -> None:
  """Loads every op library of the package (servers call this before serving)."""
  for area in AREAS:
    load_op_library(area)
