"""Benchmarks of tf_gba, each run as `python -m benchmarks.<name>` (see the README)."""

import argparse
import os
import sys
import tempfile
from typing import NoReturn

# TensorFlow's start-up notices (CPU features, oneDNN, no CUDA driver) are not results: keep them
# off the terminal unless the user asked for TF's log level, as the training binary does.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _quiet_native_stderr() -> None:
  """Sends what TF's C++ runtime writes on file descriptor 2 to a log file; Python keeps the
  terminal (progress, argparse errors, tracebacks go through `sys.stderr`).

  TF 2.21 prints its absl start-up notices (and, when a local cluster goes away, lines about
  remote handles it can no longer release) straight to descriptor 2, whatever
  TF_CPP_MIN_LOG_LEVEL says, as the training binary found (examples/train.py). Only when a
  benchmark runs as a program: `python -m benchmarks.<name>` imports this package while
  `sys.argv[0]` is still "-m"; tests that import a benchmark keep their own stderr.
  TF_GBA_BENCH_STDERR=1 keeps everything on the terminal.
  """
  if sys.argv[:1] != ["-m"] or os.environ.get("TF_GBA_BENCH_STDERR") == "1":
    return
  path = os.path.join(tempfile.gettempdir(), f"tf_gba_bench_{os.getpid()}.log")
  terminal = os.dup(2)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  os.dup2(fd, 2)
  os.close(fd)
  sys.stderr = os.fdopen(terminal, "w", buffering=1)


_quiet_native_stderr()


def refuse(program: str, message: str) -> NoReturn:
  """A flag or protocol that cannot give a meaningful result, refused as the training binary
  refuses its input: one line on stderr ("<program>: error: <message>", the message naming the
  flag that fixes it) and exit code 2, before anything runs."""
  print(f"{program}: error: {message}", file=sys.stderr, flush=True)
  sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
  """argparse whose errors are `refuse`'s one line (no usage block: --help shows it)."""

  def __init__(self, *args, program: str, **kwargs):
    super().__init__(*args, **kwargs)
    self.program = program

  def error(self, message: str) -> NoReturn:
    refuse(self.program, message)
