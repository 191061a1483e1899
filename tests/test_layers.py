"""The house: imports point one way, and no module grows past about 600 lines.

DESIGN.md draws nbmem in layers; a module imports only from layers below its
own, lazy imports (inside functions) and ``TYPE_CHECKING`` imports included.
Two modules that need each other mean a piece belongs lower down, or a result
should be returned rather than a function imported. This test reads every
module's imports with ``ast`` (nothing is imported) and fails on the first
cycle it finds, naming it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nbmem"

#: "about 600 lines" (the design card); a little slack so a docstring does not fail CI.
MAX_LINES = 620


def _imports(path: Path) -> set[str]:
    """The nbmem modules that ``path`` imports, at any depth of the file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:  # from .tracking import Tracker
                names.add(node.module.split(".")[0])
            elif node.level == 1:  # from . import display
                names.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith("nbmem."):
                names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith("nbmem."))
    return names


def _graph() -> dict[str, set[str]]:
    modules = {path.stem: path for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    return {name: _imports(path) & set(modules) - {name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at the end), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = "open"
        stack.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_the_checker_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_imports_point_one_way():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_package_imports_no_module_twice_by_two_names():
    # `from . import display` and `from .display import x` both count as display
    assert "results" in _imports(PACKAGE / "display.py")
    assert "units" in _imports(PACKAGE / "results.py")


def test_no_module_is_over_about_600_lines():
    long = {path.name: n for path in PACKAGE.glob("*.py") if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules (over {MAX_LINES} lines): {long}"
