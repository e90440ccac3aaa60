"""The transformers engine's decode lane (backends/transformers/decode_lane.py): rows that extend the last
pass's rows by a token, served from a static cache, equal an uncached forward pass of each row."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import numpy as np
import pytest
import torch

from backends.errors import AdapterError
from backends.sampling import Pick
from backends.transformers import decode_lane
from backends.transformers.dense_rows import DenseRows
from backends.transformers.engine import TransformersEngine
from backends.transformers.host_copy import best_entries
from backends.transformers.step_pass import GreedySteps, steps_ahead
from backends.types import EngineConfig, PassStats
from tests.conftest import engine_rows, requires_cuda


def load(model_dir, device: str, **options) -> TransformersEngine:
    return TransformersEngine.load(
        EngineConfig(model=str(model_dir), dtype="float32", device=device, options=options)
    )


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = load(model_dir, "cpu", decode_lane_rows=64)
    assert engine.lane is not None
    return engine


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    """The lane over the tiny random model, for the stream tests: how streams share the lane's
    steps, at a few ms a token."""
    engine = load(tiny_model_dir, "cpu", decode_lane_rows=64)
    assert engine.lane is not None
    return engine


@pytest.fixture()
def tight(monkeypatch):
    """Shapes with little room to grow, so a short run changes shape several times."""
    monkeypatch.setattr(decode_lane, "WIDTH_STEP", 4)
    monkeypatch.setattr(decode_lane, "HEADROOM", 2)


def ids(engine, text: str) -> list[int]:
    return engine.info.tokenizer(text).input_ids


async def smc_run(engine, reference, steps: int, seed: int) -> tuple[float, int]:
    """An SMC-like loop: particles extended by a random common token per step, resampled every 3 steps,
    a newcomer of another length joining, most particles dying late. Returns the largest
    |difference| from an uncached forward pass over the rows checked, and the rows checked."""
    rng = np.random.default_rng(seed)
    rows = [ids(engine, f"Once upon a time, in village {seed},")] * 10
    worst, checked = 0.0, 0
    for step in range(steps):
        unique = [list(r) for r in dict.fromkeys(map(tuple, rows))]
        out = await engine_rows(engine, unique)
        for i in {0, len(unique) // 2, len(unique) - 1}:
            worst = max(worst, float(np.abs(out[i] - reference.logprobs(unique[i])[-1]).max()))
            checked += 1
        rows = [r + [int(t)] for r, t in zip(rows, rng.integers(100, 2000, len(rows)), strict=True)]
        if step % 3 == 2:
            rows = [rows[i] for i in rng.choice(len(rows), len(rows))]
        if step == 4:
            rows.append(ids(engine, "The capital of France is"))
        if step == steps - 4:
            rows = rows[:2]
    return worst, checked


async def test_smc_steps_through_the_lane_equal_uncached_rows(engine, reference, tight):
    lane_steps = engine.lane.steps
    worst, checked = await smc_run(engine, reference, steps=14, seed=0)
    assert worst < 1e-4 and checked >= 30
    # every pass but the first and the newcomer's went through the lane, across several shapes
    assert engine.lane.steps - lane_steps >= 11
    assert len(engine.lane._shapes) >= 3


async def test_duplicate_rows_and_repeated_passes(engine, reference):
    base = ids(engine, "My favourite food is")
    await engine_rows(engine, [base])
    rows = [base + [5], base + [5], base + [6]]
    out = await engine_rows(engine, rows)
    assert np.abs(out[0] - out[1]).max() == 0
    again = await engine_rows(engine, rows)  # the same rows again: not one token longer
    extended = await engine_rows(engine, [r + [7] for r in rows])
    for i, row in enumerate(rows):
        assert np.abs(again[i] - reference.logprobs(row)[-1]).max() < 1e-4
        assert np.abs(extended[i] - reference.logprobs(row + [7])[-1]).max() < 1e-4


async def test_rows_of_an_adapter_never_take_the_base_models_lane(engine):
    row = ids(engine, "Water boils at")
    await engine_rows(engine, [row])
    with pytest.raises(AdapterError):  # no adapter is loaded: refused, not served by the base model
        await engine_rows(engine, [row + [264]], ["missing"])


async def test_off_on_the_cpu_by_default(model_dir):
    plain = load(model_dir, "cpu")
    try:
        assert plain.lane is None
    finally:
        await plain.aclose()


@requires_cuda
async def test_on_the_gpu_lane_steps_are_graph_replays_equal_to_uncached_rows(model_dir, reference):
    gpu = load(model_dir, "cuda")
    try:
        assert gpu.lane is not None and gpu.lane.graphs  # the default on CUDA
        worst, checked = await smc_run(gpu, reference, steps=14, seed=1)
        assert worst < 1e-4 and checked >= 30
        assert gpu.lane.steps >= 11
    finally:
        await gpu.aclose()


async def test_a_step_torch_compile_cannot_build_runs_uncompiled(tiny_model_dir, tiny_reference, monkeypatch):
    def failing_compile(model, **kwargs):
        def compiled(*args, **kwargs):
            raise RuntimeError("no compiler here")

        return compiled

    monkeypatch.setattr(decode_lane.torch, "compile", failing_compile)
    engine = load(tiny_model_dir, "cpu", decode_lane_rows=64, decode_lane_compile=True)
    try:
        assert engine.lane is not None and not engine.lane.compiled  # given up at load, not at a request
        worst, checked = await smc_run(engine, tiny_reference, steps=6, seed=2)
        assert worst < 1e-4 and engine.lane.steps >= 4
    finally:
        await engine.aclose()


async def test_the_compiled_step_is_traced_once_for_every_shape(model_dir, tmp_path):
    """A model whose key/value heads are as many as the lane's fewest slots (8) and whose head
    is as wide as its narrowest shape (64 columns): the step compiled at load, traced in one
    go, serves wider and taller shapes without tracing the model again, and its rows equal a
    plain forward pass."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=16,
        head_dim=decode_lane.WIDTH_STEP,
        num_key_value_heads=decode_lane.MIN_SLOTS,
        intermediate_size=128,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    restarts = _Records()
    dynamo = logging.getLogger("torch._dynamo.convert_frame")
    level = dynamo.level
    dynamo.addHandler(restarts)
    dynamo.setLevel(logging.INFO)
    try:
        compiled = load(tmp_path, "cpu", decode_lane_rows=64, decode_lane_compile=True)
    finally:
        dynamo.removeHandler(restarts)
        dynamo.setLevel(level)
    # dynamo restarts its analysis where it traced a float as a symbol and had to specialise it
    assert not [m for m in restarts.messages if "Restarting analysis" in m]
    try:
        assert compiled.lane is not None and compiled.lane.compiled
        traced = counters["stats"]["unique_graphs"]
        for rows, length in ((8, 20), (8, 80), (16, 20)):  # 8 x 64, then 8 x 128, then 16 x 64
            prompts = [[5 + i] * length for i in range(rows)]
            await engine_rows(compiled, prompts)
            out = await engine_rows(compiled, [p + [7] for p in prompts])
            with torch.inference_mode():
                plain = compiled.model(input_ids=torch.tensor([prompts[-1] + [7]])).logits[0, -1]
            assert np.abs(out[-1] - torch.log_softmax(plain, -1).numpy()).max() < 1e-4
        assert compiled.lane.steps == 3
        assert counters["stats"]["unique_graphs"] == traced
    finally:
        await compiled.aclose()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def test_concurrent_generation_streams_share_lane_steps(tiny_engine):
    """Streams of different prompt lengths, joining at different times, step together in the
    lane; each stream's tokens and log-probabilities equal its run alone."""
    from tests.backends.test_step_scheduler import PROMPTS, assert_same, run_alone, stream

    prompts = PROMPTS[:4]
    alone = [await run_alone(tiny_engine, text) for text in prompts]
    lane_steps = tiny_engine.lane.steps
    together = await asyncio.gather(*(stream(tiny_engine, text) for text in prompts))
    for batched, single in zip(together, alone, strict=True):
        assert_same(batched, single)
    assert tiny_engine.lane.steps - lane_steps >= len(alone[0]) - 2


