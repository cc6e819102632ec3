"""Checks of a run's input made before any server starts, and the checkpoint choice on restore.

Everything a user can get wrong (a flag out of range, a data path that is missing or unreadable,
a file that is empty or mostly malformed, a model_dir holding another model's checkpoint) is found
here and reported as one `InputError`: one line that says what to fix. The binary prints it and
exits with code 2; finding the same fault later, after the cluster has started, would cost a
minute of start-up and end in a traceback from a worker.

Example:

  report = preflight.check(config)      # raises InputError
  preflight.write_metadata(config)
  path, skipped = preflight.restore_latest_usable(config.model_dir, restore_fn, log)
"""

import json
import os
import re
from typing import Callable, List, Optional, Tuple

from google.protobuf import message as message_lib
import numpy as np
import tensorflow as tf

from tf_gba import data as data_lib
from tf_gba.training.config import TrainConfig

# Rows read by the pre-flight scan of a Criteo source (at C++ speed: about a second per million).
# Bigger sources are checked on their first rows; the summary says how many were checked.
SCAN_ROWS = 1_000_000
# A source with more malformed rows than this share of the rows checked is refused: it is almost
# certainly not in the expected format (another separator, another dataset).
MAX_MALFORMED_SHARE = 0.5
# Written next to the checkpoints: which model (and shape) they hold, and which mode wrote them.
METADATA_FILE = "tf_gba_checkpoint.json"
# What must match for a checkpoint to restore; the mode and the cluster size may change.
_MUST_MATCH = ("model", "embedding_dim", "embedding")


class InputError(ValueError):
  """A fault in the run's input (flags, data, model_dir), with a one-line message saying the fix."""


def check(config: TrainConfig) -> dict:
  """Validates `config`, its data and its model_dir; returns what the data scan found.

  Returns:
    {"rows_checked", "malformed_rows", "fully_checked"}: rows of the source read by the scan, how
    many of them a training pass skips as malformed, and whether the scan read every row.

  Raises:
    InputError: with the message to show the user.
  """
  try:
    config.validate()
  except InputError:
    raise
  except ValueError as e:
    raise InputError(str(e)) from None
  check_cluster(config)
  report = check_data(config)
  check_model_dir(config)
  for line in notices(config, report):
    print(line, flush=True)
  return report


def notices(config: TrainConfig, report: dict) -> List[str]:
  """Lines the user should see before training: what --steps trains when it is rounded, the
  malformed rows the run skips (the first named by file and line), a corrupt record in
  model_dir that the run does without."""
  out = []
  note = config.steps_note()
  if note:
    out.append(f"tf_gba: {note}")
  if report.get("malformed_rows"):
    scope = "" if report["fully_checked"] else " (of the first rows)"
    out.append(f"tf_gba: warning: {report['malformed_rows']} of the {report['rows_checked']:,} "
               f"rows checked{scope} are malformed and skipped; first: "
               f"{report['first_malformed_row']}")
  out += _corrupt_records(config.model_dir)
  return out


def _corrupt_records(model_dir: str) -> List[str]:
  from tf_gba.training import recovery  # pylint: disable=g-import-not-at-top
  out = []
  for name, consequence in (
      (METADATA_FILE, "the checkpoint restore checks the model itself, and the file is written "
                      "again"),
      (recovery.PROGRESS_FILE, "whether the last run finished is unknown: this run starts from "
                               "the newest checkpoint and trains --steps more (not toward the "
                               "last run's target)")):
    path = os.path.join(model_dir, name)
    if not os.path.exists(path):
      continue
    try:
      with open(path) as f:
        if isinstance(json.load(f), dict):
          continue
      problem = "not a JSON object"
    except (OSError, ValueError) as e:
      problem = _first_line(e)
    out.append(f"tf_gba: warning: {path} is unreadable ({problem[:120]}); {consequence}.")
  return out


