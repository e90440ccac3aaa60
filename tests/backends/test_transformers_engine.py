"""The transformers engine itself, against a direct forward pass of the same weights."""

from __future__ import annotations

import inspect
import logging
import warnings

import numpy as np
import pytest
from transformers.utils import logging as hf_logging

from backends.transformers.cache_argument import CACHE_ARGUMENT
from backends.transformers.engine import TransformersEngine
from backends.types import EngineConfig, SamplingParams
from tests.conftest import engine_rows

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(model_dir):
    return TransformersEngine.load(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))


async def test_batched_rows_equal_unpadded_forward_passes(engine, reference):
    texts = ["The capital of France is", "Hi", "A longer sentence about the weather in Paris today"]
    rows = [reference.tokenizer(t).input_ids for t in texts]
    got = await engine_rows(engine, rows)
    assert got.shape == (3, engine.info.vocab_size) and got.dtype == np.float32
    for row, ids in zip(got, rows, strict=True):
        assert np.max(np.abs(row - reference.logprobs(ids)[-1])) <= 1e-4
        assert abs(np.exp(row.astype(np.float64)).sum() - 1) <= 1e-4


async def test_prompt_logprobs_equal_forward_pass(engine, reference):
    ids = reference.tokenizer("Paris is the capital of France").input_ids
    scores = await engine.prompt_logprobs(ids, 4)
    rows = reference.logprobs(ids)
    assert np.max(np.abs(scores.token_logprobs - rows[np.arange(len(ids) - 1), ids[1:]])) <= 1e-4
    assert scores.top_ids.shape == (len(ids) - 1, 4)
    assert scores.top_ids[:, 0].tolist() == np.argmax(rows[:-1], axis=-1).tolist()


async def test_generation_with_kv_cache_matches_greedy_reference(engine, reference):
    ids = reference.tokenizer("Once upon a time").input_ids
    steps = [s async for s in engine.generate(ids, SamplingParams(max_tokens=8, temperature=0))]
    assert [s.token_id for s in steps] == reference.greedy(ids, 8)
    assert steps[-1].finish_reason == "length"


def test_defaults_pick_float32_on_cpu(engine):
    assert next(engine.model.parameters()).dtype.is_floating_point
    assert str(next(engine.model.parameters()).dtype) == "torch.float32"
    assert engine.info.eos_token_ids == {2}


async def test_the_kv_cache_goes_by_the_installed_transformers_name(engine, reference):
    # Recent transformers call it `cache` and warn, once per process, on `past_key_values`.
    assert CACHE_ARGUMENT in inspect.signature(type(engine.model).forward).parameters
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    hf_logging.add_handler(handler)
    hf_logging.warning_once.cache_clear()  # earlier tests may have had it said already
    try:
        with warnings.catch_warnings(record=True) as warned:  # its FutureWarning, besides the log line
            warnings.simplefilter("always")
            ids = reference.tokenizer("The capital of France is").input_ids
            await engine_rows(engine, [ids, [*ids, 7042]])  # the second row extends the first's K/V
            _ = [s async for s in engine.generate(ids, SamplingParams(max_tokens=2, temperature=0))]
    finally:
        hf_logging.remove_handler(handler)
    said = [r.getMessage() for r in records] + [str(w.message) for w in warned]
    assert not [message for message in said if "past_key_values" in message]
