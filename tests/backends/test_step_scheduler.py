"""Continuous batching in the transformers engine: concurrent generation streams and dense rows
share forward passes, each stream's tokens and log-probabilities as if it ran alone; streams join
a running batch and leave it at once."""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import replace

import numpy as np
import pytest

from backends.step_scheduler import StepScheduler
from backends.transformers.engine import TransformersEngine
from backends.types import EngineConfig, SamplingParams
from tests.conftest import engine_rows, requires_cuda

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The weather today is",
    "My favourite food is",
    "In 1969, astronauts",
    "Water boils at",
    "The quick brown fox",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, top_logprobs=2)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """The tiny random model: what is tested is how streams share passes, which any model's
    numbers show as well, at a few ms a token."""
    return TransformersEngine.load(EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu"))


@pytest.fixture()
def passes(engine, monkeypatch):
    """The rows of every forward pass the engine's scheduler runs."""
    recorded: list[list[tuple[int, ...]]] = []
    run = engine.steps._run_pass

    async def recording(groups):
        recorded.append([tuple(r.tolist()) for group in groups for r, *_ in group])
        return await run(groups)

    monkeypatch.setattr(engine.steps, "_run_pass", recording)
    return recorded


class FakePass:
    """A pass that takes `seconds`; each row's answer is its sum."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.sizes: list[int] = []

    async def __call__(self, groups):
        self.sizes.append(sum(map(len, groups)))
        await asyncio.sleep(self.seconds)
        return [np.array([[float(sum(r))] for r in rows], np.float32) for rows in groups]


async def test_callers_of_a_pass_that_come_back_one_by_one_share_the_next_one():
    fake = FakePass(0.2)
    scheduler = StepScheduler(fake)

    async def caller(i: int) -> list[float]:
        got = []
        for step in range(3):
            got.append(float((await scheduler.submit([[i, step]]))[0, 0]))
            await asyncio.sleep(0.005 * i)  # sampling its token takes a while, longer for some
        return got

    results = await asyncio.gather(*(caller(i) for i in range(4)))
    assert results == [[i, i + 1, i + 2] for i in range(4)]
    assert fake.sizes == [4, 4, 4]  # waited for the stragglers, well inside a quarter pass
    loop = asyncio.get_running_loop()
    started = loop.time()
    await scheduler.submit([[1]])  # a lone caller after a pass of four: it waits at most the window
    await scheduler.submit([[2]])  # and after a pass of one, not at all
    assert loop.time() - started < 0.2 * 2 + 0.05 + 0.1
    await scheduler.aclose()


async def test_a_failing_submission_fails_alone():
    async def run(groups):
        if any(r[0] < 0 for rows in groups for r in rows):
            raise ValueError("a negative token")
        return [np.array([[float(r[0])] for r in rows], np.float32) for rows in groups]

    scheduler = StepScheduler(run)
    good, bad = await asyncio.gather(
        scheduler.submit([[1], [2]]), scheduler.submit([[-1]]), return_exceptions=True
    )
    assert good[:, 0].tolist() == [1.0, 2.0] and isinstance(bad, ValueError)
    await scheduler.aclose()


async def test_a_caller_that_runs_its_steps_is_called_back_after_each_pass():
    """`run`: the scheduler queues the caller's next step itself; the steps share passes with
    other callers', an error in the callback is raised to the caller, and a cancelled caller's
    steps stop at once."""
    fake = FakePass(0.01)
    scheduler = StepScheduler(fake)
    seen: list[float] = []

    def proceed(result):  # rows [[0, 1]], [[0, 2]], ...: steps of one token more each time
        seen.append(float(result[0, 0]))
        return None if len(seen) == 5 else [[0, len(seen) + 1]]

    async def other():
        return [float((await scheduler.submit([[7, step]]))[0, 0]) for step in range(3)]

    _, others = await asyncio.gather(scheduler.run([[0, 1]], proceed), other())
    assert seen == [1.0, 2.0, 3.0, 4.0, 5.0] and others == [7.0, 8.0, 9.0]
    assert fake.sizes[:3] == [2, 2, 2] and len(fake.sizes) == 5  # no pass of its own for a step

    def failing(result):
        raise KeyError("the callback's own")

    with pytest.raises(KeyError, match="the callback's own"):
        await scheduler.run([[1]], failing)

    counted: list[float] = []
    endless = asyncio.ensure_future(scheduler.run([[2]], lambda r: counted.append(r[0, 0]) or [[2]]))
    while len(counted) < 3:
        await asyncio.sleep(0.005)
    endless.cancel()
    await asyncio.sleep(0.05)
    assert len(counted) <= 4  # the pass under way at the cancel, then no more
    await scheduler.aclose()


def ids(engine, text: str) -> list[int]:
    return engine.info.tokenizer(text).input_ids


async def stream(engine, text: str, params: SamplingParams = GREEDY, stop_after: int | None = None):
    steps = []
    generator = engine.generate(ids(engine, text), params)
    try:
        async for step in generator:
            steps.append(step)
            if stop_after is not None and len(steps) == stop_after:
                break
    finally:
        await generator.aclose()
    return steps


_RUNS_ALONE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def run_alone(engine, text: str, params: SamplingParams = GREEDY, fresh: bool = False):
    """`stream` of a request with nothing beside it. On one engine it is always the same (what the
    tests compare batched streams with), so it is computed once per engine (or again, `fresh`)."""
    runs, key = _RUNS_ALONE.setdefault(engine, {}), (text, repr(params))  # params hold a dict
    if fresh or key not in runs:
        runs[key] = await stream(engine, text, params)
    return runs[key]


async def passes_once_still(engine, quiet=0.3, limit=30.0):
    """The engine's pass count once no pass has run for `quiet` seconds (a busy machine can take
    longer than a fixed sleep to finish a burst); fails if passes go on past `limit`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    count = engine.status().pass_stats.passes
    while loop.time() < deadline:
        await asyncio.sleep(quiet)
        if engine.status().pass_stats.passes == count:
            return count
        count = engine.status().pass_stats.passes
    raise AssertionError(f"passes went on for {limit} s")


