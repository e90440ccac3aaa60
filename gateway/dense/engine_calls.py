"""A request's rows asked of its model's engine: at most `max_batch_rows` distinct rows a call.

The gateway batches nothing itself. An engine merges concurrent calls into shared work in its own
scheduler (the transformers and MLX engines in backends/step_scheduler.py, vLLM and SGLang in
their libraries'), so each request's rows go down as they come, through backends/placement.py:
rows that repeat computed once, into `out` when given (a GPU engine writes there from its
device). A request with more distinct rows than `max_batch_rows` makes several calls of at most
that many, one after another, and gets its rows back in order (copied into `out` when given).

A request whose client has gone is cancelled, and its call with it: an engine drops the rows of a
call cancelled before its work began (its scheduler's queue, or its worker's). A failing call
fails its own request alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from backends.engine import Engine
from backends.placement import Out, Placed, copy_rows_into, outputs, place_rows
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

    async def rows(
        self,
        rows: PackedRows,
        adapter: str | None = None,
        out: Out | None = None,
        times: EngineTimes | None = None,
    ) -> Placed:
        """The rows, float32 [len(rows), vocab], each equal to what the engine computes for it
        alone; in every array of `out` when given. `times`, if given, is filled in with when the
        (last) engine call began and ended."""
        self.stats.requests += 1
        self.stats.rows += len(rows)
        keys = rows.keys
        distinct = len(set(keys))
        if distinct <= self.max_batch_rows:  # one call, repeats and `out` as they are
            return await self._call(rows, adapter, distinct, out, times)
        unique = list(dict.fromkeys(keys))  # the distinct rows, in the order first asked
        parts = []
        for start in range(0, len(unique), self.max_batch_rows):
            chunk = PackedRows.from_keys(unique[start : start + self.max_batch_rows])
            parts.append((await self._call(chunk, adapter, len(chunk), None, times)).rows)
        computed = np.concatenate(parts)
        positions = None  # every row distinct, in order
        if len(unique) < len(keys):
            index = dict(zip(unique, range(len(unique)), strict=True))
            positions = [index[key] for key in keys]
        if out is None:
            return Placed(computed if positions is None else computed[positions])
        arrays = outputs(out)  # gathered straight into them: megabytes, off the loop
        await asyncio.to_thread(copy_rows_into, computed, positions, arrays)
        return Placed(arrays[0])

    async def _call(
        self, rows: PackedRows, adapter: str | None, distinct: int, out: Out | None, times: EngineTimes | None
    ) -> Placed:
        stats = self.stats
        self._on_call()
        stats.in_progress += 1
        began = time.perf_counter()
        try:
            placed = await place_rows(self._engine, rows, [adapter] * len(rows), out)
        finally:
            stats.in_progress -= 1
            if times is not None:
                times.began, times.ended = began, time.perf_counter()
        stats.calls += 1
        stats.engine_rows += distinct
        stats.largest_call = max(stats.largest_call, distinct)
        self._on_answer(distinct)
        return placed
