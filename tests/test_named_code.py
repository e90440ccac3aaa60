"""Every function and class the prose names is there: in the docstrings and comments of gateway/,
backends/, client/ and bench/, and in README.md and docs/*.md (files are tests/test_named_paths.py's).

A name is checked where its shape says it is code: in backticks, a CamelCase class (`DenseService`),
a call (`place_rows(rows, out)`, `host_memory.empty(n)`), or either with members
(`DenseService.rows`); outside backticks, `Class.member` and `name()`; anywhere, a dotted path
into this repository's modules (`gateway.dense.service.Admission`). It must be defined in some
Python file of the repository (a class, a function, a method, a module's or class's assigned
name), and a member in its class or a class it derives from; or come from elsewhere: a name the
code imports or calls on an object, a builtin, or one of NAMED_ELSEWHERE."""

from __future__ import annotations

import ast
import builtins
import functools
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from tests.test_named_paths import ROOT, prose, repository_files

CHECKED = ("gateway", "backends", "client", "bench", "docs", "README.md")
PACKAGES = ("gateway", "backends", "bench", "logprob_gateway_client", "tests")
# Names the prose uses that are no code of this repository, and that the code neither imports
# nor calls, and whose they are.
NAMED_ELSEWHERE = {
    "AsyncSGLTransformer": "genlm's SGLang backend",
    "LlamaForCausalLM": "transformers' Llama",
    "NextBatchPlan": "the batch plan of SGLang's scheduler",
    "OpenAIServing": "vLLM's OpenAI entrypoint base",
    "RuntimeEndpoint": "SGLang's frontend backend",
    "UpdateWeightFromDiskReqInput": "SGLang's weight request",
    "Allow": "HTTP's header of a 405",
    "Dockerfile": "the image's build file",
}
# Bases that give a class no members the prose would name (and every builtin exception).
PLAIN_BASES = {"object", "ABC", "Protocol", "Generic", "Struct", "NamedTuple", "Enum"} | {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}
_ID = r"[A-Za-z_]\w*"
_CLASS = r"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*"  # capital first and a lowercase letter: no acronym
_DOTTED = rf"{_ID}(?:\.{_ID})*"
BACKTICKED = re.compile(r"`([^`\n]+)`")
IN_BACKTICKS = re.compile(rf"({_DOTTED})(\(.*\))?")
BARE = re.compile(rf"(?<![\w.`])({_CLASS}(?:\.{_ID})+|{_DOTTED}\(\))")
MODULE_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.{_ID})+)")
MIXED_CASE = re.compile(r"[a-z]+[A-Z]\w*")  # Helm's values (`gateway.extraEnv`), not Python


@dataclass
class Definitions:
    """What the repository's Python files define and use, by name."""

    names: set[str] = field(default_factory=set)  # classes, functions, a module's or class's names
    members: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # by class
    bases: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    module_names: dict[str, set[str]] = field(default_factory=dict)  # top-level names by module
    elsewhere: set[str] = field(default_factory=lambda: set(dir(builtins)) | set(NAMED_ELSEWHERE))

    def has_member(self, cls: str, member: str) -> bool:
        """`member` is defined in `cls`, in a class it derives from, or may come from a base
        outside the repository."""
        seen, waiting = set(), [cls]
        while waiting:
            name = waiting.pop()
            if name in seen:
                continue
            seen.add(name)
            if member in self.members.get(name, ()):
                return True
            for base in self.bases.get(name, ()):
                if base not in self.members and base not in PLAIN_BASES:
                    return True
                waiting.append(base)
        return False


def _assigned(statement: ast.stmt) -> list[str]:
    targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
    return [t.id for t in targets if isinstance(t, ast.Name)]


@functools.cache
def definitions(root: Path) -> Definitions:
    """What the Python files under `root` define, import and call (parsed once a root)."""
    found = Definitions()
    for path in repository_files(root):
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text())
        parts = path.relative_to(root).with_suffix("").parts
        parts = parts[1:] if parts[0] == "client" else parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        top_level = found.module_names.setdefault(module, set())
        for statement in tree.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top_level.add(statement.name)
            elif isinstance(statement, (ast.Import, ast.ImportFrom)):
                top_level.update((a.asname or a.name).split(".")[0] for a in statement.names)
            top_level.update(_assigned(statement))
        found.names.update(top_level)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.names.add(node.name)
                found.elsewhere.update(a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg))
            elif isinstance(node, ast.ClassDef):
                found.names.add(node.name)
                found.bases[node.name].update(ast.unparse(b).split(".")[-1].split("[")[0] for b in node.bases)
                members = found.members[node.name]
                for statement in node.body:
                    members.update(_assigned(statement))
                    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        members.add(statement.name)
                members.update(
                    target.attr
                    for inner in ast.walk(node)
                    if isinstance(inner, (ast.Assign, ast.AnnAssign))
                    for target in (inner.targets if isinstance(inner, ast.Assign) else [inner.target])
                    if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self"
                )
                found.names.update(members)
            elif isinstance(node, ast.ImportFrom):
                found.elsewhere.update(a.asname or a.name for a in node.names)
                found.elsewhere.update(a.name for a in node.names)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                found.elsewhere.add(node.func.attr)
    return found


