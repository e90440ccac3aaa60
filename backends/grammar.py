"""Grammars on llguidance: the check every engine's constrained requests pass before they
generate, and the token masks of the engines that sample themselves (transformers, MLX, mock).

Why llguidance rather than xgrammar (both are what vLLM and SGLang offer): on this project's
vocabulary it compiles a JSON schema in 1-3 ms where xgrammar takes 1-70 ms, fills 64 streams'
masks faster, and refuses the schema keywords it cannot enforce instead of dropping them
(docs/performance.md, "Grammar engines on our vocabulary"; docs/api.md).

Compiles run on threads of their own (llguidance releases the GIL while it builds a grammar), one
per grammar however many requests ask for it at once, and are kept by content, failures
included. A caller waits at most its timeout; a compile still running past it goes on and lands
in the cache, so asking again is quick either way. llguidance's own limits (its default
`LLParserLimits`) bound the work of a compile and of every mask.

A stream under a grammar has a `Constraint`: its own matcher, copied from the compiled one. The
mask of its next token is computed on a thread while the engine's forward pass runs, so a
constrained stream costs its pass no more time than an unconstrained one, and shares it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.hf
import numpy as np

from backends.engine import StructuredOutputs
from backends.errors import GrammarError
from backends.types import GRAMMAR_KINDS, Grammar

MAX_COMPILED = 64  # grammars kept compiled, least recently used first out
# JSON on one line, with no whitespace between tokens: whitespace allowed anywhere lets a small
# model emit newlines until max_tokens. vLLM's `disable_any_whitespace` and SGLang's
# `constrained_json_disable_any_whitespace` give the same grammar. A schema's own "x-guidance"
# options override these.
COMPACT_JSON = {"whitespace_flexible": False}
MAX_MESSAGE = 1000  # characters of a grammar engine's message passed on


def _error(message: str) -> GrammarError:
    """The grammar engine's message on one line (it draws carets under the source on several)."""
    line = " ".join(message.split())
    return GrammarError(line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 3] + "...")


def ascii_digits(regex: str) -> str:
    """`\\d` as [0-9], as Python's `re.ASCII`, xgrammar and JSON schema patterns read it (Rust's
    regex syntax, llguidance's, reads it as any Unicode digit)."""
    out: list[str] = []
    i, class_start = 0, -1  # where the bracket expression being read began, -1: outside one
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            pair = regex[i : i + 2]
            out.append(("0-9" if class_start >= 0 else "[0-9]") if pair == "\\d" else pair)
            i += 2
            continue
        if char == "[" and class_start < 0:
            class_start = i
        elif char == "]" and class_start >= 0 and i > class_start + 1 + (regex[class_start + 1] == "^"):
            class_start = -1  # a "]" first in the class is a literal
        out.append(char)
        i += 1
    return "".join(out)


def grammar_text(grammar: Grammar) -> str:
    """llguidance's grammar for `grammar`; GrammarError where its text cannot be read as its kind."""
    if grammar.kind not in GRAMMAR_KINDS:
        raise _error(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, not {grammar.kind!r}")
    try:
        if grammar.kind == "json_schema":
            schema = json.loads(grammar.source)
            if not isinstance(schema, dict | bool):
                raise _error(f"a JSON schema is an object or a boolean, not {type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT_JSON)
        if grammar.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(ascii_digits(grammar.source))
        return llguidance.grammar_from(grammar.kind, grammar.source)
    except GrammarError:
        raise
    except (ValueError, RecursionError) as exc:  # json.JSONDecodeError is a ValueError
        raise _error(f"invalid {grammar.kind}: {exc}") from None


class Constraint:
    """One stream's place in its grammar: the tokens allowed next, and the tokens it took."""

    def __init__(self, matcher: Any, vocab_size: int, executor: ThreadPoolExecutor) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._executor = executor

    def next_mask(self) -> asyncio.Future[np.ndarray]:
        """bool [vocab]: the tokens the grammar allows next, computed on a thread from now."""
        return asyncio.get_running_loop().run_in_executor(self._executor, self._allowed)

    def _allowed(self) -> np.ndarray:
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self._vocab_size].view(bool)
        if self._matcher.is_error() or not allowed.any():
            raise _error(f"the grammar allows no next token: {self._matcher.get_error() or 'dead end'}")
        return allowed

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise _error(f"the grammar does not allow token {token}: {self._matcher.get_error()}")


class LLGuidanceGrammars(StructuredOutputs):
    """llguidance on an engine's (fast, Hugging Face) tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self.vocab_size = vocab_size
        self._hf_tokenizer = tokenizer
        self._eos = sorted(eos_token_ids)
        self._tokenizer: Any = None  # llguidance's, built at the first compile (about a second)
        self._tokenizer_lock = threading.Lock()
        self._compiles = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        self._masks = ThreadPoolExecutor(max_workers=4, thread_name_prefix="grammar-mask")
        self._compiled: OrderedDict[Grammar, Any] = OrderedDict()  # a matcher, or a GrammarError
        self._running: dict[Grammar, asyncio.Future[Any]] = {}

    async def check(self, grammar: Grammar, timeout_s: float) -> None:
        await self._matcher(grammar, timeout_s)

    async def constraint(self, grammar: Grammar) -> Constraint:
        """A new stream's constraint (the grammar compiled now if it is not kept: no timeout)."""
        return Constraint((await self._matcher(grammar, None)).deep_copy(), self.vocab_size, self._masks)

    async def _matcher(self, grammar: Grammar, timeout_s: float | None) -> Any:
        found = self._compiled.get(grammar)
        if found is None:
            future = self._running.get(grammar)
            if future is None:
                future = asyncio.get_running_loop().run_in_executor(self._compiles, self._compile, grammar)
                self._running[grammar] = future
                future.add_done_callback(lambda done: self._keep(grammar, done))
            try:
                found = await asyncio.wait_for(asyncio.shield(future), timeout_s)
            except TimeoutError:
                raise GrammarError(f"the grammar did not compile within {timeout_s:g} s") from None
        else:
            self._compiled.move_to_end(grammar)
        if isinstance(found, GrammarError):
            raise GrammarError(str(found))
        return found

    def _keep(self, grammar: Grammar, done: asyncio.Future[Any]) -> None:
        del self._running[grammar]
        if done.cancelled():
            return
        error = done.exception()
        self._compiled[grammar] = _error(f"the grammar engine failed: {error}") if error else done.result()
        while len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)

    def _compile(self, grammar: Grammar) -> Any:
        """A matcher at the grammar's start, or the GrammarError saying why there is none."""
        try:
            text = grammar_text(grammar)
        except GrammarError as exc:
            return exc
        matcher = llguidance.LLMatcher(self._llguidance_tokenizer(), text, log_level=0)
        if matcher.is_error():
            return _error(matcher.get_error())
        return matcher

    def _llguidance_tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._tokenizer

    def close(self) -> None:
        self._compiles.shutdown(wait=False, cancel_futures=True)
        self._masks.shutdown(wait=False, cancel_futures=True)
