"""The composed engine over two mock engines whose "weights" differ, so each answer says which
engine gave it: what goes where, the match of the two vocabularies, and that new weights and
adapters land in both engines or in neither. The real engines: tests/gateway/test_composed_vllm.py."""

from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest

from backends.composed.engine import ComposedEngine
from backends.errors import AdapterError, EngineMismatchError, EngineUnavailableError, WeightsError
from backends.mock import MockEngine
from backends.registry import composed_config
from backends.rows import PackedRows
from backends.types import EngineConfig, SamplingParams

ROWS = [[1, 2, 3], [5, 6]]


def weights_dir(path, text):
    """A mock's "weights": a directory whose files' bytes draw its rows."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"weights": text}))
    return path


@pytest.fixture(scope="module")
def loaded(model_dir):
    """Two mock engines of the default model's tokenizer (loaded once, rebuilt per test)."""
    engine = MockEngine.load(EngineConfig(model=str(model_dir)))
    return engine.info.tokenizer, str(model_dir)


def mock(loaded, **options) -> MockEngine:
    tokenizer, path = loaded
    return MockEngine(
        tokenizer, vocab_size=len(tokenizer), max_model_len=2048, model_path=path, options=options
    )


@pytest.fixture
def engines(loaded, tmp_path):
    """(composed, generation, dense): the dense engine's weights differ from the generation's."""
    generation, dense = mock(loaded), mock(loaded)
    asyncio.run(dense.weights.load(str(weights_dir(tmp_path / "dense", "other"))))
    return ComposedEngine(generation, dense), generation, dense


def rows(engine, adapters=(None, None)):
    return asyncio.run(engine.next_token_logprobs(PackedRows.of(ROWS), list(adapters)))


def greedy(engine, ids, adapter=None):
    async def run():
        params = SamplingParams(max_tokens=4, temperature=0)
        return [s.token_id async for s in engine.generate(ids, params, adapter)]

    return asyncio.run(run())


def test_scores_come_from_the_dense_engine_and_tokens_from_the_generation_engine(engines):
    composed, generation, dense = engines
    assert not np.array_equal(rows(generation), rows(dense))
    np.testing.assert_array_equal(rows(composed), rows(dense))
    scores = asyncio.run(composed.prompt_logprobs([1, 2, 3, 4], 2))
    want = asyncio.run(dense.prompt_logprobs([1, 2, 3, 4], 2))
    np.testing.assert_array_equal(scores.token_logprobs, want.token_logprobs)
    assert greedy(composed, [1, 2, 3]) == greedy(generation, [1, 2, 3]) != greedy(dense, [1, 2, 3])
    calls = generation.calls
    nothing = asyncio.run(_steps(composed.generate([1, 2], SamplingParams(max_tokens=0))))
    assert nothing == [] and generation.calls == calls  # scoring alone never reaches generation
    assert composed.structured_outputs is generation.structured_outputs
    assert composed.info.path == dense.info.path and composed.info.vocab_size == dense.info.vocab_size


async def _steps(stream):
    return [s async for s in stream]


def test_the_composed_config_gives_each_engine_its_options():
    config = composed_config(EngineConfig(model="m", options={"a": 1}), "vllm", "transformers", {"b": 2})
    assert config.options == {
        "generation_backend": "vllm",
        "dense_backend": "transformers",
        "generation_options": {"a": 1},
        "dense_options": {"b": 2},
    }


def test_engines_whose_vocabulary_sizes_differ_are_refused(loaded):
    tokenizer, path = loaded
    wider = MockEngine(tokenizer, vocab_size=len(tokenizer) + 64, max_model_len=2048, model_path=path)
    with pytest.raises(EngineMismatchError, match="vocabulary sizes differ: .* 49152 .* 49216"):
        ComposedEngine(mock(loaded), wider)


def test_engines_whose_tokenizers_differ_are_refused(loaded, model_dir, tmp_path):
    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    other = AutoTokenizer.from_pretrained(tmp_path)
    assert other is not loaded[0] and len(other) == len(loaded[0])
    same = AutoTokenizer.from_pretrained(model_dir)  # another object, the same tokenizer: accepted
    ComposedEngine(mock(loaded), MockEngine(same, vocab_size=len(same), max_model_len=2048, model_path="m"))
    eos = "'eos_token': '<|im_end|>' for the generation engine, '<|endoftext|>' for the dense engine"
    with pytest.raises(EngineMismatchError, match=f"special tokens differ at {eos}"):
        ComposedEngine(
            mock(loaded), MockEngine(other, vocab_size=len(other), max_model_len=2048, model_path="m")
        )