# ---- cluster -------------------------------------------------------------------------------------
def tf_config():
  """TF_CONFIG parsed and checked (tf_gba.distribute.tf_config.TFConfig), or None when unset."""
  from tf_gba.distribute import tf_config as tf_config_lib  # pylint: disable=g-import-not-at-top
  text = os.environ.get("TF_CONFIG")
  if not text:
    return None
  try:
    return tf_config_lib.parse(text)
  except tf_config_lib.TFConfigError as e:
    raise InputError(str(e)) from None


def check_cluster(config: TrainConfig) -> None:
  """On a real cluster (TF_CONFIG): the chief's cluster fits the mode and the flags."""
  cfg = tf_config()
  if cfg is None or cfg.task_type != "chief":
    return
  from tf_gba.distribute import tf_config as tf_config_lib  # pylint: disable=g-import-not-at-top
  from tf_gba.training import mode_registry  # pylint: disable=g-import-not-at-top
  if mode_registry.get(config.mode).kind != mode_registry.PARAMETER_SERVER:
    raise InputError(f"--mode={config.mode} starts its own worker processes on this machine and "
                     "cannot run under TF_CONFIG: unset TF_CONFIG to train locally, or pick a "
                     "parameter-server mode.")
  try:
    tf_config_lib.check_for_parameter_servers(cfg)
  except tf_config_lib.TFConfigError as e:
    raise InputError(str(e)) from None
  for flag, job in (("num_workers", "worker"), ("num_ps", "ps")):
    if getattr(config, flag) != cfg.count(job):
      raise InputError(f"--{flag}={getattr(config, flag)} contradicts TF_CONFIG, whose "
                       f"cluster.{job} lists {cfg.count(job)}: drop --{flag} (TF_CONFIG sets "
                       "it).")
  if config.uses_data_list and not config.tfdata_dispatcher:
    raise InputError("--input=shared on a real cluster needs --tfdata_dispatcher=HOST:PORT, a "
                     "dispatcher started with `python -m tf_gba.distribute.server "
                     "--job_name=tfdata_dispatcher` (see the README), or --input=sharded.")


# ---- data ----------------------------------------------------------------------------------------
def check_data(config: TrainConfig) -> dict:
  """Paths exist and are readable, the source holds rows, most of them well-formed."""
  kwargs = config.data_kwargs()
  try:
    info = data_lib.data_info(config.data, **kwargs)
  except (ValueError, tf.errors.OpError) as e:
    message = _first_line(e)
    # The data module's messages mostly name the spec already.
    raise InputError(message if config.data in message else
                     f"--data={config.data}: {message}") from None
  for flag in ("day", "eval_day"):
    day = getattr(config, flag)
    if day is not None and day >= info.num_days:
      more = (" (more with --data_options=num_days=N)"
              if config.data.strip().lower() == "synthetic" else "")
      raise InputError(f"--{flag}={day}: --data={config.data} holds {info.num_days} day(s), "
                       f"0 to {info.num_days - 1}{more}.")
  kind = config.data.partition(":")[0].strip().lower()
  if kind == "criteo":
    report = _check_criteo(config, kwargs)
  elif kind == "movielens100k":
    report = _check_movielens(config)
  else:
    return {"rows_checked": 0, "malformed_rows": 0, "fully_checked": True}
  checked, bad = report["rows_checked"], report["malformed_rows"]
  if checked == 0:
    raise InputError(f"--data={config.data}: the source holds no rows (empty files); point "
                     "--data at files with data.")
  if bad > MAX_MALFORMED_SHARE * checked:
    raise InputError(f"--data={config.data}: {bad} of the {checked} rows checked are malformed "
                     f"(first: {report['first_problem']}); is this the right file and format?")
  if config.strict_data and bad:
    raise InputError(f"--strict_data: {report['first_problem']}; fix or remove the row, or drop "
                     "--strict_data to skip malformed rows.")
  report["first_malformed_row"] = report.pop("first_problem")
  return report


