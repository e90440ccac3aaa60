"""Grammars on llguidance: the check every engine's constrained requests pass before they
generate, and the token masks of the engines that sample themselves (transformers, MLX, mock).

Why llguidance rather than xgrammar (both are what vLLM and SGLang offer): on this project's
vocabulary it compiles a JSON schema in 1-3 ms where xgrammar takes 1-70 ms, fills 64 streams'
masks faster, and refuses the schema keywords it cannot enforce instead of dropping them
(docs/performance.md, "Grammar engines on our vocabulary"; docs/api.md).

A grammar is compiled first in a worker process (backends/grammar/pool.py), within its timeout,
one compile per grammar however many requests ask for it at once: a grammar that crashes the
grammar engine or overruns costs a process that is killed, never the gateway. `check` returns
the grammar carrying the text that worker compiled (and whose first masks it computed), which
its generation uses: nothing is compiled a second time, whatever the cache has dropped.
Verdicts are kept by content, failures included, within a count and a total of text bytes.
llguidance's own limits (backends/grammar/text.py) bound the work of a compile and of every mask.

A stream under a grammar has a `Constraint`: a matcher of its own, built here from the checked
text (on one of `workers` threads: llguidance releases the GIL, and a worker built the same text
within the compile's timeout). Matchers are never copied between streams, because copies share
llguidance's lexer, which grows with every token any of them takes: one stream could spend
another's lexer budget, and keep its memory, for as long as the grammar is kept. The mask of a
stream's next token is computed on a thread while the engine's forward pass runs, so a
constrained stream costs its pass no more time than an unconstrained one, and shares it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection
from concurrent.futures import Executor, ThreadPoolExecutor
from copy import copy
from dataclasses import replace
from typing import Any

import llguidance
import msgspec
import numpy as np

from backends.engine import StructuredOutputs
from backends.errors import GrammarError
from backends.grammar.pool import CompilePool, GrammarBusyError, worker_stack_bytes
from backends.grammar.text import MAX_MESSAGE, ascii_digits, grammar_text, one_line_error, parser_limits
from backends.types import Grammar

__all__ = ["Constraint", "GrammarBusyError", "LLGuidanceGrammars", "ascii_digits", "grammar_text"]

MAX_KEPT = 64  # verdicts kept (grammar texts and failures), least recently used first out
MAX_KEPT_BYTES = 32 * 2**20  # grammar text the kept verdicts hold at most
# a grammar given to `constraint` unchecked (the engines' own callers, tests) is checked with these
UNCHECKED_TIMEOUT_S = 5.0
DEFAULT_WORKERS = 2
DEFAULT_MAX_WAITING = 8
_error = one_line_error
log = logging.getLogger(__name__)


class Constraint:
    """One stream's place in its grammar: the tokens allowed next, and the tokens it took. Its
    matcher is built with its first mask, so that the build runs while the prompt's pass does."""

    def __init__(self, build: Callable[[], Any], vocab_size: int, builds: Executor, masks: Executor) -> None:
        self._build = build
        self._matcher: Any = None
        self._vocab_size = vocab_size
        self._builds = builds
        self._masks = masks

    def next_mask(self) -> asyncio.Future[np.ndarray]:
        """bool [vocab]: the tokens the grammar allows next, computed on a thread from now."""
        if self._matcher is None:
            return asyncio.get_running_loop().run_in_executor(self._builds, self._first_allowed)
        return asyncio.get_running_loop().run_in_executor(self._masks, self._allowed)

    def _first_allowed(self) -> np.ndarray:
        if self._matcher is None:
            self._matcher = self._build()
        return self._allowed()

    def _allowed(self) -> np.ndarray:
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self._vocab_size].view(bool)
        if self._matcher.is_error() or not allowed.any():
            raise _error(f"the grammar allows no next token: {self._matcher.get_error() or 'dead end'}")
        return allowed

    def accept(self, token: int) -> None:
        if self._matcher is None:
            self._matcher = self._build()
        if not self._matcher.consume_token(token):
            raise _error(f"the grammar does not allow token {token}: {self._matcher.get_error()}")


