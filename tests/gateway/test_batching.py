"""One batching layer: the gateway hands each request's rows to its engine as they come
(gateway/dense/engine_calls.py), and the engine's scheduler merges concurrent requests.

On the real transformers engine: concurrent requests share a pass and rows they share are computed
once, each getting its rows as if alone; a lone client's requests never wait for company; a
failing request fails alone; a request cancelled while queued is never computed. On a recording
engine: a request's rows are the engine's array itself, its memory reaches the engine's host
memory, and a request over max_batch_rows is split into calls and gathered back in order."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from backends.rows import PackedRows
from backends.transformers.engine import TransformersEngine
from backends.types import EngineConfig
from gateway.dense.engine_calls import EngineCalls, EngineTimes

POISON = 4242  # a token id the failing pass below refuses


@pytest.fixture(scope="module")
def engine(model_dir):
    return TransformersEngine.load(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))


@pytest.fixture()
def passes(engine, monkeypatch):
    """The rows of each submission of every pass the engine's scheduler runs; `gate`, when set to
    an unset event, holds the next pass until it is set."""
    recorded: list[list[list[tuple[int, ...]]]] = []
    run = engine.steps._run_pass

    async def recording(groups):
        recorded.append([[tuple(r.tolist()) for r, *_ in group] for group in groups])
        gate = recording.gate
        if gate is not None:
            recording.gate = None
            await gate.wait()
        return await run(groups)

    recording.gate = None
    monkeypatch.setattr(engine.steps, "_run_pass", recording)
    recording.recorded = recorded
    return recording


def ids(engine, text: str) -> list[int]:
    return engine.info.tokenizer(text).input_ids


async def test_concurrent_requests_share_a_pass_and_rows_they_share_are_computed_once(engine, passes):
    first = [ids(engine, "The capital of France is"), ids(engine, "Once upon a time")]
    second = [ids(engine, "Once upon a time"), ids(engine, "Water boils at")]
    alone = [
        (await EngineCalls(engine).logprobs(PackedRows.of(rows))).logprobs.copy() for rows in (first, second)
    ]
    passes.recorded.clear()
    computed = engine.status().pass_stats.rows
    calls = EngineCalls(engine)
    together = await asyncio.gather(
        calls.logprobs(PackedRows.of(first)), calls.logprobs(PackedRows.of(second))
    )
    assert [list(map(len, submissions)) for submissions in passes.recorded] == [[2, 2]]  # one pass
    assert engine.status().pass_stats.rows - computed == 3  # the row both asked for, once
    for placed, own in zip(together, alone, strict=True):
        np.testing.assert_allclose(placed.logprobs, own, rtol=0, atol=1e-4)
    stats = calls.stats
    assert (stats.requests, stats.rows, stats.calls, stats.engine_rows, stats.largest_call) == (2, 4, 2, 4, 2)
    assert stats.in_progress == 0


async def test_a_lone_clients_requests_each_run_at_once_in_a_pass_of_their_own(engine, passes):
    calls = EngineCalls(engine)
    row = ids(engine, "An SMC loop asks one step at a time:")
    for step in range(4):
        row = [*row, 100 + step]
        await calls.logprobs(PackedRows.of([row, [*row[:-1], 200]]))
    assert [list(map(len, submissions)) for submissions in passes.recorded] == [[2]] * 4


async def test_a_failing_request_fails_alone(engine, passes, monkeypatch):
    compute = engine.dense

    def refusing(rows, keys, adapters, **options):
        if any(POISON in row.tolist() for row in rows):
            raise ValueError("a poisoned row")
        return compute(rows, keys, adapters, **options)

    monkeypatch.setattr(engine, "dense", refusing)
    good = [[ids(engine, f"Neighbour number {i} asks")] for i in range(3)]
    alone = [(await EngineCalls(engine).logprobs(PackedRows.of(rows))).logprobs.copy() for rows in good]
    passes.recorded.clear()
    calls = EngineCalls(engine)
    results = await asyncio.gather(
        *(calls.logprobs(PackedRows.of(rows)) for rows in good[:2]),
        calls.logprobs(PackedRows.of([[1, POISON]])),
        calls.logprobs(PackedRows.of(good[2])),
        return_exceptions=True,
    )
    failed = results.pop(2)
    assert isinstance(failed, ValueError)
    for placed, own in zip(results, alone, strict=True):
        np.testing.assert_allclose(placed.logprobs, own, rtol=0, atol=1e-4)
    assert len(passes.recorded[0]) == 4  # they met in one pass, which failed, then one by one
    assert calls.stats.calls == 3 and calls.stats.in_progress == 0


async def test_a_request_cancelled_while_queued_is_never_computed(engine, passes):
    calls = EngineCalls(engine)
    busy_rows = [ids(engine, "The engine is busy with this request")]
    gone_rows = [ids(engine, "Nobody waits for this one any more")]
    passes.gate = gate = asyncio.Event()
    computed = engine.status().pass_stats.rows
    busy = asyncio.create_task(calls.logprobs(PackedRows.of(busy_rows)))
    while not passes.recorded:  # its pass has begun, held at the gate
        await asyncio.sleep(0.001)
    gone = asyncio.create_task(calls.logprobs(PackedRows.of(gone_rows)))
    await asyncio.sleep(0.01)  # queued in the engine's scheduler behind the busy pass
    assert calls.stats.in_progress == 2
    gone.cancel()
    gate.set()
    await busy
    with pytest.raises(asyncio.CancelledError):
        await gone
    later = await calls.logprobs(PackedRows.of([[*busy_rows[0], 13]]))  # the engine serves on
    assert later.logprobs.shape == (1, engine.info.vocab_size)
    everything = [row for submissions in passes.recorded for rows in submissions for row in rows]
    assert tuple(gone_rows[0]) not in everything
    assert engine.status().pass_stats.rows - computed == 2  # the busy row and the later one
    assert calls.stats.calls == 2 and calls.stats.in_progress == 0


class RecordingEngine:
    """Each row's answer: its ids' sum, its length, its adapter's hash; every call recorded."""

    host_memory = None

    def __init__(self) -> None:
        self.outputs: list[np.ndarray] = []

    async def next_token_logprobs(self, rows, adapters) -> np.ndarray:
        await asyncio.sleep(0.001)
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