def _check_criteo(config: TrainConfig, kwargs: dict) -> dict:
  from tf_gba.data import criteo  # pylint: disable=g-import-not-at-top
  path = os.path.expanduser(config.data.partition(":")[2])
  eval_every = int(kwargs.get("eval_every", 10))
  files = []
  for split in ("train", "eval"):
    try:
      found, _ = criteo.resolve_files(path, split, eval_every)
    except ValueError as e:
      raise InputError(f"--data={config.data}: {_first_line(e)}") from None
    files += [f for f in found if f not in files]
  for f in files:
    if not os.access(f, os.R_OK):
      raise InputError(f"--data={config.data}: cannot read {f} (permission denied); make it "
                       "readable by this user.")
  checked = bad = 0
  first_problem = None
  fully = True
  blocks = criteo._selected_rows(files, "train", False, eval_every, 1, 0)  # pylint: disable=protected-access
  try:
    for rows in blocks:
      text, ok = criteo._is_well_formed(rows.text)  # pylint: disable=protected-access
      ok = ok.numpy()
      checked += len(ok)
      if not ok.all():
        bad += int((~ok).sum())
        if first_problem is None:
          i = int(np.argmin(ok))
          first_problem = criteo._problems(  # pylint: disable=protected-access
              rows.file, rows.number[i:i + 1], text[i:i + 1])[0].numpy().decode()
      if checked >= SCAN_ROWS:
        fully = False  # (or the source ends here; one row more than the scan would tell)
        break
  except tf.errors.OpError as e:
    raise InputError(f"--data={config.data}: cannot read the files ({_first_line(e)}); check "
                     "that they are plain text or intact .gz.") from None
  return {"rows_checked": checked, "malformed_rows": bad, "fully_checked": fully,
          "first_problem": first_problem}


def _check_movielens(config: TrainConfig) -> dict:
  from tf_gba.data import movielens  # pylint: disable=g-import-not-at-top
  path = os.path.expanduser(config.data.partition(":")[2])
  try:
    ratings = movielens.load(path)
  except (ValueError, OSError) as e:
    raise InputError(f"--data={config.data}: {_first_line(e)}") from None
  malformed = ratings.malformed
  first = (f"Malformed MovieLens row at {malformed[0][0]}:{malformed[0][1]}: {malformed[0][2]}"
           if malformed else None)
  return {"rows_checked": len(ratings.labels) + len(malformed), "malformed_rows": len(malformed),
          "fully_checked": True, "first_problem": first}


