"""tf_gba's imports go one way, down the layers, and form no cycle.

Layers, lowest first: common <- ops <- data, layers <- models <- distribute <- optimizers,
simulate <- training (examples and benchmarks sit on top and are not walked). A module may import
its own subpackage or a lower layer, never a higher one or a sibling of its own rank. Every import
statement counts, also those inside functions: an import deferred to break a cycle is still a
dependency. The graph is read from the source with `ast`; nothing is imported.
"""

import ast
import os
from typing import Dict, List, Set, Tuple

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "tf_gba"
RANK = {"common": 0, "ops": 1, "data": 2, "layers": 2, "models": 3, "distribute": 4,
        "optimizers": 5, "simulate": 5, "training": 6}


def module_files(root: str, package: str = PACKAGE) -> Dict[str, str]:
  """Module name -> file, for every .py below root/package."""
  out = {}
  for dirpath, _, files in os.walk(os.path.join(root, package)):
    for name in files:
      if not name.endswith(".py"):
        continue
      rel = os.path.relpath(os.path.join(dirpath, name), root)[:-3].split(os.sep)
      if rel[-1] == "__init__":
        rel = rel[:-1]
      out[".".join(rel)] = os.path.join(dirpath, name)
  return out


def import_edges(root: str, package: str = PACKAGE) -> List[Tuple[str, str, int]]:
  """(importer, imported module, line) for every import of `package` in its own modules."""
  modules = module_files(root, package)
  edges = []
  for name, path in sorted(modules.items()):
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    for node in ast.walk(tree):
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: resolved against this module's package
          parts = name.split(".")[:len(name.split(".")) - node.level + (1 if is_package else 0)]
          base = ".".join(parts + ([base] if base else []))
        # `from pkg import sub` imports the submodule when there is one, else pkg itself.
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                   for a in node.names]
      for target in targets:
        if target == package or target.startswith(package + "."):
          while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]
          if target != name:
            edges.append((name, target, node.lineno))
  return edges


def layer(module: str) -> str:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else ""


def layer_violations(edges) -> List[str]:
  bad = []
  for src, dst, line in edges:
    a, b = layer(src), layer(dst)
    if a == b or not b:
      continue  # within a subpackage, or the root package (it imports nothing)
    if a not in RANK or b not in RANK:
      bad.append(f"{src}:{line} -> {dst}: subpackage not in the layer list {sorted(RANK)}")
    elif RANK[b] >= RANK[a]:
      bad.append(f"{src}:{line} -> {dst}: {a} (layer {RANK[a]}) imports {b} (layer {RANK[b]})")
  return bad


def find_cycle(edges) -> List[str]:
  """One cycle of the module graph as [m0, m1, ..., m0], or [] if there is none."""
  graph: Dict[str, Set[str]] = {}
  for src, dst, _ in edges:
    graph.setdefault(src, set()).add(dst)
  state: Dict[str, int] = {}  # 1: on the current path, 2: done
  path: List[str] = []

  def visit(node):
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    state[node] = 2
    path.pop()
    return []

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return []


def test_every_subpackage_has_a_layer():
  names = {layer(m) for m in module_files(_ROOT)} - {""}
  assert names <= set(RANK), f"subpackages without a layer: {sorted(names - set(RANK))}"


def test_imports_point_down_the_layers():
  edges = import_edges(_ROOT)
  assert len(edges) > 50  # the walk found the package's imports
  bad = layer_violations(edges)
  assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def test_no_import_cycle():
  cycle = find_cycle(import_edges(_ROOT))
  assert not cycle, "import cycle: " + " -> ".join(cycle)


def _tree(tmp_path, files: Dict[str, str]) -> str:
  for rel, text in files.items():
    path = tmp_path / PACKAGE / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  return str(tmp_path)


def test_the_checks_report_an_upward_edge_and_a_cycle(tmp_path):
  root = _tree(tmp_path, {
      "__init__.py": "",
      "ops/__init__.py": "",
      "ops/a.py": "def f():\n  from tf_gba.training import metrics\n",
      "training/metrics.py": "",
      "training/__init__.py": "from tf_gba.training.runner import run\n",
      "training/runner.py": "from . import sync_job\nimport tf_gba.ops.a\n",
      "training/sync_job.py": "from tf_gba.training import runner\n",
  })
  edges = import_edges(root)
  assert ("tf_gba.training.runner", "tf_gba.training.sync_job", 1) in edges  # relative import
  assert layer_violations(edges) == [
      "tf_gba.ops.a:2 -> tf_gba.training.metrics: ops (layer 1) imports training (layer 6)"]
  cycle = find_cycle(edges)
  assert cycle == ["tf_gba.training.runner", "tf_gba.training.sync_job",
                   "tf_gba.training.runner"]


@pytest.mark.parametrize("text", ["import os\n", "from typing import List\n"])
def test_outside_imports_are_not_edges(tmp_path, text):
  root = _tree(tmp_path, {"__init__.py": "", "ops/__init__.py": "", "ops/a.py": text})
  assert import_edges(root) == []
