"""Every file the prose names is there: paths in the docs (README.md files, docs/*.md) and in the
docstrings and comments of the Python files, and the tree of docs/layout.md, which also lists
every module of the shipped packages. (Relative links of the docs, and their anchors, are
tests/test_docs.py's; names of functions and classes, tests/test_named_code.py's.)

A path from the repository's root (`gateway/dense/routes.py`, `docs/cache.md`, `bench/`) must
exist; an all-capital word in it stands for any name (`scripts/ENGINE-wheels.txt`). A shorter
name of a Python or Markdown file (`mlx/lora.py`, `shared_memory.py`, as a module's neighbours
are named) must be the end of some file's path."""

from __future__ import annotations

import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("gateway", "backends", "client", "tests", "bench", "docs", "scripts", "helm", "openapi")
# A path starts where no path, URL, or word goes on: `https://x/bench/a.py` and `../docs/a.md`
# (a link, tests/test_docs.py's) are not names of this repository's files.
_START = r"(?<![\w./@~$:%-])"
FROM_ROOT = re.compile(_START + rf"((?:{'|'.join(TOP)})/[\w./-]*)")
SHORT = re.compile(_START + r"((?:[\w-]+/)*[\w-]+\.(?:py|md))\b")
PLACEHOLDER = re.compile(r"(?<![A-Za-z])[A-Z][A-Z_]*[A-Z](?![A-Za-z])")
# Files of other projects that the prose names, and whose they are.
ELSEWHERE = {
    "srt/": "SGLang's source tree, python/sglang/srt/",
    "sglang/srt/": "SGLang's source tree, as its package names it",
    "http_server.py": "SGLang's HTTP server, whose weight endpoints a test stand-in answers as",
}
SKIPPED = {"__pycache__", "build", "dist", "node_modules"}


def repository_files(root: Path) -> list[Path]:
    return [
        path
        for path in root.rglob("*")
        if path.is_file()
        and not any(
            p.startswith(".") or p in SKIPPED or p.endswith(".egg-info") for p in path.relative_to(root).parts
        )
    ]


def prose(root: Path) -> Iterator[tuple[Path, int, str]]:
    """(file, line, text) of every piece of prose: each Markdown document of the docs whole, and
    each docstring and comment of the Python files."""
    files = repository_files(root)
    for path in files:
        if path.suffix == ".md" and (path.name.startswith("README") or path.parent == root / "docs"):
            yield path, 1, path.read_text()
        elif path.suffix == ".py":
            yield from _python_prose(path)


def _python_prose(path: Path) -> Iterator[tuple[Path, int, str]]:
    """Comments, and strings that are statements of their own: docstrings (told from the tokens
    alone, as parsing every file too would double the time)."""
    code = []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type == tokenize.COMMENT:
            yield path, token.start[0], token.string
        elif token.type != tokenize.NL:
            code.append(token)
    statement_start = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    for i, token in enumerate(code):
        if (
            token.type == tokenize.STRING
            and (i == 0 or code[i - 1].type in statement_start)
            and code[i + 1].type in (tokenize.NEWLINE, tokenize.ENDMARKER)
        ):
            yield path, token.start[0], token.string


def missing_paths(root: Path) -> list[str]:
    """`file:line: path` for each path the prose names that is not there."""
    tails = set()
    for path in repository_files(root):
        parts = path.relative_to(root).parts
        tails.update("/".join(parts[i:]) for i in range(len(parts)))
    missing = []
    for path, first_line, text in prose(root):
        for match in [*FROM_ROOT.finditer(text), *SHORT.finditer(text)]:
            name = match.group(1).rstrip(".-")
            if match.re is FROM_ROOT:
                found = (root / name).exists() or any(root.glob(PLACEHOLDER.sub("*", name).rstrip("/")))
            else:
                found = name.split("/")[0] in TOP or name in tails or name.startswith(tuple(ELSEWHERE))
            if not found:
                line = first_line + text.count("\n", 0, match.start())
                missing.append((str(path.relative_to(root)), line, name))
    return [f"{path}:{line}: {name}" for path, line, name in sorted(missing)]


