"""gateway.dense.batcher.RowBatcher on a recording engine: what each request gets back, when that
is a view of the engine's output rather than a copy, and when its memory reaches the engine."""

from __future__ import annotations

import asyncio

import numpy as np

from backends.rows import PackedRows
from gateway.dense.batcher import RowBatcher


class RecordingEngine:
    host_memory = None

    def __init__(self) -> None:
        self.outputs: list[np.ndarray] = []
        self.callers: list[asyncio.Task | None] = []

    async def next_token_logprobs(self, rows, adapters) -> np.ndarray:
        self.callers.append(asyncio.current_task())
        await asyncio.sleep(0.01)
        computed = np.array(
            [[sum(r), len(r), hash(a) % 7] for r, a in zip(rows.lists(), adapters, strict=True)], np.float32
        )
        self.outputs.append(computed)
        return computed


class RecordingHostMemory:
    """Writes as a device would, recording each call's arrays and rows."""

    def __init__(self, engine: RecordingEngine) -> None:
        self.engine = engine
        self.targets: list[tuple[tuple, list]] = []

    async def write_rows(self, rows, adapters, arrays, positions) -> None:
        self.targets.append((tuple(arrays), rows.lists()))
        computed = await self.engine.next_token_logprobs(rows, adapters)
        for array in arrays:
            array[...] = computed if positions is None else computed[list(positions)]

    def wait_landed(self, array) -> None:
        pass


async def test_a_request_alone_gets_a_view_and_shared_batches_get_their_own_rows():
    engine = RecordingEngine()
    batcher = RowBatcher(engine, window_s=0.05)
    alone = (await batcher.submit(PackedRows.of([[1, 2], [3], [4, 5, 6]]))).rows
    assert np.shares_memory(alone, engine.outputs[-1])  # the engine's rows as they are
    assert alone[:, 0].tolist() == [3, 3, 15]
    first, second = (
        placed.rows
        for placed in await asyncio.gather(
            batcher.submit(PackedRows.of([[1], [2], [3]])),
            batcher.submit(PackedRows.of([[2], [9], [1]])),  # overlapping rows
        )
    )
    assert len(engine.outputs) == 2 and len(engine.outputs[-1]) == 4  # one call, rows de-duplicated
    assert first[:, 0].tolist() == [1, 2, 3] and second[:, 0].tolist() == [2, 9, 1]
    assert np.shares_memory(first, engine.outputs[-1])  # its rows are consecutive in the batch
    assert not np.shares_memory(second, engine.outputs[-1])  # gathered: a copy
    await batcher.aclose()


async def test_the_window_is_waited_only_under_concurrent_traffic():
    engine = RecordingEngine()
    batcher = RowBatcher(engine, window_s=0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    for step in range(3):  # a lone client, one request per step: never waits for company
        await batcher.submit(PackedRows.of([[step]]))
    assert loop.time() - started < 0.3 and len(engine.outputs) == 3

    async def late(rows, delay):
        await asyncio.sleep(delay)
        return await batcher.submit(PackedRows.of(rows))

    await asyncio.gather(
        batcher.submit(PackedRows.of([[1]])), batcher.submit(PackedRows.of([[2]]))
    )  # concurrent: window on
    calls = len(engine.outputs)
    await asyncio.gather(batcher.submit(PackedRows.of([[3]])), late([[4]], 0.1))  # the late one still joins
    assert len(engine.outputs) == calls + 1 and len(engine.outputs[-1]) == 2
    await batcher.aclose()


async def test_memory_to_write_into_reaches_the_engine_only_for_a_request_alone_in_its_call():
    engine = RecordingEngine()
    engine.host_memory = memory = RecordingHostMemory(engine)
    batcher = RowBatcher(engine, window_s=0.05)
    into, own = np.zeros((3, 3), np.float32), np.zeros((3, 3), np.float32)
    alone = await batcher.submit(PackedRows.of([[1, 2], [3], [4, 5, 6]]), None, (into, own))
    assert alone.rows is into and len(memory.targets) == 1 and memory.targets[0][0] == (into, own)
    assert into[:, 0].tolist() == [3, 3, 15] and np.array_equal(own, into)
    # Rows that repeat: computed once each, every repeat written where it goes.
    twice = np.zeros((3, 3), np.float32)
    written = await batcher.submit(PackedRows.of([[1], [2], [1]]), None, (twice,))
    assert written.rows is twice and engine.outputs[-1][:, 0].tolist() == [1, 2]
    assert memory.targets[-1][1] == [[1], [2]] and twice[:, 0].tolist() == [1, 2, 1]
    await asyncio.gather(
        batcher.submit(PackedRows.of([[7]])), batcher.submit(PackedRows.of([[8]]))
    )  # concurrent: window on
    target = np.zeros((1, 3), np.float32)
    shared, _ = await asyncio.gather(
        batcher.submit(PackedRows.of([[9]]), None, (target,)), batcher.submit(PackedRows.of([[10]]))
    )  # shares its engine call: its rows are copied into its memory from the call's
    assert shared.rows is target and target[0, 0] == 9
    assert len(memory.targets) == 2 and len(engine.outputs) == 4
    await batcher.aclose()


async def test_a_lone_request_calls_the_engine_itself_and_engine_calls_never_overlap():
    engine = RecordingEngine()
    active, most = 0, 0
    compute = engine.next_token_logprobs

    async def counted(rows, adapters):
        nonlocal active, most
        active += 1
        most = max(most, active)
        try:
            return await compute(rows, adapters)
        finally:
            active -= 1

    engine.next_token_logprobs = counted
    batcher = RowBatcher(engine, window_s=0.05)

    async def lone():
        return (await batcher.submit(PackedRows.of([[1], [1], [2]]))).rows  # repeats: computed once

    task = asyncio.create_task(lone())
    rows = await task
    assert engine.callers == [task] and rows[:, 0].tolist() == [1, 1, 2]
    assert batcher.stats.engine_rows == 2 and batcher.stats.largest_batch == 2

    # Requests that come while a lone request's call runs wait for it, then share one call.
    first = asyncio.create_task(batcher.submit(PackedRows.of([[5]])))
    await asyncio.sleep(0.002)  # its call under way
    later = [batcher.submit(PackedRows.of([[6]])), batcher.submit(PackedRows.of([[7]]))]
    one, two, three = (placed.rows for placed in await asyncio.gather(first, *later))
    assert [one[0, 0], two[0, 0], three[0, 0]] == [5, 6, 7]
    assert len(engine.outputs) == 3 and len(engine.outputs[-1]) == 2 and most == 1

    # A lone request cancelled during its call leaves the engine to the next request.
    gone = asyncio.create_task(batcher.submit(PackedRows.of([[8]])))
    await asyncio.sleep(0.002)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert (await batcher.submit(PackedRows.of([[9]]))).rows[0, 0] == 9
    await batcher.aclose()
