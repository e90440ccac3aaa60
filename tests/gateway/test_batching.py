"""gateway.dense.batcher.RowBatcher on a recording engine call: what each request gets back, and when
that is a view of the engine's output rather than a copy."""

from __future__ import annotations

import asyncio

import numpy as np

from backends.base import WrittenRows
from gateway.dense.batcher import RowBatcher


class RecordingEngine:
    def __init__(self) -> None:
        self.outputs: list[np.ndarray] = []

    async def __call__(self, rows, adapters) -> np.ndarray:
        await asyncio.sleep(0.01)
        out = np.array(
            [[sum(r), len(r), hash(a) % 7] for r, a in zip(rows, adapters, strict=True)], np.float32
        )
        self.outputs.append(out)
        return out


async def test_a_request_alone_gets_a_view_and_shared_batches_get_their_own_rows():
    engine = RecordingEngine()
    batcher = RowBatcher(engine, window_s=0.05)
    alone = await batcher.submit([[1, 2], [3], [4, 5, 6]])
    assert np.shares_memory(alone, engine.outputs[-1])  # the engine's rows as they are
    assert alone[:, 0].tolist() == [3, 3, 15]
    first, second = await asyncio.gather(
        batcher.submit([[1], [2], [3]]),
        batcher.submit([[2], [9], [1]]),  # overlapping rows
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
        await batcher.submit([[step]])
    assert loop.time() - started < 0.3 and len(engine.outputs) == 3

    async def late(rows, delay):
        await asyncio.sleep(delay)
        return await batcher.submit(rows)

    await asyncio.gather(batcher.submit([[1]]), batcher.submit([[2]]))  # concurrent: window on
    calls = len(engine.outputs)
    await asyncio.gather(batcher.submit([[3]]), late([[4]], 0.1))  # the late one still joins
    assert len(engine.outputs) == calls + 1 and len(engine.outputs[-1]) == 2
    await batcher.aclose()


async def _landed() -> None:
    return None


async def test_memory_to_write_into_reaches_the_engine_only_for_a_request_alone_in_its_call():
    engine = RecordingEngine()
    targets = []

    async def write(rows, adapters, into, *, positions):
        targets.append((into, positions))
        out = await engine(rows, adapters)
        into[...] = out if positions is None else out[positions]
        return WrittenRows(out, _landed)

    batcher = RowBatcher(engine, window_s=0.05, engine_write=write)
    into = np.zeros((3, 3), np.float32)
    alone = await batcher.submit([[1, 2], [3], [4, 5, 6]], None, into)
    assert isinstance(alone, WrittenRows) and len(alone.rows) == 3
    assert len(targets) == 1 and targets[0] == (into, None) and into[:, 0].tolist() == [3, 3, 15]
    # Rows that repeat: computed once each, every repeat written by the engine.
    twice = np.zeros((3, 3), np.float32)
    written = await batcher.submit([[1], [2], [1]], None, twice)
    assert (
        isinstance(written, WrittenRows)
        and len(written.rows) == 2
        and engine.outputs[-1][:, 0].tolist() == [1, 2]
    )
    assert targets[-1][1] == [0, 1, 0] and twice[:, 0].tolist() == [1, 2, 1]
    await asyncio.gather(batcher.submit([[7]]), batcher.submit([[8]]))  # concurrent: window on
    shared, _ = await asyncio.gather(
        batcher.submit([[9]], None, np.zeros((1, 3), np.float32)), batcher.submit([[10]])
    )  # shares its engine call
    assert isinstance(shared, np.ndarray) and shared[:, 0].tolist() == [9]
    assert len(targets) == 2 and len(engine.outputs) == 4
    await batcher.aclose()
