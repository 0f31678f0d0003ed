"""The package's import graph: no module imports itself through others, type-only imports included.

``docs/development.md`` (the module map) layers the modules; a circle, even
one under ``if TYPE_CHECKING:``, means two modules can only be read together.
"""

import ast
import pathlib

import kldiv_jax

PACKAGE = pathlib.Path(kldiv_jax.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
  """The package's modules that ``path`` imports anywhere (functions and ``TYPE_CHECKING`` included)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      parts = node.module.split(".")
      if node.level == 0 and parts[0] == "kldiv_jax" and len(parts) > 1:
        out.add(parts[1])
      elif node.level == 1:
        out.add(parts[0])
    elif isinstance(node, ast.Import):
      out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("kldiv_jax."))
  return out - {path.stem}


def import_cycles(package: pathlib.Path) -> list[list[str]]:
  """Every circle of the import graph of ``package``'s modules, each from its smallest name."""
  graph = {p.stem: _imports(p) for p in package.glob("*.py")}
  cycles = set()

  def walk(path: list[str]) -> None:
    for nxt in sorted(graph.get(path[-1], ())):
      if nxt == path[0]:
        cycles.add(tuple(path))
      elif nxt not in path and nxt > path[0]:
        walk([*path, nxt])

  for start in sorted(graph):
    walk([start])
  return [list(c) for c in sorted(cycles)]


def test_no_import_cycle():
  assert import_cycles(PACKAGE) == []