def assert_same(batched, alone) -> None:
    assert [s.token_id for s in batched] == [s.token_id for s in alone]
    np.testing.assert_allclose([s.logprob for s in batched], [s.logprob for s in alone], rtol=0, atol=1e-4)
    for b, a in zip(batched, alone, strict=True):
        assert b.top_ids.tolist() == a.top_ids.tolist() and b.finish_reason == a.finish_reason
        np.testing.assert_allclose(b.top_logprobs, a.top_logprobs, rtol=0, atol=1e-4)


async def test_concurrent_streams_share_passes_and_each_equals_its_run_alone(engine, passes):
    alone = [await run_alone(engine, text, fresh=True) for text in PROMPTS]
    solo_passes = len(passes)
    assert solo_passes == sum(len(steps) for steps in alone)  # alone: one pass per step
    passes.clear()
    together = await asyncio.gather(*(stream(engine, text) for text in PROMPTS))
    for batched, single in zip(together, alone, strict=True):
        assert_same(batched, single)
    assert max(len(rows) for rows in passes) == len(PROMPTS)  # every stream in one pass
    assert len(passes) < solo_passes / 4


async def test_a_stream_joins_a_running_batch_and_a_stopped_one_leaves_it_at_once(engine, passes):
    first_alone, second_alone = await run_alone(engine, PROMPTS[0]), await run_alone(engine, PROMPTS[1])
    passes.clear()
    started = asyncio.Event()

    async def first():
        steps = []
        async for step in engine.generate(ids(engine, PROMPTS[0]), GREEDY):
            steps.append(step)
            if len(steps) == 4:
                started.set()
        return steps

    async def second():
        await started.wait()  # the first stream is mid-run
        return await stream(engine, PROMPTS[1], stop_after=5)

    one, two = await asyncio.gather(first(), second())
    assert_same(one, first_alone)
    assert_same(two, second_alone[:5])
    prompt_of_second = tuple(ids(engine, PROMPTS[1]))
    joined = next(i for i, rows in enumerate(passes) if prompt_of_second in rows)
    assert len(passes[joined]) == 2  # its prompt ran beside the first stream's next step
    with_second = [
        i
        for i, rows in enumerate(passes)
        if any(r[: len(prompt_of_second)] == prompt_of_second for r in rows)
    ]
    assert len(with_second) == 5  # five steps, then gone: no pass computes a row of it again
    assert all(len(rows) == 1 for rows in passes[with_second[-1] + 1 :])