def named_code(text: str, markdown: bool) -> list[tuple[int, str]]:
    """(offset, name) of each name of code in a piece of prose (a Markdown document without its
    fenced blocks)."""
    if markdown:
        text = re.sub(r"^(```|~~~).*?^\1", lambda m: "\n" * m.group().count("\n"), text, flags=re.S | re.M)
    found = {}
    for span in BACKTICKED.finditer(text):
        shape = IN_BACKTICKS.fullmatch(span.group(1).lstrip("."))
        if shape and (shape.group(2) or re.match(_CLASS + r"(\.|$)", shape.group(1))):
            found[span.start(1)] = span.group(1).lstrip(".")
    outside = BACKTICKED.sub(lambda m: " " * len(m.group()), text)
    found.update({m.start(1): m.group(1) for m in BARE.finditer(outside)})
    for path in MODULE_PATH.finditer(text):
        found.setdefault(path.start(1), path.group(1))
    return sorted(found.items())


def is_defined(name: str, defined: Definitions) -> bool:
    parts = name.split("(")[0].split(".")
    if parts[0] in PACKAGES:
        return _in_module(parts, defined)
    if re.fullmatch(_CLASS, parts[0]):
        if parts[0] not in defined.names and parts[0] not in defined.elsewhere:
            return False
        return len(parts) == 1 or parts[0] not in defined.members or defined.has_member(parts[0], parts[1])
    return parts[-1] in defined.names or parts[-1] in defined.elsewhere


def _in_module(parts: list[str], defined: Definitions) -> bool:
    """A dotted path: the longest module it starts with, then a name that module defines or
    imports, then a member of that name."""
    if any(MIXED_CASE.fullmatch(p) for p in parts):
        return True
    for end in range(len(parts), 0, -1):
        module = ".".join(parts[:end])
        if module in defined.module_names:
            rest = parts[end:]
            if not rest:
                return True
            if rest[0] not in defined.module_names[module]:
                return False
            return len(rest) == 1 or rest[0] not in defined.members or defined.has_member(rest[0], rest[1])
    return False


def missing_names(root: Path) -> list[str]:
    """`file:line: name` for each function or class the prose names that is nowhere."""
    defined = definitions(root)
    missing = []
    for path, first_line, text in prose(root):
        relative = path.relative_to(root)
        if relative.parts[0] not in CHECKED:
            continue
        for offset, name in named_code(text, path.suffix == ".md"):
            if not is_defined(name, defined):
                missing.append((str(relative), first_line + text.count("\n", 0, offset), name))
    return [f"{path}:{line}: {name}" for path, line, name in sorted(missing)]


def test_every_function_and_class_the_prose_names_is_there():
    assert missing_names(ROOT) == []


def test_the_check_reads_the_names_it_checks():
    names = {name for _, name in named_code((ROOT / "docs" / "layout.md").read_text(), markdown=True)}
    assert {"DenseService.logprobs", "PackedRows", "next_token_logprobs(rows, adapters)"} <= names
    defined = definitions(ROOT)
    assert is_defined("DenseService.answer", defined) and is_defined("place_rows(rows, out)", defined)
    assert not is_defined("DenseService.computed_rows", defined) and not is_defined("RowBatcher", defined)


def test_a_stale_name_is_found_in_docs_docstrings_and_comments(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "gateway" / "dense").mkdir(parents=True)
    (tmp_path / "gateway" / "dense" / "service.py").write_text(
        "import numpy as np\nfrom msgspec import Struct\n\n\n"
        "class Admission(Struct):\n    budget: int\n\n\n"
        "class DenseService:\n    def __init__(self):\n        self.engine = None\n\n"
        "    def rows(self):\n        return np.zeros(1).tolist()\n"
    )
    (tmp_path / "gateway" / "dense" / "batcher.py").write_text(
        '"""Rows through `DenseService.rows` and `DenseService.engine`, `Admission.budget`, `Struct`,\n'
        "`rows()`, `x.tolist()`, `np.zeros(n)`, `len(rows)`; then `RowBatcher.submit` and\n"
        '`computed_rows()`, gateway.dense.service.Admission and gateway.dense.service.Gone."""\n\n'
        "# DenseService.rows, rows() and `DenseService` stand; DenseService.computed and gone() do not\n"
    )
    (tmp_path / "docs" / "cache.md").write_text(
        "Rows go through `DenseService` (`gateway.dense.service`), not `OldService`; `gateway.extraEnv` is\n"
        "Helm's; a `plain` word, `--flag`, `SCREAMING`, `Returned.rows` and `gone()`.\n"
        "```python\nRowBatcher().submit()\n```\n"
    )
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_rows.py").write_text("# `RowBatcher.submit` in a test is not read\n")
    assert missing_names(tmp_path) == [
        "docs/cache.md:1: OldService",
        "docs/cache.md:2: Returned.rows",
        "docs/cache.md:2: gone()",
        "gateway/dense/batcher.py:2: RowBatcher.submit",
        "gateway/dense/batcher.py:3: computed_rows()",
        "gateway/dense/batcher.py:3: gateway.dense.service.Gone",
        "gateway/dense/batcher.py:5: DenseService.computed",
        "gateway/dense/batcher.py:5: gone()",
    ]
