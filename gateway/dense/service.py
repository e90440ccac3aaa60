"""Dense rows for a request, from its token ids to its answer's bytes: the one way down.

    DenseService.answer
     ├── where the answer goes: the body, or the client's shared memory (shared_memory.py)
     ├── logprobs: the output cache (row_cache.py) → the engine's calls (engine_calls.py) →
     │   placement (backends/placement.py: repeats and cached rows dropped, every row placed)
     └── the answer's bytes (delivery.py), once the rows have landed

The rows go down that chain once: the cache hands what it found down with the rows, as rows the
engine need not compute, and stores what the engine computed once it has; the answer is made from
the one matrix that comes back.

An engine that can write rows into host memory itself (backends.engine.HostMemory: a GPU engine)
gets the client's segment, registered with it, as `out` for a request with none of its rows
cached, at most `max_batch_rows` distinct rows (one engine call) and a float32 answer: its rows
then reach the client in one copy from the device. With an output cache, rows asked for before
(`RowCache.asked`) are copied for it too: `out` also names page-locked rows of the engine's own
(`host_memory.empty`), which the cache keeps once the client's segment has been handed on; the
answer goes once the client's rows have landed (a worker thread waits for the device, never the
event loop), and the cache's copy is stored once it has too.
Rows never asked before, every step of an SMC loop, get neither the second copy nor the cache's
bookkeeping: most are never asked again, and the copy, its page-locked memory and the store cost
about as much of the gateway's time per call as everything else it does (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np

from backends.engine import Engine
from backends.errors import EngineUnavailableError
from backends.placement import Placed
from backends.rows import PackedRows
from gateway.dense import delivery
from gateway.dense.delivery import answer_nbytes
from gateway.dense.engine_calls import EngineCalls, EngineTimes
from gateway.dense.quiet_time import QuietTime
from gateway.dense.row_cache import RowCache
from gateway.dense.shared_memory import Destination, SharedMemoryWriter
from gateway.dense.token_rows import dense_inputs
from gateway.errors import (
    ContextLengthError,
    EngineError,
    GatewayError,
    InvalidRequestError,
    ModelNotReadyError,
)
from gateway.metrics import Metrics
from gateway.models.served import ServedModel
from gateway.schemas.logprobs import NextTokenLogprobsRequest, NextTokenLogprobsUsage
from gateway.settings import Limits
from logprob_gateway_client.encoding import ITEMSIZE


@dataclass(frozen=True)
class Answer:
    parts: delivery.Parts  # the body, buffer by buffer
    server_timing: str  # where the server's time went, as a Server-Timing header
    in_shared_memory: bool  # the rows went into the client's segment, the body says where


class Admission(Protocol):
    """What a request may take, per its caller (its API key's budgets)."""

    def take_rows(self, rows: int) -> None:
        """Count `rows` against the key's per-minute budget; RateLimitError when spent."""

    def reserve_answer_bytes(self, nbytes: int) -> None:
        """Hold `nbytes` of the server's unread-answer budget until the answer is sent or abandoned."""


class DenseService:
    def __init__(self, metrics: Metrics, shared_memory: SharedMemoryWriter | None = None) -> None:
        self.metrics = metrics
        self.shared_memory = shared_memory
        self.quiet = QuietTime()  # begins with every engine call of dense rows
        self.cache: RowCache | None = None  # set once the app has started (row_cache.build_cache)
        self.engine_calls: dict[str, EngineCalls] = {}

    def calls(self, served: ServedModel) -> EngineCalls:
        """The model's engine calls, made ready at its first dense request."""
        calls = self.engine_calls.get(served.name)
        if calls is None:
            calls = self.engine_calls[served.name] = EngineCalls(
                served.require_engine(),
                max_batch_rows=served.settings.max_batch_rows,
                on_call=self.quiet.now,
                on_answer=self.metrics.batch_rows.labels(served.name).observe,
            )
        return calls

    async def serve(
        self,
        served: ServedModel,
        adapter: str | None,
        body: NextTokenLogprobsRequest,
        binary: bool,
        limits: Limits,
        admission: Admission,
        *,
        body_allowed: bool = True,
    ) -> Answer:
        """A dense request's answer, whichever way it came (HTTP, the local socket): its rows
        checked and charged, its answer's bytes held, then `answer`."""
        rows = await dense_inputs(served, body, limits)
        admission.take_rows(len(rows))
        # Before any row is computed: its size is known, and a server full of unread answers says so.
        shared = body.shared_memory is not None and self.shared_memory is not None
        vocab_size = served.require_engine().info.vocab_size
        admission.reserve_answer_bytes(answer_nbytes(len(rows), vocab_size, body, binary, shared))
        return await self.answer(served, adapter, rows, body, binary, body_allowed=body_allowed)

    async def answer(
        self,
        served: ServedModel,
        adapter: str | None,
        rows: PackedRows,
        body: NextTokenLogprobsRequest,
        binary: bool,
        *,
        body_allowed: bool = True,
    ) -> Answer:
        """The answer to `body` for `rows`, checked token ids of the model `served` (and `adapter`).
        Without `body_allowed`, a segment the rows cannot go into is a 400 before any is computed."""
        begun = time.perf_counter()
        engine = served.require_engine()
        longest = int(rows.lengths.max())
        if longest > engine.info.max_model_len:
            raise ContextLengthError(
                f"an input has {longest} tokens; this model's maximum context length is {engine.info.max_model_len}",
                param="input",
            )
        # Checked before any row is computed: a segment too small is the client's error.
        destination = self._destination(body, engine, len(rows))
        if destination is None and not body_allowed:
            raise InvalidRequestError(
                "the segment named in shared_memory cannot be written from here (another host or "
                "PID namespace, or not this process's to inspect): ask over HTTP",
                param="shared_memory",
            )
        into = _engine_target(body, destination, engine.info.vocab_size)
        started = time.perf_counter()
        times = EngineTimes()
        try:
            async with served.reading(adapter):  # keys and rows of the same weights
                placed, hits = await self.logprobs(served, adapter, rows, into, times, use_cache=body.cache)
        except GatewayError:
            raise
        except EngineUnavailableError as exc:  # unusable until given weights again: 503
            raise ModelNotReadyError(str(exc)) from exc
        except Exception as exc:
            raise EngineError(f"the engine failed to compute the rows: {type(exc).__name__}: {exc}") from exc
        tokens = int(rows.ids.size)
        usage = NextTokenLogprobsUsage(prompt_tokens=tokens, total_tokens=tokens, cache_hits=hits)
        computed_at = time.perf_counter()
        logprobs = placed.logprobs
        if into is not None:  # the rows are in the client's memory: a few hundred bytes to say so
            assert destination is not None
            parts = delivery.in_shared_memory(logprobs, body, usage, binary, destination.view, True)
        # Copying or encoding megabytes of floats would stall the event loop: a worker thread does.
        elif destination is not None:
            parts = await asyncio.to_thread(
                delivery.in_shared_memory, logprobs, body, usage, binary, destination.view, False
            )
        else:
            parts = await asyncio.to_thread(delivery.in_body, logprobs, body, usage, binary)
        encoding = (
            "shared_memory" if destination is not None else "msgpack" if binary else body.encoding_format
        )
        metrics = self.metrics
        metrics.child(metrics.dense_rows, served.name, adapter or "", encoding).inc(len(rows))
        metrics.child(metrics.dense_response_bytes, served.name, encoding).inc(sum(map(len, parts)))
        # An engine's copy from its device into the client's memory may still be under way: the
        # answer, made meanwhile, leaves once the rows have landed (a worker thread waits out the
        # device's last work, the event loop serving others meanwhile).
        landing = time.perf_counter()
        await placed.landed()
        landing_s = time.perf_counter() - landing
        # Milliseconds, for clients and benches: the request read and checked, rows (the cache
        # and the engine: `engine` is its call, from the engine's queue to its answer, and its
        # rows' landing, 0 when every row was cached), encode (or the copy into shared memory).
        engine_s = times.ended - times.began + landing_s
        timing = ", ".join(
            f"{name};dur={seconds * 1e3:.2f}"
            for name, seconds in (
                ("parse", started - begun),
                ("rows", computed_at - started + landing_s),
                ("engine", engine_s),
                ("encode", time.perf_counter() - computed_at - landing_s),
            )
        )
        return Answer(parts, timing, destination is not None)

    def _destination(self, body: NextTokenLogprobsRequest, engine: Engine, count: int) -> Destination | None:
        """Where in the client's segment the matrix goes; None: in the body (no segment named, the
        feature off, a segment this host cannot see, or a key that is not the segment's)."""
        if body.shared_memory is None:
            return None
        if body.layout != "matrix":
            raise InvalidRequestError('shared_memory needs layout: "matrix"', param="shared_memory")
        if self.shared_memory is None:
            return None
        nbytes = count * engine.info.vocab_size * ITEMSIZE[body.dtype]
        return self.shared_memory.target(body.shared_memory, nbytes, engine.host_memory)

    async def logprobs(
        self,
        served: ServedModel,
        adapter: str | None,
        rows: PackedRows,
        into: np.ndarray | None = None,
        times: EngineTimes | None = None,
        *,
        use_cache: bool = True,
    ) -> tuple[Placed, int]:
        """The log-probabilities after each of `rows`, float32 [len(rows), vocab], and how many
        came from the output cache (bit-identical to computing them): the one way to dense rows,
        for every route. With `into` (float32 [len(rows), vocab], memory the engine may write into
        from its device), they are there, once landed (`Placed.landed`). `times`: when the
        engine's call for them began and ended. The caller holds the model's weights for reading
        (`served.reading(adapter)`). Without `use_cache`, the output cache is neither read nor
        written."""
        compute = partial(self.calls(served).logprobs, rows, adapter, into, times=times)
        cache = self.cache if use_cache else None
        if cache is None:
            return await compute(None, False), 0
        adapter_id = None if adapter is None else f"{adapter}:{served.adapters[adapter].fingerprint}"
        vocab_size = served.require_engine().info.vocab_size
        computing, hits = await cache.fill(
            served.cache_scope, adapter_id, rows, vocab_size, compute, direct=into is not None
        )
        return await computing, hits

    async def aclose(self) -> None:
        if self.cache is not None:
            await self.cache.aclose()
        if self.shared_memory is not None:
            self.shared_memory.close()


def _engine_target(
    body: NextTokenLogprobsRequest, destination: Destination | None, vocab_size: int
) -> np.ndarray | None:
    """The client's segment as float32 rows, for the engine to write into from its device: when
    the mapping is registered with the engine and the answer is float32, as computed."""
    if destination is None or not destination.registered or body.dtype != "float32":
        return None
    if destination.view.ctypes.data % ITEMSIZE["float32"]:  # an offset that splits a float
        return None
    return destination.view.view(np.float32).reshape(-1, vocab_size)
