"""The README is the front door: short, and a link to every page under docs/.

The pages are whatever docs/*.md exist when the test runs, so a new page fails here until the
README links it.
"""

import glob
import os
import re

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The README's budget: what tf_gba is, set-up, the two commands, the snippet, the modes, the
# binary's main flags and the links; everything else lives under docs/.
MAX_README_LINES = 250


def _read(*parts: str) -> str:
  with open(os.path.join(_ROOT, *parts)) as f:
    return f.read()


def _links(text: str):
  """Targets of the Markdown links `[text](target)`, without their #anchors."""
  return [m.group(1).partition("#")[0] for m in re.finditer(r"\]\(([^)\s]+)\)", text)]


def test_readme_links_every_docs_page():
  pages = sorted(os.path.relpath(p, _ROOT).replace(os.sep, "/")
                 for p in glob.glob(os.path.join(_ROOT, "docs", "*.md")))
  assert "docs/evaluation.md" in pages  # the glob looks where the pages are
  linked = set(_links(_read("README.md")))
  missing = [p for p in pages if p not in linked]
  assert not missing, f"README.md does not link {missing}; add a line under 'Documentation'"


def test_readme_is_short_and_keeps_the_two_commands():
  text = _read("README.md")
  assert len(text.splitlines()) <= MAX_README_LINES
  # .ci/run runs `make test` as "the README's test command".
  block = re.search(r"```\n(make demo[^\n]*\nmake test[^\n]*)\n```", text)
  assert block, "README.md lost its set-up block (make demo, make test)"
  assert "`make test` is\nthe test command" in text or "`make test` is the test command" in text


def test_links_between_docs_pages_resolve():
  for path in glob.glob(os.path.join(_ROOT, "docs", "*.md")):
    for target in _links(_read(path)):
      if re.match(r"[a-z]+:", target) or not target:
        continue  # a URL or an anchor of the page itself
      resolved = os.path.normpath(os.path.join(os.path.dirname(path), target))
      assert os.path.exists(resolved), f"{os.path.relpath(path, _ROOT)} links {target}, absent"