async def test_the_lane_and_the_prefix_cache_share_one_budget(tiny_model_dir, tiny_reference, tight):
    """docs/engines.md: memory is the prefix cache's budget, the lane's shapes included. A budget
    the lane's shapes fill half of: lane and cache together never hold more than it."""
    budget = 3 * decode_lane.kv_bytes(tiny_reference.model, 16, 16)
    engine = load(tiny_model_dir, "cpu", decode_lane_rows=64, prefix_cache_bytes=budget)
    rng = np.random.default_rng(3)
    held = []
    try:
        for text in ("The quick brown fox", "In the beginning", "A long time ago"):  # fill the cache
            await engine_rows(engine, [ids(engine, f"{text} {i} " * 6) for i in range(8)])
        rows = [ids(engine, "Once upon a time, in a village far away,")] * 10
        for _ in range(12):
            await engine_rows(engine, [list(r) for r in dict.fromkeys(map(tuple, rows))])
            held.append((engine.prefix_kv.nbytes, engine.lane.nbytes))
            rows = [r + [int(t)] for r, t in zip(rows, rng.integers(100, 2000, len(rows)), strict=True)]
    finally:
        await engine.aclose()
    assert engine.lane.steps >= 6  # the lane served most of the run
    assert max(lane for _, lane in held) > 0 and max(cache for cache, _ in held) > 0
    assert max(cache + lane for cache, lane in held) <= budget, held


