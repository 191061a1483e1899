"""The house: layers as folders, imports pointing down, no module past about 600 lines.

nbmem is five layers, one subpackage each, bottom to top (DESIGN.md's
picture): ``core`` (plain data and arithmetic), ``tracking`` (measured and
tracked runs), ``estimation`` (fake-tensor steps), ``whatif`` (sweeps, batch
sizes, launches) and ``frontend`` (magics, display, CLI). A module imports
only from its own layer or the ones below, lazy imports (inside functions) and
``TYPE_CHECKING`` imports included, and never in a cycle. This test reads every
module's imports with ``ast`` (nothing is imported), resolves each to the
module file it names, and fails on an import it can't resolve (so no edge goes
unchecked), an import pointing up, or a cycle, naming it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nbmem"

#: bottom to top
LAYERS = ("core", "tracking", "estimation", "whatif", "frontend")

#: "about 600 lines" (the design card); a little slack so a docstring does not fail CI.
MAX_LINES = 620


def _name(path: Path) -> str:
    """``nbmem/tracking/scope.py`` -> ``tracking.scope``; a package's ``__init__`` -> the package."""
    root = next(parent for parent in path.parents if parent.name == "nbmem")
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {_name(path): path for path in root.rglob("*.py")}


def _imports(path: Path, known: set[str]) -> tuple[set[str], list[str]]:
    """The nbmem modules ``path`` imports, at any depth of the file, and the imports it names that resolve to none."""
    here = _name(path).split(".") if _name(path) else []
    package = here if path.name == "__init__.py" else here[:-1]
    found: set[str] = set()
    unknown: list[str] = []

    def resolve(target: list[str], names: list[str]) -> None:
        base = ".".join(target)
        for name in names:  # `from .core import units` names a module; `from .units import x` a name in one
            candidate = f"{base}.{name}" if base else name
            if candidate in known:
                found.add(candidate)
                continue
            if base in known:
                found.add(base)
            else:
                unknown.append(candidate)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                up = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                if node.level - 1 > len(package):
                    unknown.append("." * node.level + (node.module or ""))
                    continue
                target = up + (node.module.split(".") if node.module else [])
            elif node.module and (node.module == "nbmem" or node.module.startswith("nbmem.")):
                target = node.module.split(".")[1:]
            else:
                continue
            resolve(target, [alias.name for alias in node.names])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nbmem."):
                    name = alias.name.split(".", 1)[1]
                    (found.add(name) if name in known else unknown.append(name))
    return found - {_name(path)}, unknown


def _graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    modules = _modules(root)
    known = set(modules)
    return {name: _imports(path, known)[0] for name, path in modules.items()}


def _layer(module: str) -> int | None:
    """The layer's height (0 = core), or None for the package's own top modules."""
    first = module.split(".")[0]
    return LAYERS.index(first) if first in LAYERS else None


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a layer to one above it, as "importer -> imported"."""
    wrong = []
    for importer, targets in graph.items():
        height = _layer(importer)
        if height is None:  # nbmem/__init__.py and __main__.py: the public API, above every layer
            continue
        # "" is nbmem/__init__.py, whose body imports no layer (PEP 562 lazy names): `from .. import
        # __version__` there is the package's metadata, not a way up
        wrong += [f"{importer} -> {target}" for target in sorted(targets) if target
                  and (_layer(target) is None or _layer(target) > height)]
    return wrong


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at the end), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = "open"
        stack.append(name)
        for target in sorted(graph.get(name, ())):
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


def test_the_checker_resolves_every_import_form_and_finds_an_upward_one(tmp_path):
    root = tmp_path / "nbmem"
    for package in ("", "core", "tracking", "frontend"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text('"""x"""\n')
    (root / "core" / "units.py").write_text("def f():\n    from ..frontend.magics import load\n")
    (root / "core" / "results.py").write_text("from . import units\nfrom .units import f\n")
    (root / "tracking" / "scope.py").write_text("import nbmem.core.units\nfrom nbmem.core import results\n"
                                                "from ..core.missing import x\n")
    (root / "frontend" / "magics.py").write_text("from ..tracking.scope import measure\n")
    modules = _modules(root)
    known = set(modules)
    graph = {name: _imports(path, known)[0] for name, path in modules.items()}
    assert graph["core.results"] == {"core.units"}
    assert graph["tracking.scope"] == {"core.units", "core.results"}
    assert _imports(modules["tracking.scope"], known)[1] == ["core.missing.x"]
    assert _upward(graph) == ["core.units -> frontend.magics"]  # a lazy import inside a function counts


def test_every_nbmem_import_resolves_to_a_module():
    # so that no edge of the graph below is silently missing
    modules = _modules()
    unknown = {name: missing for name, path in modules.items() if (missing := _imports(path, set(modules))[1])}
    assert not unknown, f"imports naming no nbmem module: {unknown}"


def test_the_folders_are_the_layers():
    top = {path.name for path in PACKAGE.iterdir() if path.suffix == ".py" or path.is_dir()} - {"__pycache__"}
    assert top == {"__init__.py", "__main__.py", *LAYERS}, "a module outside the layers: give it a layer"
    for layer in LAYERS:
        init = PACKAGE / layer / "__init__.py"
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree), f"{init} should say in a few lines what lives there"
        # a layer's __init__ stays light: importing nbmem.tracking must not import its modules
        assert not [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))], init


def test_imports_point_down_the_layers():
    wrong = _upward(_graph())
    assert not wrong, "imports pointing up a layer: " + ", ".join(wrong)


def test_imports_point_one_way():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_module_is_over_about_600_lines():
    long = {_name(path): n for path in PACKAGE.rglob("*.py") if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules (over {MAX_LINES} lines): {long}"