async def test_a_requests_rows_are_the_engines_array_and_repeats_are_computed_once():
    engine = RecordingEngine()
    calls = EngineCalls(engine)
    times = EngineTimes()
    rows = (await calls.logprobs(PackedRows.of([[1, 2], [3], [4, 5, 6]]), times=times)).logprobs
    assert rows is engine.outputs[-1] and rows[:, 0].tolist() == [3, 3, 15]
    assert 0 < times.began < times.ended
    repeated = (await calls.logprobs(PackedRows.of([[1], [2], [1]]))).logprobs
    assert engine.outputs[-1][:, 0].tolist() == [1, 2] and repeated[:, 0].tolist() == [1, 2, 1]
    assert calls.stats.engine_rows == 5 and calls.stats.largest_call == 3


async def test_memory_to_write_into_reaches_the_engine_unless_the_request_is_split():
    engine = RecordingEngine()
    engine.host_memory = memory = RecordingHostMemory(engine)
    calls = EngineCalls(engine, max_batch_rows=2)
    into, own = np.zeros((3, 3), np.float32), np.zeros((3, 3), np.float32)
    written = await calls.logprobs(PackedRows.of([[1], [2], [1]]), None, (into, own))  # 2 distinct rows
    assert written.logprobs is into and memory.targets == [((into, own), [[1], [2]])]
    assert into[:, 0].tolist() == [1, 2, 1] and np.array_equal(own, into)
    # 3 distinct rows, over max_batch_rows: two calls, the rows gathered into `out` in order
    target = np.zeros((4, 3), np.float32)
    split = await calls.logprobs(PackedRows.of([[7], [8], [9], [7]]), None, (target,))
    assert split.logprobs is target and target[:, 0].tolist() == [7, 8, 9, 7]
    assert len(memory.targets) == 1 and [out[:, 0].tolist() for out in engine.outputs[-2:]] == [[7, 8], [9]]
    plain = (
        await calls.logprobs(PackedRows.of([[5], [6], [4]]))
    ).logprobs  # distinct: the calls' rows as they are
    assert plain[:, 0].tolist() == [5, 6, 4]
    assert calls.stats.calls == 5 and calls.stats.largest_call == 2 and calls.stats.requests == 3
