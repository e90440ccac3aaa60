"""The vLLM engine's dense rows through vLLM's own `logprobs=-1` (`dense_rows = "logprobs"`, no
logits processor), against a direct float32 forward pass, and the option's values checked."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from backends.errors import EngineUnavailableError
from backends.types import EngineConfig
from tests.conftest import engine_rows, require_engine_library

require_engine_library("vllm")
pytestmark = pytest.mark.vllm

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


def test_an_unknown_dense_rows_value_is_refused_before_loading(model_dir):
    from backends.vllm.engine import VllmEngine

    with pytest.raises(EngineUnavailableError, match="dense_rows must be one of capture, logprobs"):
        VllmEngine.load(EngineConfig(model=str(model_dir), options={"dense_rows": "fast"}))


@pytest.mark.slow
async def test_rows_through_vllms_own_logprobs_equal_a_forward_pass(model_dir, reference):
    from backends.vllm.engine import VllmEngine

    config = EngineConfig(model=str(model_dir), options={"dense_rows": "logprobs"})
    engine = await asyncio.to_thread(VllmEngine.load, config)
    try:
        assert not engine.capture
        ids = [reference.tokenizer(p).input_ids for p in PROMPTS]
        rows = await engine_rows(engine, ids + ids[:1])  # a repeated row is answered once
        assert rows.shape == (4, engine.info.vocab_size)
        for row, prefix in zip(rows, ids + ids[:1], strict=True):
            assert np.max(np.abs(row - reference.logprobs(prefix)[-1])) <= 1e-2
    finally:
        await engine.aclose()
