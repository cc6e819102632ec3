"""Incremental checkpoints of hash embedding tables (`--full_checkpoint_every=K`).

Every K-th periodic checkpoint, and the run's last one, is full (`model_dir/ckpt-<step>`, kept by
the CheckpointManager as before); the others are deltas: the same tf.train.Checkpoint, in which
each hash table holds only the rows changed since the checkpoint before and the keys removed
since (tf_gba.ops.hash_table_ops.ShardedHashTable), while dense variables, optimizer slots and
GBA's state are whole (they are small next to the tables). Deltas go to
`model_dir/deltas/<full checkpoint's name>/delta-<step>`: a delta belongs to the full checkpoint
it follows, and the deltas of older full checkpoints are removed when a new full one is written
(the older full checkpoints the manager keeps stay usable on their own, at their own step).

A restore reads the newest full checkpoint, then every delta after it in step order: the last
one gives the dense state exactly and the tables the rows they held. A delta that does not read
back whole (cut short by a kill) ends the chain at the one before it.
"""

import os
import re
import shutil
from typing import Callable, List, Optional, Tuple

import tensorflow as tf

from tf_gba.layers.hash_embedding import HashEmbedding
from tf_gba.ops import hash_table_ops

DELTAS_DIR = "deltas"
_DELTA = re.compile(r"^delta-(\d+)\.index$")


def tables(model) -> List[hash_table_ops.ShardedHashTable]:
  """The hash tables of `model`'s HashEmbedding layers."""
  return [layer.table for layer in model.layers
          if isinstance(layer, HashEmbedding) and layer.table is not None]


def delta_dir(model_dir: str, full_path: str) -> str:
  """Where the deltas after the full checkpoint `full_path` go."""
  return os.path.join(model_dir, DELTAS_DIR, os.path.basename(full_path))


def deltas_after(model_dir: str, full_path: str) -> List[str]:
  """The prefixes of the deltas written after `full_path`, oldest first."""
  directory = delta_dir(model_dir, full_path)
  if not os.path.isdir(directory):
    return []
  steps = sorted(int(m.group(1)) for m in map(_DELTA.match, os.listdir(directory)) if m)
  return [os.path.join(directory, f"delta-{s}") for s in steps]


def _written_staged(table_list, full: bool, write: Callable[[], str]) -> str:
  """Stages every table's save (full or delta), runs `write`, and tells the tables whether it
  was written: a write that fails leaves their next delta where it was."""
  for t in table_list:
    t.stage_checkpoint(full=full)
  try:
    path = write()
  except BaseException:
    for t in table_list:
      t.discard_staged_checkpoint()
    raise
  for t in table_list:
    t.checkpoint_written()
  return path


def write_delta(checkpoint: tf.train.Checkpoint, table_list, model_dir: str, full_path: str,
                step: int) -> str:
  """Writes the delta of every table since the checkpoint before (and everything else whole).

  Atomic as a checkpoint write is (the index is written last); a write that fails leaves the
  tables' next delta where it was."""
  prefix = os.path.join(delta_dir(model_dir, full_path), f"delta-{step}")
  return _written_staged(table_list, False, lambda: checkpoint.write(prefix))


def save_full(manager: tf.train.CheckpointManager, table_list, model_dir: str, step: int) -> str:
  """A full checkpoint through `manager`, after which the deltas of older ones are removed."""
  path = _written_staged(table_list, True, lambda: manager.save(checkpoint_number=step))
  prune(model_dir, path)
  return path


def prune(model_dir: str, newest_full: str) -> None:
  """Removes the deltas of every full checkpoint but `newest_full`."""
  root = os.path.join(model_dir, DELTAS_DIR)
  if not os.path.isdir(root):
    return
  for name in os.listdir(root):
    if name != os.path.basename(newest_full):
      shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def restore_deltas(model_dir: str, full_path: str, restore: Callable[[str], object],
                   unreadable: Tuple[type, ...], log: Callable[[str], None]) -> Optional[str]:
  """Restores, in order, the deltas after the full checkpoint `full_path` (already restored).

  Returns the prefix of the last delta restored, or None when there is none. A delta that does
  not read back ends the chain there (one line through `log`): the ones after it build on it.
  """
  last = None
  paths = deltas_after(model_dir, full_path)
  for i, path in enumerate(paths):
    try:
      restore(path)
    except unreadable as e:
      log(f"tf_gba: delta checkpoint {path} is unreadable ({str(e).splitlines()[0][:120]}); "
          f"resuming from {last or full_path}.")
      # It and the ones after it are not part of the run that goes on from here.
      for stale in paths[i:]:
        for f in tf.io.gfile.glob(stale + ".*"):
          tf.io.gfile.remove(f)
      break
    last = path
  return last