async def test_streams_in_bursts_equal_their_runs_a_token_at_a_time(engine, passes):
    """A response sent whole (`stream_interval` > 1): its steps run inside the scheduler and come
    out in bursts, the same steps as a token at a time, greedy with alternatives and sampled with a
    seed, batched with other streams; one that is closed within a burst computes no more than the
    pass under way when it left."""
    sampled = SamplingParams(max_tokens=19, temperature=0.9, top_p=0.95, seed=3, top_logprobs=1)
    cases = [(PROMPTS[0], GREEDY), (PROMPTS[1], sampled), (PROMPTS[2], GREEDY)]
    alone = [await run_alone(engine, text, params) for text, params in cases]
    bursts = [
        replace(params, stream_interval=interval)
        for (_, params), interval in zip(cases, (5, 7, 50), strict=True)
    ]
    together = await asyncio.gather(*(stream(engine, t, b) for (t, _), b in zip(cases, bursts, strict=True)))
    for batched, single in zip(together, alone, strict=True):
        assert_same(batched, single)
    passes.clear()
    closed = await stream(engine, PROMPTS[3], replace(GREEDY, stream_interval=6), stop_after=2)
    await passes_once_still(engine)  # the engine goes quiet
    # the first token, one burst, the pass that went on while the burst was handed over, none after
    assert len(closed) == 2 and len(passes) == 1 + 6 + 1


async def test_a_stream_in_bursts_held_runs_at_most_one_burst_past_and_then_goes_on(engine):
    """Past its first token a stream steps on while its consumer takes tokens in; held there
    (generation paused holds the consumer between tokens), it stops once a burst waits for the
    consumer, and then goes on as a token at a time would."""
    alone = await run_alone(engine, PROMPTS[4])
    generator = engine.generate(ids(engine, PROMPTS[4]), replace(GREEDY, stream_interval=5))
    try:
        steps = [await anext(generator)]
        passes = engine.status().pass_stats.passes
        held = await passes_once_still(engine) - passes  # held: stops within a few passes' time
        # on through the burst after the first token (a pass a step on the CPU), and no further
        assert 2 <= held <= 5
        steps += [step async for step in generator]
    finally:
        await generator.aclose()
    assert_same(steps, alone)


async def test_dense_rows_and_generation_steps_share_a_pass(engine, passes):
    rows = [ids(engine, text) for text in PROMPTS[2:5]]
    alone = await engine_rows(engine, rows)
    steps, dense = await asyncio.gather(stream(engine, PROMPTS[0]), engine_rows(engine, rows))
    np.testing.assert_allclose(dense, alone, rtol=0, atol=1e-4)
    assert any(len(rows_) == len(rows) + 1 for rows_ in passes)  # the rows and a generation step
    assert len(steps) == GREEDY.max_tokens


@requires_cuda
async def test_on_the_gpu_concurrent_streams_equal_their_runs_alone(model_dir):
    gpu = TransformersEngine.load(EngineConfig(model=str(model_dir), dtype="float32", device="cuda"))
    try:
        alone = [await stream(gpu, text) for text in PROMPTS]
        passes = gpu.status().pass_stats.passes
        together = await asyncio.gather(*(stream(gpu, text) for text in PROMPTS))
        for batched, single in zip(together, alone, strict=True):
            assert_same(batched, single)
        stats = gpu.status().pass_stats
        assert stats.largest == len(PROMPTS) and stats.passes - passes < sum(map(len, alone)) / 4
    finally:
        await gpu.aclose()