# ---- model_dir -----------------------------------------------------------------------------------
def _read_metadata(model_dir: str) -> Optional[dict]:
  try:
    with open(os.path.join(model_dir, METADATA_FILE)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def check_model_dir(config: TrainConfig) -> None:
  """model_dir is a directory we can write, and its checkpoints (if any) are of this model."""
  d = config.model_dir
  if os.path.exists(d) and not os.path.isdir(d):
    raise InputError(f"--model_dir={d} is a file; give a directory.")
  parent = d if os.path.isdir(d) else os.path.dirname(os.path.abspath(d))
  while parent and not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.access(parent, os.W_OK):
    raise InputError(f"--model_dir={d}: {parent} is not writable; pick a directory you can "
                     "write.")
  if not os.path.isdir(d) or not tf.train.get_checkpoint_state(d):
    return
  meta = _read_metadata(d)
  if not meta:
    return  # an older checkpoint: the restore itself checks, see restore_mismatch_message
  for key in _MUST_MATCH:
    saved, wanted = meta.get(key), getattr(config, key)
    if saved is not None and saved != wanted:
      holds = (f"a {saved} checkpoint" if key == "model" else
               f"a checkpoint with --{key}={saved}")
      raise InputError(
          f"--model_dir={d}: this directory holds {holds} (written in mode {meta.get('mode')}); "
          f"--{key}={wanted} cannot resume from it: pass --{key}={saved} to resume, or another "
          "--model_dir to start afresh.")


def write_metadata(config: TrainConfig) -> None:
  """Records which model the checkpoints of model_dir hold (atomically: written, then renamed)."""
  os.makedirs(config.model_dir, exist_ok=True)
  path = os.path.join(config.model_dir, METADATA_FILE)
  meta = {"model": config.model, "embedding_dim": config.embedding_dim,
          "embedding": config.embedding, "mode": config.mode, "data": config.data}
  with open(path + ".tmp", "w") as f:
    json.dump(meta, f, indent=2)
  os.replace(path + ".tmp", path)


def restore_mismatch_message(config: TrainConfig, error: Exception) -> str:
  """The one-line message for a checkpoint that does not fit the model being built."""
  meta = _read_metadata(config.model_dir) or {}
  holds = f"a {meta['model']} checkpoint" if meta.get("model") else "a checkpoint"
  return (f"--model_dir={config.model_dir}: this directory holds {holds} that does not fit "
          f"--model={config.model} --embedding_dim={config.embedding_dim} "
          f"--embedding={config.embedding} --data={config.data} "
          f"({_first_line(error).split('. ')[0][:200]}); use the flags it was written with, or another "
          "--model_dir.")


# ---- choosing the checkpoint to restore ----------------------------------------------------------
# What a truncated or half-written checkpoint raises when read.
# (The checkpoint reader raises IndexError "Read less bytes than requested" for a data file cut
# short; a cut index or object graph fails to parse.)
_UNREADABLE = (tf.errors.DataLossError, tf.errors.OutOfRangeError, tf.errors.NotFoundError,
               tf.errors.InvalidArgumentError, tf.errors.FailedPreconditionError,
               FileNotFoundError, IndexError, message_lib.DecodeError)
# Errors of a checkpoint that does not read back whole (a cut-short write).
UNREADABLE = _UNREADABLE


def checkpoints_newest_first(model_dir: str) -> List[str]:
  state = tf.train.get_checkpoint_state(model_dir) if os.path.isdir(model_dir) else None
  if not state:
    return []
  paths = list(state.all_model_checkpoint_paths) or [state.model_checkpoint_path]
  if state.model_checkpoint_path and state.model_checkpoint_path not in paths:
    paths.append(state.model_checkpoint_path)
  # (get_checkpoint_state already resolves paths relative to model_dir.)
  return list(reversed(paths))


def restore_latest_usable(model_dir: str, restore: Callable[[str], object],
                          log: Callable[[str], None]) -> Tuple[Optional[str], List[str]]:
  """Restores the newest checkpoint of `model_dir` that reads back whole.

  A checkpoint cut short (a full disk, a process killed while copying it) raises a data-loss error
  when read; the one before it is used instead, and `log` says so in one line. A checkpoint that
  reads but does not fit the model (`CheckpointMismatchError`) is not skipped: it is re-raised.

  Args:
    model_dir: the directory of the checkpoints.
    restore: restores the checkpoint at the prefix it is given (raises on an unreadable one).
    log: prints one line.

  Returns:
    (the prefix restored or None, the prefixes skipped as unreadable).
  """
  skipped = []
  for path in checkpoints_newest_first(model_dir):
    try:
      restore(path)
    except _UNREADABLE as e:
      skipped.append(path)
      log(f"tf_gba: checkpoint {path} is unreadable (truncated or incomplete: "
          f"{_first_line(e)[:120]}); trying the one before it.")
      continue
    if skipped:
      log(f"tf_gba: resuming from {path}, the newest readable checkpoint.")
    return path, skipped
  if skipped:
    # Starting afresh would overwrite what may be days of training: the user decides.
    raise InputError(f"--model_dir={model_dir}: none of its {len(skipped)} checkpoints is "
                     "readable (truncated or incomplete); restore them from a copy, or move them "
                     "away to start afresh.")
  return None, skipped


def first_line(error: Exception) -> str:
  """The first line of an error's message, without TF's op and device decorations."""
  return _first_line(error)


def _first_line(error: Exception) -> str:
  text = str(error).strip() or type(error).__name__
  # TF's op errors wrap the message in the op's device path and name, of no use to the user.
  text = re.sub(r"\{\{[^}]*\}\}\s*", "", text.splitlines()[0])
  return re.sub(r"\s*\[Op:[^\]]*\].*$", "", text)