def test_new_weights_reach_both_engines_and_change_every_answer(engines, tmp_path):
    composed, generation, dense = engines
    before_rows, before_tokens = rows(composed), greedy(composed, [1, 2, 3])
    new = weights_dir(tmp_path / "new", "new")
    asyncio.run(composed.weights.load(str(new)))
    assert generation.info.path == dense.info.path == composed.info.path == str(new)
    assert not np.array_equal(rows(composed), before_rows)
    assert greedy(composed, [1, 2, 3]) != before_tokens
    np.testing.assert_array_equal(rows(generation), rows(dense))  # the same weights in both


def test_weights_the_dense_engine_refuses_change_nothing(engines, tmp_path):
    composed, generation, dense = engines
    before = rows(composed), rows(generation)
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError):
        asyncio.run(composed.weights.load(str(tmp_path / "empty")))
    np.testing.assert_array_equal(rows(composed), before[0])
    np.testing.assert_array_equal(rows(generation), before[1])


def refusing(engine, error: Exception):
    """The engine's weights refuse every load from now on."""

    async def load(path: str) -> None:
        raise error

    engine.weights.load = load


def test_weights_the_generation_engine_refuses_put_the_old_ones_back(engines, tmp_path):
    composed, generation, dense = engines
    old_path, old_rows = dense.info.path, rows(composed)
    refusing(generation, WeightsError("a tensor of another shape"))
    with pytest.raises(WeightsError, match="another shape"):
        asyncio.run(composed.weights.load(str(weights_dir(tmp_path / "new", "new"))))
    assert dense.info.path == composed.info.path == old_path
    np.testing.assert_array_equal(rows(composed), old_rows)
    assert composed.status().healthy


def test_engines_left_apart_serve_nothing_until_weights_load_into_both(engines, tmp_path):
    composed, generation, dense = engines
    old = dense.info.path
    real_load = dense.weights.load
    refusing(generation, RuntimeError("the engine core died"))

    async def only_new(path: str) -> None:  # the dense engine cannot load the old weights back
        if path == old:
            raise OSError("the old checkpoint is gone")
        await real_load(path)

    dense.weights.load = only_new
    with pytest.raises(EngineUnavailableError, match="hold different weights"):
        asyncio.run(composed.weights.load(str(weights_dir(tmp_path / "new", "new"))))
    assert not composed.status().healthy
    with pytest.raises(EngineUnavailableError):
        rows(composed)
    with pytest.raises(EngineUnavailableError):
        composed.generate([1], SamplingParams())
    del generation.weights.load  # loads again
    fixed = weights_dir(tmp_path / "fixed", "fixed")
    asyncio.run(composed.weights.load(str(fixed)))
    assert composed.status().healthy and composed.info.path == str(fixed)
    np.testing.assert_array_equal(rows(composed), rows(generation))


def test_a_cancelled_update_still_ends_with_both_engines_on_one_set_of_weights(loaded, tmp_path):
    generation, dense = mock(loaded, delay_s=0.2), mock(loaded, delay_s=0.2)
    composed = ComposedEngine(generation, dense)
    new = weights_dir(tmp_path / "new", "new")

    async def cancel_midway():
        update = asyncio.create_task(composed.weights.load(str(new)))
        await asyncio.sleep(0.3)  # the dense engine has loaded, the generation engine is loading
        update.cancel()
        with pytest.raises(asyncio.CancelledError):
            await update

    asyncio.run(cancel_midway())
    assert generation.info.path == dense.info.path == str(new)


def test_an_adapter_the_generation_engine_refuses_is_unloaded_from_the_dense_engine(engines):
    composed, generation, dense = engines
    asyncio.run(composed.adapters.load("a", "/adapters/a"))
    assert dense.adapters.loaded == generation.adapters.loaded == {"a": "/adapters/a"}
    np.testing.assert_array_equal(rows(composed, ("a", None)), rows(dense, ("a", None)))

    async def refuse(name: str, path: str) -> None:
        raise AdapterError(f"adapter {name!r} does not fit this model")

    generation.adapters.load = refuse
    with pytest.raises(AdapterError):
        asyncio.run(composed.adapters.load("b", "/adapters/b"))
    assert "b" not in dense.adapters.loaded
    asyncio.run(composed.adapters.unload("a"))
    assert dense.adapters.loaded == generation.adapters.loaded == {}


def test_host_memory_is_the_dense_engines_and_refuses_rows_while_the_engines_are_apart(loaded):
    generation, dense = mock(loaded), mock(loaded, host_memory=True)
    composed = ComposedEngine(generation, dense)
    assert ComposedEngine(mock(loaded), mock(loaded)).host_memory is None
    array = composed.host_memory.empty(2)
    assert composed.host_memory.register(array.ctypes.data, array.nbytes)
    asyncio.run(composed.host_memory.write_rows(PackedRows.of(ROWS), [None, None], [array], None))
    composed.host_memory.wait_landed(array)
    np.testing.assert_array_equal(array, rows(dense))
    composed.unusable = "its engines hold different weights"
    with pytest.raises(EngineUnavailableError):
        asyncio.run(composed.host_memory.write_rows(PackedRows.of(ROWS), [None, None], [array], None))