async def assert_bursts_take_steps_ahead(engine, caplog) -> None:
    """Greedy streams whose tokens go out in bursts take up to `steps_ahead` steps a pass, each
    step's token fed to the next in the lane: the same tokens, log-probabilities and alternatives
    as a token at a time, where a burst or max_tokens ends inside a pass's steps (streams of
    several lengths beside streams wanting more), a stream with no alternatives beside one with
    two, and a dense call among them (its rows as alone); no pass fails on the way (a failed pass
    is retried a submission at a time, with the same results). A stream with one step left at a
    pass's start is checked alone, below: where passes fall here depends on the dense call."""
    from tests.backends.test_step_scheduler import GREEDY, PROMPTS, assert_same, run_alone, stream

    cases = [
        (PROMPTS[0], replace(GREEDY, max_tokens=21)),
        (PROMPTS[1], replace(GREEDY, top_logprobs=0)),
        (PROMPTS[2] * 3, GREEDY),  # a longer prompt
        (PROMPTS[7], replace(GREEDY, max_tokens=18)),  # another length ending inside a pass
    ]
    alone = [await run_alone(engine, text, params) for text, params in cases]
    rows = [ids(engine, text) for text in PROMPTS[3:6]]
    rows_alone = await engine_rows(engine, rows)
    lane_steps, passes = engine.lane.steps, engine.status().pass_stats.passes
    intervals = (50, 5, 50, 50)
    caplog.set_level(logging.WARNING, logger="backends.step_scheduler")

    async def dense_call_meanwhile():  # a pass of dense rows among the streams' passes
        await asyncio.sleep(0.05)
        return await engine_rows(engine, rows)

    *together, rows_meanwhile = await asyncio.gather(
        *(
            stream(engine, t, replace(p, stream_interval=i))
            for (t, p), i in zip(cases, intervals, strict=True)
        ),
        dense_call_meanwhile(),
    )
    for batched, single in zip(together, alone, strict=True):
        assert_same(batched, single)
    np.testing.assert_allclose(rows_meanwhile, rows_alone, rtol=0, atol=1e-4)
    tokens = max(map(len, alone))
    assert engine.status().pass_stats.passes - passes < tokens / 2  # several steps a pass
    assert engine.lane.steps - lane_steps >= tokens - 4  # nearly all of them in the lane
    retried = [r.getMessage() for r in caplog.records if r.name == "backends.step_scheduler"]
    assert not retried, retried  # not asyncio's: an engine of another test, collected meanwhile


