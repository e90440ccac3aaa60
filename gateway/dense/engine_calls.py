"""A request's rows asked of its model's engine: counted and timed, at most `max_batch_rows`
distinct rows a call.

The gateway batches nothing itself. An engine merges concurrent calls into shared work in its own
scheduler (the transformers and MLX engines in backends/step_scheduler.py, vLLM and SGLang in
their libraries'), so each request's rows go down as they come, through backends/placement.py,
which drops repeats and rows the output cache found, splits a request with more distinct rows
than `max_batch_rows` into calls of at most that many, and places every row where it goes. This
module only counts those calls and times them (`EngineCalls.call`, around each of them).

A request whose client has gone is cancelled, and its call with it: an engine drops the rows of a
call cancelled before its work began (its scheduler's queue, or its worker's). A failing call
fails its own request alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

from backends.engine import Engine
from backends.placement import Known, Out, Placed, place_rows
from backends.rows import PackedRows


@dataclass
class EngineTimes:
    """When the engine call that computed a request's rows began and ended (perf_counter; the
    last call, for a request split over several)."""

    began: float = 0.0
    ended: float = 0.0


@dataclass
class CallStats:
    requests: int = 0  # requests that asked the engine for rows (rows not all cached)
    rows: int = 0  # rows they asked the engine for
    engine_rows: int = 0  # distinct rows of the calls the engine answered
    calls: int = 0  # engine calls answered (a request over max_batch_rows makes several)
    largest_call: int = 0  # most distinct rows in one call
    in_progress: int = 0  # calls made and not answered yet (queued in the engine, or computing)


class EngineCalls:
    """One model's dense rows, asked of its engine."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_batch_rows: int = 256,
        on_call: Callable[[], None] | None = None,
        on_answer: Callable[[int], None] | None = None,
    ) -> None:
        self._engine = engine
        self.max_batch_rows = max_batch_rows
        self._on_call = on_call or (lambda: None)  # a call begins
        self._on_answer = on_answer or (lambda rows: None)  # a call answered, with its distinct rows
        self.stats = CallStats()

    async def logprobs(
        self,
        rows: PackedRows,
        adapter: str | None = None,
        out: Out | None = None,
        known: Known | None = None,
        keep: bool = False,
        *,
        times: EngineTimes | None = None,
    ) -> Placed:
        """The log-probabilities after each of `rows`, float32 [len(rows), vocab], each equal to
        what the engine computes for it alone; in every array of `out` when given. `known`: the
        rows the caller has already, per row or None (place_rows' `known`); `keep`: place_rows'.
        `times`, if given, is filled in with when the (last) engine call began and ended."""
        asked = len(rows) if known is None else sum(row is None for row in known)
        if asked:
            self.stats.requests += 1
            self.stats.rows += asked
        return await place_rows(
            self._engine,
            rows,
            [adapter] * len(rows),
            out,
            known,
            keep=keep,
            max_rows=self.max_batch_rows,
            watch=partial(self.call, times),
        )

    @contextmanager
    def call(self, times: EngineTimes | None, distinct: int) -> Iterator[None]:
        """One engine call of `distinct` rows, counted once answered and timed into `times`."""
        stats = self.stats
        self._on_call()
        stats.in_progress += 1
        began = time.perf_counter()
        try:
            yield
        finally:
            stats.in_progress -= 1
            if times is not None:
                times.began, times.ended = began, time.perf_counter()
        stats.calls += 1
        stats.engine_rows += distinct
        stats.largest_call = max(stats.largest_call, distinct)
        self._on_answer(distinct)
