"""Grammars on llguidance: the check every engine's constrained requests pass before they
generate, and the token masks of the engines that sample themselves (transformers, MLX, mock).

Why llguidance rather than xgrammar (both are what vLLM and SGLang offer): on this project's
vocabulary it compiles a JSON schema in 1-3 ms where xgrammar takes 1-70 ms, fills 64 streams'
masks faster, and refuses the schema keywords it cannot enforce instead of dropping them
(docs/performance.md, "Grammar engines on our vocabulary"; docs/api.md).

A grammar is compiled first in a worker process (backends/grammar/pool.py), within its timeout,
one compile per grammar however many requests ask for it at once: a grammar that crashes the
grammar engine or overruns costs a process that is killed, never the gateway. Only the grammar
text a worker compiled, whose first mask it computed, is then built into a matcher here (on a
thread: llguidance releases the GIL), and `check` returns the grammar carrying that matcher,
which its generation uses: nothing is compiled a second time, whatever the cache has dropped.
Verdicts are kept by content, failures included. llguidance's own limits
(backends/grammar/text.py) bound the work of a compile and of every mask.

A stream under a grammar has a `Constraint`: its own matcher, copied from the compiled one. The
mask of its next token is computed on a thread while the engine's forward pass runs, so a
constrained stream costs its pass no more time than an unconstrained one, and shares it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from copy import copy
from dataclasses import replace
from typing import Any

import llguidance
import msgspec
import numpy as np

from backends.engine import StructuredOutputs
from backends.errors import GrammarError
from backends.grammar.pool import CompilePool, GrammarBusyError, worker_stack_bytes
from backends.grammar.text import ascii_digits, grammar_text, one_line_error, parser_limits
from backends.types import Grammar

__all__ = ["Constraint", "GrammarBusyError", "LLGuidanceGrammars", "ascii_digits", "grammar_text"]

MAX_COMPILED = 64  # verdicts kept (matchers and failures), least recently used first out
# a grammar given to `constraint` unchecked (the engines' own callers, tests) is checked with these
UNCHECKED_TIMEOUT_S = 5.0
DEFAULT_WORKERS = 2
DEFAULT_MAX_WAITING = 8
_error = one_line_error
log = logging.getLogger(__name__)


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
        self._tokenizer_json: str | None = None  # the HF tokenizer serialized, as llguidance reads it
        self._tokenizer: Any = None  # llguidance's
        self._tokenizer_lock = threading.Lock()
        self._masks = ThreadPoolExecutor(max_workers=4, thread_name_prefix="grammar-mask")
        self._compiled: OrderedDict[Grammar, Any] = OrderedDict()  # a matcher, or a GrammarError
        self._running: dict[Grammar, asyncio.Future[Any]] = {}
        self._pool: CompilePool | None = None
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
        """`grammar` carrying its compiled matcher (see StructuredOutputs.check); the compile pool
        is started with `workers` processes and `max_waiting` places at the first check."""
        matcher = await self._matcher(grammar, timeout_s, workers, max_waiting)
        return replace(grammar, compiled=matcher)

    async def constraint(self, grammar: Grammar) -> Constraint:
        """A new stream's constraint, from the matcher `check` gave `grammar` (checked now, within
        UNCHECKED_TIMEOUT_S, where it has none)."""
        matcher = grammar.compiled
        if matcher is None:
            matcher = await self._matcher(grammar, UNCHECKED_TIMEOUT_S, DEFAULT_WORKERS, DEFAULT_MAX_WAITING)
        return Constraint(matcher.deep_copy(), self.vocab_size, self._masks)

    async def _matcher(self, grammar: Grammar, timeout_s: float, workers: int, max_waiting: int) -> Any:
        key = Grammar(grammar.kind, grammar.source)  # a grammar, not what it carries
        found = self._compiled.get(key)
        if found is None:
            future = self._running.get(key)
            if future is None:
                pool = self._compile_pool(workers, max_waiting)
                future = asyncio.ensure_future(pool.run(self._compile, pool, key, timeout_s))
                self._running[key] = future
                future.add_done_callback(functools.partial(self._keep, key))
            found = await asyncio.shield(future)  # GrammarBusyError: not kept, may try again
        else:
            self._compiled.move_to_end(key)
        if isinstance(found, GrammarError):
            raise GrammarError(str(found))
        return found

    def _keep(self, grammar: Grammar, done: asyncio.Future[Any]) -> None:
        del self._running[grammar]
        if done.cancelled() or isinstance(done.exception(), GrammarBusyError):
            return
        error = done.exception()
        if error is not None and not isinstance(error, GrammarError):
            error = _error(f"the grammar engine failed: {error}")
        self._compiled[grammar] = error if error is not None else done.result()
        while len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)

    def _compile_pool(self, workers: int, max_waiting: int) -> CompilePool:
        if self._closed:
            raise GrammarError("the grammar engine is shutting down")
        if self._pool is None:
            self._pool = CompilePool(self._worker_setup, workers, max_waiting)
        return self._pool

    def _compile(self, pool: CompilePool, grammar: Grammar, timeout_s: float) -> Any:
        """A matcher at the grammar's start, built from the text a worker compiled (so it builds,
        in about the worker's time), or the GrammarError saying why there is none."""
        try:
            text = pool.compile(grammar, timeout_s)
        except GrammarBusyError:
            raise
        except GrammarError as exc:
            return exc
        matcher = llguidance.LLMatcher(
            self._llguidance_tokenizer(), text, log_level=0, limits=parser_limits()
        )
        if matcher.is_error():
            return _error(matcher.get_error())
        return matcher

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
