"""Modes are listed in one place: training/mode_registry.py, and two lists below it.

A mode added to the registry must not have to be added by hand to lists elsewhere. Below the
training layer two modules keep their own list, as they may not import the registry
(tests/test_import_graph.py): the parameter servers' buffer rules (tf_gba/distribute/modes.py)
and the cluster simulator (tf_gba/simulate/cluster.py). Every other module of tf_gba/, examples/
and benchmarks/ takes its modes from the registry (`names`, `compared`, `hash_embedding`,
`replayed`, ...) or from those two.

The check reads the source with `ast` (nothing is imported but the registry, for its names): a
literal tuple, list or set, or a dict's literal keys, holding MIN_MODES or more distinct
registered mode names is a list of modes.
"""

import ast
import os
from typing import Dict, Iterable, List, Tuple

from tf_gba.training import mode_registry

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREES = ("tf_gba", "examples", "benchmarks")
REGISTRY = "tf_gba/training/mode_registry.py"
# The lists below the registry's layer, at most two: the PS rules and the simulator.
ALLOWED = ("tf_gba/distribute/modes.py", "tf_gba/simulate/cluster.py")
MIN_MODES = 5


def _strings(nodes: Iterable[ast.AST]) -> List[str]:
  return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def mode_lists(root: str, names: Iterable[str],
               trees: Tuple[str, ...] = TREES) -> Dict[str, List[Tuple[int, List[str]]]]:
  """{file relative to root: [(line, sorted mode names)]} of the literal collections in `trees`
  that name MIN_MODES or more of `names`."""
  names = set(names)
  found: Dict[str, List[Tuple[int, List[str]]]] = {}
  for tree in trees:
    for dirpath, _, files in os.walk(os.path.join(root, tree)):
      for name in sorted(files):
        if not name.endswith(".py"):
          continue
        path = os.path.join(dirpath, name)
        with open(path) as f:
          module = ast.parse(f.read(), path)
        for node in ast.walk(module):
          if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            elements = node.elts
          elif isinstance(node, ast.Dict):
            elements = [k for k in node.keys if k is not None]
          else:
            continue
          modes = sorted(set(_strings(elements)) & names)
          if len(modes) >= MIN_MODES:
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            found.setdefault(rel, []).append((node.lineno, modes))
  return found


def test_modes_are_listed_only_in_the_registry_and_the_two_layers_below_it():
  assert len(ALLOWED) <= 2
  found = mode_lists(_ROOT, mode_registry.names())
  outside = {path: lists for path, lists in found.items()
             if path != REGISTRY and path not in ALLOWED}
  assert not outside, ("lists of modes outside the registry: take them from "
                       f"tf_gba.training.mode_registry (a field of Mode): {outside}")
  # The check sees the lists it allows (it can fail).
  assert set(ALLOWED) <= set(found), found


def test_the_check_finds_each_kind_of_literal(tmp_path):
  (tmp_path / "benchmarks").mkdir()
  (tmp_path / "benchmarks" / "b.py").write_text(
      'A = ("sync", "gba", "async", "bsp", "hop_bs")\n'
      'B = ["sync", "gba", "async", "bsp", "nosuch"]\n'  # four modes: not a list of modes
      'C = {"dts", "auto", "shadow_ma", "shadow_bmuf", "asgd_nodelay"}\n'
      'D = {"sync": 1, "gba": 2, "async": 3, "bsp": 4, "hop_bw": 5}\n'
      'def f(mode):\n'
      '  return mode in ("sync", "gba", "async", "bsp", "hop_bw", "sync")\n')
  found = mode_lists(str(tmp_path), mode_registry.names())
  assert [line for line, _ in found["benchmarks/b.py"]] == [1, 3, 4, 6]
