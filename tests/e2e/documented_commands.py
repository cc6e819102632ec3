"""The training and benchmark commands written in README.md and docs/*.md, as argument lists.

A command is a shell line (backslash continuations joined) in a fenced or indented code block,
or a code span in the text, that runs `examples/train.py` (`python examples/train.py`,
`.venv/bin/python examples/train.py`, or the file alone) or `python -m benchmarks.<name>`. The
page's shell variables are expanded as bash would (`B="python -m benchmarks.switching ..."`, then
`$B --sweep`; `TF_CONFIG="{... $CLUSTER ...}"`), leading `NAME=value` words are the command's
environment, comments and a trailing `&` are dropped.

Example:

  for command in documented_commands.extract(root):
    print(command.where, command.program, command.args, command.env)
"""

import dataclasses
import glob
import os
import re
import shlex
from typing import Dict, List, Optional, Tuple

TRAIN = "examples/train.py"
_BENCHMARK = re.compile(r"^benchmarks\.(\w+)$")
_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
# Code blocks in these languages hold no shell commands.
_NOT_SHELL = ("python", "py", "yaml", "yml", "json")


@dataclasses.dataclass
class Command:
  where: str          # page:line of the command's first line
  program: str        # "examples/train.py" or "benchmarks.<name>"
  args: List[str]     # the flags, as bash would pass them
  env: Dict[str, str]  # NAME=value words before the interpreter
  text: str           # the line as written (continuations joined)


def pages(root: str) -> List[str]:
  """README.md and every docs/*.md, relative to `root`."""
  return ["README.md"] + sorted(os.path.relpath(p, root) for p in
                                glob.glob(os.path.join(root, "docs", "*.md")))


def _expand(text: str, variables: Dict[str, str]) -> str:
  """`$NAME` and `${NAME}` of `variables` outside single quotes, as bash expands them."""
  out, quote, i = [], None, 0
  while i < len(text):
    c = text[i]
    if c == "\\" and quote != "'" and i + 1 < len(text):
      out.append(text[i:i + 2])
      i += 2
      continue
    if c in "'\"" and quote in (None, c):
      quote = None if quote == c else c
    elif c == "$" and quote != "'":
      m = _VARIABLE.match(text, i)
      if m and (m.group(1) or m.group(2)) in variables:
        value = variables[m.group(1) or m.group(2)]
        # Inside double quotes the value is one literal string; outside, bash splits it into
        # words and takes their quotes literally.
        out.append(value.replace("\\", "\\\\").replace('"', '\\"') if quote == '"' else
                   " ".join(shlex.quote(w) for w in value.split()))
        i = m.end()
        continue
    out.append(c)
    i += 1
  return "".join(out)


def _blocks(text: str) -> List[Tuple[int, List[str], bool]]:
  """(first line number, lines, is a code span) of each code block and code span, in order."""
  lines = text.split("\n")
  blocks, prose = [], []  # prose: (line number, text) outside code blocks
  i = 0
  while i < len(lines):
    line = lines[i]
    fence = re.match(r"^\s*```\s*(\S*)", line)
    if fence:
      j = i + 1
      while j < len(lines) and not re.match(r"^\s*```", lines[j]):
        j += 1
      if fence.group(1).lower() not in _NOT_SHELL:
        blocks.append((i + 2, lines[i + 1:j], False))
      i = j + 1
      continue
    if line.startswith("    ") and (i == 0 or not lines[i - 1].strip()):
      j = i
      while j < len(lines) and (lines[j].startswith("    ") or
                                (not lines[j].strip() and j + 1 < len(lines) and
                                 lines[j + 1].startswith("    "))):
        j += 1
      blocks.append((i + 1, [l[4:] for l in lines[i:j]], False))
      i = j
      continue
    prose.append((i + 1, line))
    i += 1
  # Code spans, which may run over a line break within a paragraph.
  joined = "\n".join(l for _, l in prose)
  starts = []
  count = 0
  for number, l in prose:
    starts.append((count, number))
    count += len(l) + 1
  for m in re.finditer(r"`([^`]+)`", joined):
    number = max(n for offset, n in starts if offset <= m.start())
    blocks.append((number, [" ".join(m.group(1).split())], True))
  blocks.sort(key=lambda b: b[0])
  return blocks


def _logical_lines(lines: List[str]) -> List[Tuple[int, str]]:
  """(offset of the first line, text) of each shell line, backslash continuations joined."""
  out, current, first = [], [], 0
  for k, line in enumerate(lines):
    if not current:
      first = k
    if line.rstrip().endswith("\\"):
      current.append(line.rstrip()[:-1])
      continue
    current.append(line)
    out.append((first, " ".join(part.strip() for part in current)))
    current = []
  if current:
    out.append((first, " ".join(part.strip() for part in current)))
  return out


def _command(words: List[str]) -> Optional[Tuple[Dict[str, str], str, List[str]]]:
  """(environment, program, arguments) if `words` run the binary or a benchmark."""
  env = {}
  k = 0
  while k < len(words) and _ASSIGNMENT.match(words[k]):
    name, value = _ASSIGNMENT.match(words[k]).groups()
    env[name] = value
    k += 1
  rest = words[k:]
  if rest and rest[-1] == "&":
    rest = rest[:-1]
  if rest and os.path.basename(rest[0]).startswith("python"):
    rest = rest[1:]
    if len(rest) >= 2 and rest[0] == "-m" and _BENCHMARK.match(rest[1]):
      return env, rest[1], rest[2:]
  if rest and rest[0] == TRAIN:
    return env, TRAIN, rest[1:]
  return None


def extract_page(root: str, page: str) -> List[Command]:
  with open(os.path.join(root, page)) as f:
    text = f.read()
  variables = {"PWD": root}
  commands = []
  for number, lines, span in _blocks(text):
    for offset, line in _logical_lines(lines):
      if not line.strip():
        continue
      expanded = _expand(line, variables)
      try:
        words = shlex.split(expanded, comments=True)
      except ValueError:
        continue  # not a shell line (prose in a code span)
      if not words:
        continue
      if all(_ASSIGNMENT.match(w) for w in words) and not span:
        for w in words:
          name, value = _ASSIGNMENT.match(w).groups()
          variables[name] = value
        continue
      found = _command(words)
      if found is None or (span and found[1] == TRAIN and not found[2] and
                           not line.strip().startswith(("python", ".venv"))):
        continue  # a code span naming the file, not a command
      env, program, args = found
      commands.append(Command(f"{page}:{number + offset}", program, args, env, line.strip()))
  return commands


def extract(root: str) -> List[Command]:
  """Every documented command of README.md and docs/*.md, page by page."""
  return [c for page in pages(root) for c in extract_page(root, page)]
