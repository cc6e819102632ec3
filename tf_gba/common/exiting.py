"""Ending a process at once (`os._exit`), and removing first what its teardown would have removed.

The training binary and the collective workers end with `os._exit`: TensorFlow's gRPC and
collective threads can hang interpreter teardown, or log about remote handles the stopped cluster
can no longer release. That also skips `atexit` handlers, and one of them matters: TensorFlow's
AutoGraph writes the converted source of every traced Python function to
`<tmp>/__autograph_generated_file*.py` and removes it only from an `atexit` handler, so each run
would leave files there (20 for a `make demo`). `exit_now` removes them first.

Imports nothing beyond the standard library (the binary's supervisor stays free of TensorFlow).
"""

import os
import sys

# AutoGraph's `loader.load_source` names the file and the module it loads from it alike.
_AUTOGRAPH_PREFIX = "__autograph_generated_file"


def remove_autograph_sources() -> int:
  """Deletes the AutoGraph source files of this process's converted functions; returns how many.

  AutoGraph registers each module it loads in `sys.modules` under the file's own name; only
  those are touched, so other processes' files in the same directory stay.
  """
  removed = 0
  for name, module in list(sys.modules.items()):
    if not name.startswith(_AUTOGRAPH_PREFIX):
      continue
    path = getattr(module, "__file__", None)
    if not path or not os.path.basename(path).startswith(_AUTOGRAPH_PREFIX):
      continue
    try:
      os.remove(path)
      removed += 1
    except OSError:
      pass  # already gone (another cleanup, or a tmp reaper): nothing to do
  return removed


def exit_now(code: int) -> None:
  """Flushes stdout and stderr, removes AutoGraph's files, and ends the process with `code`."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass  # a closed or broken pipe: nothing more can be written to it anyway
  remove_autograph_sources()
  os._exit(code)  # pylint: disable=protected-access