def layout_tree(root: Path) -> list[str]:
    """The paths of the tree at the top of docs/layout.md: an entry is a line's first word at an
    indent under 16 (deeper lines go on describing the entry above), inside the entries above it
    with less indent."""
    text = (root / "docs" / "layout.md").read_text()
    tree = re.search(r"^```\n(.*?)^```", text, re.S | re.M).group(1)
    parents: list[tuple[int, str]] = []
    paths = []
    for line in tree.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent >= 16:
            continue
        while parents and parents[-1][0] >= indent:
            parents.pop()
        path = "".join(p for _, p in parents) + line.split()[0]
        paths.append(path)
        if path.endswith("/"):
            parents.append((indent, line.split()[0]))
    return paths


def layout_mismatches(root: Path) -> list[str]:
    """What the tree of docs/layout.md names that is not there, and the modules of the shipped
    packages it leaves out. A folder listed without entries of its own (`schemas/`) stands for
    all its modules."""
    listed = layout_tree(root)
    found = [f"{p}: no such file" for p in listed if not (root / p).exists()]
    whole = [p for p in listed if p.endswith("/") and not any(q != p and q.startswith(p) for q in listed)]
    for package in ("gateway", "backends", "client/logprob_gateway_client"):
        for module in sorted((root / package).rglob("*.py")):
            name = str(module.relative_to(root))
            if module.name != "__init__.py" and name not in listed and not name.startswith(tuple(whole)):
                found.append(f"{name}: not in the tree")
    return found


def test_every_path_the_prose_names_is_there():
    assert missing_paths(ROOT) == []


def test_the_layout_tree_is_the_tree():
    assert layout_mismatches(ROOT) == []


def test_the_checks_read_what_they_check():
    assert "gateway/openai/tool_reader.py" in layout_tree(ROOT)
    assert "client/logprob_gateway_client/lm.py" in layout_tree(ROOT)
    names = {m.group(1) for _, _, text in prose(ROOT) for m in FROM_ROOT.finditer(text)}
    assert "backends/engine.py" in names and "docs/layout.md" in names


def _scratch(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "layout.md").write_text(
        "# Layout\n\n```\n"
        "gateway/        the app\n"
        "  app.py        create_app\n"
        "                and a line that goes on\n"
        "  dense/\n"
        "    routes.py   rows\n"
        "  schemas/      wire types, one module per API family\n"
        "backends/\n"
        "  engine.py     the contract\n"
        "```\n"
    )
    for module in (
        "gateway/app.py",
        "gateway/dense/routes.py",
        "gateway/schemas/chat.py",
        "backends/engine.py",
        "backends/mlx/lora.py",
    ):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text('"""A module."""\n')
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "vllm-wheels.txt").write_text("")
    return tmp_path


def test_a_missing_path_is_found_in_docs_docstrings_and_comments(tmp_path):
    root = _scratch(tmp_path)
    assert missing_paths(root) == []
    (root / "README.md").write_text(
        "See `gateway/app.py`, docs/layout.md, [a link](../bench/gone.py), https://x.org/bench/gone.py,\n"
        "scripts/ENGINE-wheels.txt and backends/.\nThen gateway/gone.py and docs/gone.md#anchor.\n"
    )
    (root / "backends" / "engine.py").write_text(
        '"""The contract (backends/types.py; lora.py, mlx/lora.py)."""\n\n\n'
        'def f():\n    """Its rows (gateway/dense/routes.py, grammar_text.py)."""\n'
        '    return "backends/strings/are/code.py"  # see bench/gone/\n'
    )
    assert missing_paths(root) == [
        "README.md:3: docs/gone.md",
        "README.md:3: gateway/gone.py",
        "backends/engine.py:1: backends/types.py",
        "backends/engine.py:5: grammar_text.py",
        "backends/engine.py:6: bench/gone/",
    ]


def test_the_layout_tree_is_read_and_checked_both_ways(tmp_path):
    root = _scratch(tmp_path)
    assert layout_tree(root) == [
        "gateway/",
        "gateway/app.py",
        "gateway/dense/",
        "gateway/dense/routes.py",
        "gateway/schemas/",
        "backends/",
        "backends/engine.py",
    ]
    assert layout_mismatches(root) == ["backends/mlx/lora.py: not in the tree"]
    (root / "gateway" / "app.py").unlink()
    assert layout_mismatches(root) == [
        "gateway/app.py: no such file",
        "backends/mlx/lora.py: not in the tree",
    ]
