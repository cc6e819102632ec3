"""A trained model as a SavedModel that stock TensorFlow serves (TF Serving, `tf.saved_model.load`).

What a server loads must not need tf_gba: the optimizers' own state (GBA's gradient buffers and
token count, DTS's copies) lives in resources made by tf_gba's ops and is left out of every
SavedModel (`tf_gba.optimizers.wrapping`), whichever call writes it; checkpoints keep it. A
HashEmbedding's table is replaced there by its rows in stock variables (tf_gba.layers.
hash_embedding_serving), whichever call writes it too. The
export here also leaves the optimizer out altogether: a server needs the model's variables and its
serving signature only.

The binary writes one at the end of a run, after the final checkpoint, under
`<export_dir>/<global step>`: the numbered version directories TF Serving watches.
"""

import os
import shutil
from typing import Optional


def export_dir(model_dir: str, flag: Optional[str]) -> Optional[str]:
  """The binary's export directory: `flag`, `<model_dir>/export` if None, no export if ""."""
  if flag is None:
    return os.path.join(model_dir, "export")
  return flag or None


def export_for_serving(model, path: str) -> str:
  """Writes `model` (a tf_keras model, trained in any mode) as a serving SavedModel at `path`.

  The model's variables and its `serving_default` signature (the model's call on its inputs), no
  optimizer. A HashEmbedding's table goes in as its rows at this moment, found with stock ops
  (tf_gba.layers.hash_embedding_serving): an unseen id gets its initial row, nothing is inserted. Written beside `path` first and renamed into place, so a server watching the parent
  directory never loads a half-written version; an existing `path` is replaced.

  Returns:
    `path`.
  """
  path = os.path.abspath(path)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  partial = f"{path}.partial-{os.getpid()}"
  shutil.rmtree(partial, ignore_errors=True)
  model.save(partial, include_optimizer=False, save_format="tf")
  if os.path.exists(path):
    shutil.rmtree(path)
  os.replace(partial, path)
  return path


def export_after_run(model, config, global_step: int) -> Optional[str]:
  """The binary's export at the end of a run (`config`: a TrainConfig): the path, or None."""
  root = export_dir(config.model_dir, config.export_dir)
  if root is None:
    return None
  path = export_for_serving(model, os.path.join(root, str(int(global_step))))
  print(f"serving SavedModel {path}", flush=True)
  return path

