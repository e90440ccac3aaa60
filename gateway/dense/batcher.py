"""Merges dense-row requests from many clients into few engine calls.

Requests queue up while the engine is busy; each engine call takes everything queued (up to
`max_batch_rows` distinct rows), runs identical (adapter, prefix) rows once, and hands every
request its own rows back. When the engine was idle it first waits `window_s` for more, but only
while traffic is concurrent (the last engine call served several requests): a lone client, such
as an SMC loop that sends one request per step and waits for it, would pay the window every step. Rows of
different adapters share an engine call: the engine applies each row's adapter.

Such a lone client's request, finding the engine idle and nobody queued, makes its engine call
itself, in its own task: no queue, no hand-over to the batcher's task and back, no merging of
rows that the engine de-duplicates anyway. It first lets the event loop turn once, so requests
that arrive with it still share its call (they queue, and it joins them).

A request may name arrays `out` for its rows (numpy's `out=`: a client's shared memory registered
with the engine, and page-locked memory of the engine's own for the output cache); its rows are
in them when it is answered. Alone in its engine call, `out` goes down with it
(backends/placement.py: a GPU engine writes there from its device); sharing an engine call, its
rows are copied there from the call's.

Requests whose clients have gone (their futures cancelled) are dropped before each engine call.
When an engine call fails, its requests are retried one by one, so only the request that causes
the failure gets the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from backends.engine import Engine
from backends.placement import Out, Placed, copy_rows_into, outputs, place_rows
from backends.rows import PackedRows

log = logging.getLogger(__name__)

Row = tuple[str | None, bytes]  # (adapter, the row's key: PackedRows.keys)


@dataclass
class EngineTimes:
    """When the engine call that computed a request's rows began and ended (perf_counter; the
    last call, for a request split over several)."""

    began: float = 0.0
    ended: float = 0.0


@dataclass
class _Request:
    rows: PackedRows
    adapter: str | None
    keys: list[Row]
    future: asyncio.Future[Placed]
    out: Out | None = None
    times: EngineTimes | None = None
    enqueued: float = field(default_factory=lambda: asyncio.get_running_loop().time())


@dataclass
class BatchStats:
    requests: int = 0
    rows: int = 0  # rows asked for
    engine_rows: int = 0  # rows computed (after de-duplication)
    batches: int = 0  # engine calls
    largest_batch: int = 0


class RowBatcher:
    def __init__(
        self,
        engine: Engine,
        *,
        max_batch_rows: int = 256,
        window_s: float = 0.002,
        on_batch: Callable[[int], None] | None = None,
        on_wait: Callable[[float], None] | None = None,
    ) -> None:
        self._engine = engine
        self._on_batch = on_batch or (lambda rows: None)  # distinct rows of each engine call
        self._on_wait = on_wait or (lambda seconds: None)  # queueing time of each request
        self.max_batch_rows = max_batch_rows
        self.window_s = window_s
        self.stats = BatchStats()
        self._queue: asyncio.Queue[_Request] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None
        self._concurrent = False  # the last engine call served more than one request
        self._engine_busy = False  # an engine call is under way, or a lone request is about to make one
        self._engine_free = asyncio.Event()
        self._engine_free.set()

    async def submit(
        self,
        rows: PackedRows,
        adapter: str | None = None,
        out: Out | None = None,
        times: EngineTimes | None = None,
    ) -> Placed:
        """The rows, float32 [len(rows), vocab], each equal to what the engine computes for it
        alone; in every array of `out` when given. `times`, if given, is filled in with when the
        engine call began and ended."""
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._run(), name="row-batcher")
        self.stats.requests += 1
        self.stats.rows += len(rows)
        others: list[_Request] = []
        if (
            not self._concurrent
            and not self._engine_busy
            and self._queue.empty()
            and len(rows) <= self.max_batch_rows
        ):
            self._hold_engine()
            try:
                await asyncio.sleep(0)  # requests that came with this one share its call
                if self._queue.empty():
                    return await self._call_alone(rows, adapter, out, times)
                others = [self._queue.get_nowait() for _ in range(self._queue.qsize())]
            finally:
                self._release_engine()
        keys = [(adapter, key) for key in rows.keys]
        request = _Request(rows, adapter, keys, asyncio.get_running_loop().create_future(), out, times)
        for queued in (request, *others):  # in the order they came
            self._queue.put_nowait(queued)
        return await request.future

    def _hold_engine(self) -> None:
        self._engine_busy = True
        self._engine_free.clear()

    def _release_engine(self) -> None:
        self._engine_busy = False
        self._engine_free.set()

    async def _call_alone(
        self, rows: PackedRows, adapter: str | None, out: Out | None, times: EngineTimes | None
    ) -> Placed:
        """A lone request's engine call, made by its own task: rows as they are (the engine
        computes each distinct row once), into `out` when given."""
        self._concurrent = False
        self._on_wait(0.0)
        self._count_batch(len(set(rows.keys)))
        began = time.perf_counter()
        try:
            return await place_rows(self._engine, rows, [adapter] * len(rows), out)
        finally:
            if times is not None:
                times.began, times.ended = began, time.perf_counter()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    async def aclose(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker

    async def _gather(self) -> list[_Request]:
        batch = [await self._queue.get()]
        while self._engine_busy:  # a lone request's own engine call: what queues meanwhile waits
            await self._engine_free.wait()
        self._hold_engine()  # released by _run once these requests are served
        unique = set(batch[0].keys)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.window_s if self._concurrent else 0.0)
        while len(unique) < self.max_batch_rows:
            try:
                request = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    request = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
            batch.append(request)
            unique.update(request.keys)
        return batch

    async def _run(self) -> None:
        while True:
            gathered = await self._gather()
            try:
                batch = [r for r in gathered if not r.future.done()]  # drop cancelled requests
                if not batch:
                    continue
                self._concurrent = len(batch) > 1
                now = asyncio.get_running_loop().time()
                for request in batch:
                    self._on_wait(now - request.enqueued)
                await self._serve(batch)
            finally:
                self._release_engine()

    async def _serve(self, batch: list[_Request]) -> None:
        distinct: dict[Row, None] = {}  # the distinct rows, in the order first asked
        for request in batch:
            distinct.update(dict.fromkeys(request.keys))
        unique = list(distinct)
        try:
            if len(batch) == 1 and len(unique) <= self.max_batch_rows:
                # One request: its rows go down as they are, into its `out` (repeats included:
                # placement computes each distinct row once).
                alone = batch[0]
                self._count_batch(len(unique))
                began = time.perf_counter()
                placed = await place_rows(
                    self._engine, alone.rows, [alone.adapter] * len(alone.rows), alone.out
                )
                _timed(batch, began)
                if not alone.future.done():
                    alone.future.set_result(placed)
                return
            # A request larger than max_batch_rows is split over several engine calls.
            parts: list[np.ndarray] = []
            for start in range(0, len(unique), self.max_batch_rows):
                if all(request.future.done() for request in batch):
                    return  # every client waiting for these rows has gone
                chunk = unique[start : start + self.max_batch_rows]
                self._count_batch(len(chunk))
                rows = PackedRows.from_keys([key for _, key in chunk])
                began = time.perf_counter()
                parts.append((await place_rows(self._engine, rows, [a for a, _ in chunk])).rows)
                _timed(batch, began)
            results = parts[0] if len(parts) == 1 else np.concatenate(parts)
        except Exception as exc:
            if len(batch) > 1:  # find the request that fails: the others must not fail with it
                log.warning("engine call failed for %d requests; retrying them one by one", len(batch))
                for request in batch:
                    if not request.future.done():
                        await self._serve([request])
                return
            log.exception("engine call failed for %d rows", len(unique))
            if not batch[0].future.done():
                batch[0].future.set_exception(exc)
            return
        index = dict(zip(unique, range(len(unique)), strict=True))
        for request in batch:
            if request.future.done():
                continue
            positions = [index[key] for key in request.keys]
            if request.out is None:
                request.future.set_result(Placed(_take(results, positions)))
                continue
            arrays = outputs(request.out)  # gathered straight into them: megabytes, off the loop
            await asyncio.to_thread(copy_rows_into, results, positions, arrays)
            if not request.future.done():
                request.future.set_result(Placed(arrays[0]))

    def _count_batch(self, rows: int) -> None:
        self.stats.batches += 1
        self.stats.engine_rows += rows
        self.stats.largest_batch = max(self.stats.largest_batch, rows)
        self._on_batch(rows)


def _timed(batch: list[_Request], began: float) -> None:
    ended = time.perf_counter()
    for request in batch:
        if request.times is not None:
            request.times.began, request.times.ended = began, ended


def _take(results: np.ndarray, positions: list[int]) -> np.ndarray:
    """results[positions]: a view when they are consecutive (a request alone in its batch, rows
    distinct), else a copy. Rows are megabytes per step; the view spares one copy of them."""
    first = positions[0] if positions else 0
    if positions == list(range(first, first + len(positions))):
        return results[first : first + len(positions)]
    return results[positions]