class LLGuidanceGrammars(StructuredOutputs):
    """llguidance on an engine's (fast, Hugging Face) tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self.vocab_size = vocab_size
        self._hf_tokenizer = tokenizer
        self._eos = sorted(eos_token_ids)
        self._tokenizer_json: str | None = None  # the HF tokenizer serialized, as llguidance reads it
        self._tokenizer: Any = None  # llguidance's
        self._tokenizer_lock = threading.Lock()
        self._masks = ThreadPoolExecutor(max_workers=4, thread_name_prefix="grammar-mask")
        self._kept: OrderedDict[Grammar, str | GrammarError] = OrderedDict()  # its text, or why not
        self._kept_bytes = 0
        self._running: dict[Grammar, asyncio.Future[str | GrammarError]] = {}
        self._pool: CompilePool | None = None
        self._builds: ThreadPoolExecutor | None = None  # streams' matchers, `workers` at a time
        self._closed = False
        self._hello: bytes | None = None
        # Built now, on the engine's loading thread: both hold the GIL for a few hundred ms,
        # which at the first grammar would stall the event loop.
        try:
            self._hello = self._worker_hello()
            self._llguidance_tokenizer()
        except Exception:  # noqa: BLE001 (a tokenizer llguidance cannot read: each check says so)
            log.warning("grammars: llguidance cannot read this tokenizer", exc_info=True)

    async def check(
        self,
        grammar: Grammar,
        timeout_s: float,
        workers: int = DEFAULT_WORKERS,
        max_waiting: int = DEFAULT_MAX_WAITING,
    ) -> Grammar:
        """`grammar` carrying the text a worker compiled (see StructuredOutputs.check); the
        compile pool is started with `workers` processes and `max_waiting` places at the first
        check."""
        return replace(grammar, compiled=await self._text(grammar, timeout_s, workers, max_waiting))

    async def constraint(self, grammar: Grammar) -> Constraint:
        """A new stream's constraint: a matcher of its own, at the grammar's start, built (with
        its first mask) from the text `check` gave `grammar` (checked now, within
        UNCHECKED_TIMEOUT_S, where it has none)."""
        text = grammar.compiled
        if text is None:
            text = await self._text(grammar, UNCHECKED_TIMEOUT_S, DEFAULT_WORKERS, DEFAULT_MAX_WAITING)
        build = functools.partial(self._matcher, text)
        return Constraint(build, self.vocab_size, self._build_threads(DEFAULT_WORKERS), self._masks)

    def _matcher(self, text: str) -> Any:
        matcher = llguidance.LLMatcher(
            self._llguidance_tokenizer(), text, log_level=0, limits=parser_limits()
        )
        if matcher.is_error():
            raise _error(matcher.get_error())
        return matcher

    async def _text(self, grammar: Grammar, timeout_s: float, workers: int, max_waiting: int) -> str:
        key = Grammar(grammar.kind, grammar.source)  # a grammar, not what it carries
        found = self._kept.get(key)
        if found is None:
            future = self._running.get(key)
            if future is None:
                pool = self._compile_pool(workers, max_waiting)
                self._build_threads(workers)
                future = asyncio.ensure_future(pool.run(self._compile, pool, key, timeout_s))
                self._running[key] = future
                future.add_done_callback(functools.partial(self._keep, key))
            found = await asyncio.shield(future)  # GrammarBusyError: not kept, may try again
        else:
            self._kept.move_to_end(key)
        if isinstance(found, GrammarError):
            raise GrammarError(str(found))
        return found

    def _keep(self, grammar: Grammar, done: asyncio.Future[str | GrammarError]) -> None:
        del self._running[grammar]
        if done.cancelled() or isinstance(done.exception(), GrammarBusyError):
            return
        error = done.exception()
        if error is not None and not isinstance(error, GrammarError):
            error = _error(f"the grammar engine failed: {error}")
        verdict = error if error is not None else done.result()
        size = _held_bytes(grammar, verdict)
        if size > MAX_KEPT_BYTES:
            return  # each request for it compiles it again, within its bound
        self._kept[grammar] = verdict
        self._kept_bytes += size
        while len(self._kept) > MAX_KEPT or self._kept_bytes > MAX_KEPT_BYTES:
            dropped, dropped_verdict = self._kept.popitem(last=False)
            self._kept_bytes -= _held_bytes(dropped, dropped_verdict)

    def _compile_pool(self, workers: int, max_waiting: int) -> CompilePool:
        if self._closed:
            raise GrammarError("the grammar engine is shutting down")
        if self._pool is None:
            self._pool = CompilePool(self._worker_setup, workers, max_waiting)
        return self._pool

    def _build_threads(self, workers: int) -> ThreadPoolExecutor:
        if self._builds is None:
            self._builds = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-build")
        return self._builds

    @staticmethod
    def _compile(pool: CompilePool, grammar: Grammar, timeout_s: float) -> str | GrammarError:
        """The grammar text a worker compiled, or the GrammarError saying why there is none."""
        try:
            return pool.compile(grammar, timeout_s)
        except GrammarBusyError:
            raise
        except GrammarError as exc:
            return exc

    def _serialized_tokenizer(self) -> str:
        """The HF tokenizer's JSON without padding or truncation, as `llguidance.hf` builds it."""
        with self._tokenizer_lock:
            if self._tokenizer_json is None:
                backend = copy(self._hf_tokenizer.backend_tokenizer)
                backend.no_padding()
                backend.no_truncation()
                self._tokenizer_json = backend.to_str()
            return self._tokenizer_json

    def _worker_setup(self) -> bytes:
        if self._hello is None:
            self._hello = self._worker_hello()
        return self._hello

    def _worker_hello(self) -> bytes:
        return msgspec.msgpack.encode(
            {
                "tokenizer": self._serialized_tokenizer(),
                "n_vocab": self.vocab_size,
                "eos": self._eos,
                "stack_bytes": worker_stack_bytes(),
            }
        )

    def _llguidance_tokenizer(self) -> Any:
        text = self._serialized_tokenizer()
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self._eos)
            return self._tokenizer

    def close(self) -> None:
        """Stop the compile workers; later checks are refused."""
        self._closed = True
        if self._pool is not None:
            self._pool.close()
        self._masks.shutdown(wait=False, cancel_futures=True)
        if self._builds is not None:
            self._builds.shutdown(wait=False, cancel_futures=True)


def _held_bytes(grammar: Grammar, verdict: str | GrammarError) -> int:
    return len(grammar.source) + (len(verdict) if isinstance(verdict, str) else MAX_MESSAGE)
