"""Dry-runs many command lines of the training binary and the benchmarks in one process.

  python tests/e2e/documented_commands_check.py commands.json results.json

commands.json: a list of {"program": "examples/train.py" | "benchmarks.<name>", "args": [...],
"env": {...}}. Each is run as its own process would run it, with `--dry_run` added: the binary
through its entry point (`_entry`: the mode-flag check, the configuration, the pre-flight
checks), a benchmark through its `main`. What a process exit would end is caught instead
(`exiting.exit_now`, `SystemExit`), so one TensorFlow start serves every command. A benchmark
whose dry run prints the binary's command lines (`examples/train.py ...`, the runs it would
start) has each of them dry-run too, under "planned".

results.json: per command {"rc", "stdout", "stderr", "planned": [results]}.
"""

import contextlib
import importlib
import io
import json
import os
import shlex
import sys
import tempfile
import time
import traceback

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)

from absl import app  # noqa: E402,F401  (defines absl's own flags, as in every program)
from absl import flags  # noqa: E402

FLAGS = flags.FLAGS
_BASE_FLAGS = set(FLAGS)  # absl's own (--verbosity, ...): every program keeps them


class _Exit(BaseException):
  """What ends the process in a real run: exit_now(code)."""

  def __init__(self, code: int):
    super().__init__(code)
    self.code = code


class _Exiting:
  """Stands in for tf_gba.common.exiting in the binary's module."""

  @staticmethod
  def exit_now(code: int) -> None:
    raise _Exit(code)


def _load_train():
  spec = importlib.util.spec_from_file_location(
      "documented_train", os.path.join(_ROOT, "examples", "train.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  module.exiting = _Exiting
  return module


_TRAIN = _load_train()
_DEFINED = {"by": None}  # which program's flags FLAGS holds


def _flags_of(program: str, define) -> None:
  """FLAGS holds absl's own flags and `program`'s, freshly defined (programs share names)."""
  if _DEFINED["by"] == program:
    FLAGS.unparse_flags()
    return
  for name in [n for n in FLAGS if n not in _BASE_FLAGS]:
    delattr(FLAGS, name)
  define()
  _DEFINED["by"] = program


@contextlib.contextmanager
def _captured(result: dict, env: dict):
  """stdout and stderr (Python's and file descriptor 2's) into `result`; `env` set meanwhile."""
  saved_env = dict(os.environ)
  os.environ.update(env)
  sys.stdout.flush()
  sys.stderr.flush()
  saved_fd2, saved_out, saved_err = os.dup(2), sys.stdout, sys.stderr
  with tempfile.TemporaryFile(mode="w+") as err_file:
    os.dup2(err_file.fileno(), 2)
    ours = os.fdopen(os.dup(2), "w", buffering=1)
    sys.stdout, sys.stderr = io.StringIO(), ours
    try:
      yield
    finally:
      result["stdout"] = sys.stdout.getvalue()
      for stream in {ours, sys.stderr} - {saved_err}:
        stream.close()  # ours, and the binary's copy of the terminal (_quiet_stderr)
      sys.stdout, sys.stderr = saved_out, saved_err
      os.dup2(saved_fd2, 2)
      os.close(saved_fd2)
      err_file.seek(0)
      result["stderr"] = err_file.read()
      os.environ.clear()
      os.environ.update(saved_env)


def dry_run_train(args, env) -> dict:
  result = {"rc": None}
  with _captured(result, env):
    _flags_of("examples/train.py", _TRAIN.define_flags)
    # pylint: disable-next=protected-access
    argv = _TRAIN._named_verbosity(["examples/train.py", *args, "--dry_run"])
    try:
      # As app.run: the binary's own parser (a flag error is one line, exit 2), then the entry
      # point with the words that are not flags.
      rest = _TRAIN._parse_flags(argv)  # pylint: disable=protected-access
      _TRAIN._entry(rest)  # pylint: disable=protected-access
      result["rc"] = 0  # (the binary ends with exit_now(0))
    except _Exit as e:
      result["rc"] = e.code
  return result


def dry_run_benchmark(program, args, env) -> dict:
  result = {"rc": None}
  with _captured(result, env):
    module = importlib.import_module(program)
    argv = [*args, "--dry_run"]
    try:
      if hasattr(module, "define_flags"):  # absl flags
        _flags_of(program, module.define_flags)
        FLAGS([program, *argv])
        module.main([program, *argv])
      else:  # argparse
        module.main(argv)
      result["rc"] = 0
    except flags.Error as e:
      print(f"FATAL Flags parsing error: {e}", file=sys.stderr)
      result["rc"] = 1
    except SystemExit as e:
      if isinstance(e.code, str):
        print(e.code, file=sys.stderr)  # as the interpreter prints it
      result["rc"] = e.code if isinstance(e.code, int) else 1
  planned = [shlex.split(l) for l in result["stdout"].splitlines()
             if l.startswith("examples/train.py ")]
  result["planned"] = [dict(dry_run_train(words[1:], env), command=" ".join(words))
                       for words in planned]
  return result


def _dry_run(command: dict) -> dict:
  """One command's result; an exception it raises is its traceback and exit code 1, as in a
  process of its own."""
  started = time.perf_counter()
  try:
    if command["program"] == "examples/train.py":
      result = dry_run_train(command["args"], command.get("env", {}))
    else:
      result = dry_run_benchmark(command["program"], command["args"], command.get("env", {}))
  except Exception:  # pylint: disable=broad-except
    result = {"rc": 1, "stdout": "", "stderr": traceback.format_exc()}
  result["seconds"] = time.perf_counter() - started
  return result


def main(argv) -> int:
  with open(argv[1]) as f:
    commands = json.load(f)
  results = [_dry_run(command) for command in commands]
  with open(argv[2], "w") as f:
    json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  os.chdir(_ROOT)
  sys.exit(main(sys.argv))