async def test_streams_in_bursts_take_several_steps_a_pass_fed_on_the_device(tiny_engine, tight, caplog):
    await assert_bursts_take_steps_ahead(tiny_engine, caplog)  # tight: through changes of the lane's shape


async def test_streams_joining_one_by_one_keep_their_rows_in_the_lane(tiny_engine, monkeypatch):
    """Streams sent whole, starting one after another while the others run (as requests arrive):
    past its prompt no stream's step runs through the prefix cache (the lane holds every row: a
    stream whose first token went out is in the next pass, beside prompts that arrived meanwhile),
    and each equals its run alone."""
    from tests.backends.test_step_scheduler import GREEDY, PROMPTS, assert_same, run_alone, stream

    alone = [await run_alone(tiny_engine, text) for text in PROMPTS]
    computed: list[int] = []  # lengths of the rows run through the model, not the lane
    cached_logprobs = DenseRows._cached_logprobs

    def recorded(self, rows, *args):
        computed.extend(map(len, rows))
        return cached_logprobs(self, rows, *args)

    monkeypatch.setattr(DenseRows, "_cached_logprobs", recorded)
    pass_s = 0.02  # about a pass of these streams on a CPU: prompts arrive during passes

    async def joining(i: int, text: str):
        await asyncio.sleep(i * pass_s / 2)
        return await stream(tiny_engine, text, replace(GREEDY, stream_interval=50))

    together = await asyncio.gather(*(joining(i, text) for i, text in enumerate(PROMPTS)))
    for batched, single in zip(together, alone, strict=True):
        assert_same(batched, single)
    assert sorted(computed) == sorted(len(ids(tiny_engine, text)) for text in PROMPTS)  # prompts only


@requires_cuda
async def test_on_the_gpu_streams_in_bursts_replay_several_steps_a_pass(model_dir, caplog):
    gpu = load(model_dir, "cuda")
    try:
        await assert_bursts_take_steps_ahead(gpu, caplog)
    finally:
        await gpu.aclose()


class StepsOfRows:
    """DenseRows' greedy_steps over given rows of log-probabilities, one per step taken."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows  # [taken, rows, vocab]
        self.asked: list[int] = []

    def greedy_steps(self, rows, keys, steps: int, k: int) -> np.ndarray:
        self.asked.append(steps)
        return np.stack([best_entries(torch.from_numpy(step), k).numpy() for step in self.rows[:steps]])


def test_a_pass_takes_the_steps_of_the_stream_wanting_most_and_each_its_own():
    """Streams ending sooner (one step left: a single Pick; three: three Picks) share the steps
    of the one wanting most; every row's steps count as computed."""
    rows = np.log(np.random.default_rng(0).dirichlet(np.ones(50), size=(8, 3))).astype(np.float32)
    dense = StepsOfRows(rows)
    row = np.arange(4, dtype=np.int32)
    groups = [
        [(row, b"a", None, GreedySteps(alternatives=2, steps=8))],
        [(row, b"b", None, 1)],
        [(row, b"c", None, GreedySteps(alternatives=1, steps=3))],
    ]
    stats = PassStats()
    results = steps_ahead(dense, groups, stats)  # type: ignore[arg-type]
    assert dense.asked == [8] and stats.rows == 8 * 3
    assert isinstance(results[1], Pick) and results[1].token == int(rows[0, 1].argmax())
    assert [len(results[0]), len(results[2])] == [8, 3]
    assert [pick.token for pick in results[2]] == rows[:3, 2].argmax(axis=-1).tolist()
    assert len(results[0][0].top_ids) == 2 and len(results[2][0].top_ids) == 1
    assert steps_ahead(dense, [groups[1]], stats) is None  # one step wanted: a plain pass
