"""Stop strings, text hold-back, choice merging and the sampling builder, on the mock engine
(gateway logic only)."""

from __future__ import annotations

import pytest

from backends.mock import MockEngine
from backends.types import EngineConfig, SamplingParams
from backends.vocab import decode_text, token_bytes_table
from gateway.errors import ContextLengthError, InvalidRequestError
from gateway.generation import choices as gen
from gateway.generation import sampling
from gateway.models.served import ServedModel
from gateway.settings import Limits, ModelSettings


@pytest.fixture(scope="module")
def served(model_dir) -> ServedModel:
    engine = MockEngine.load(EngineConfig(model=str(model_dir)))
    model = ServedModel(ModelSettings(model=str(model_dir), name="mock", backend="mock"))
    model.engine = engine
    model.token_bytes = token_bytes_table(engine.info.tokenizer, engine.info.vocab_size)
    model.special_ids = frozenset(engine.info.tokenizer.all_special_ids)
    return model


PROMPT = [504, 3575, 282, 4649, 314]
GREEDY = SamplingParams(max_tokens=40, temperature=0)


async def _pieces(served, stops, params=GREEDY):
    return [p async for p in gen.run_choice(served, PROMPT, params, stops)]


async def test_unstopped_text_is_the_decoded_tokens(served):
    pieces = await _pieces(served, [])
    ids = [s.token_id for p in pieces for s in p.steps]
    assert len(ids) == 40 and pieces[-1].finish_reason == "length"
    assert "".join(p.text for p in pieces) == decode_text(served.token_bytes, ids, served.special_ids)


async def test_stop_spanning_tokens_is_cut_and_never_leaked(served):
    full = "".join(p.text for p in await _pieces(served, []))
    ids = [s.token_id for p in await _pieces(served, []) for s in p.steps]
    # a stop string that starts inside one token's text and ends inside a later one
    boundaries = [len(decode_text(served.token_bytes, ids[:k], served.special_ids)) for k in range(len(ids))]
    start = next(b for b in boundaries if b > 10) - 1
    stop = full[start : start + 6]
    assert stop and full.index(stop) == start
    pieces = await _pieces(served, [stop, "never-appears-here"])
    emitted = ""
    for piece in pieces:
        emitted += piece.text
        assert stop not in emitted and len(emitted) <= start
    assert emitted == full[:start]
    assert pieces[-1].finish_reason == "stop"


async def test_max_tokens_zero_yields_one_empty_piece(served):
    pieces = await _pieces(served, [], SamplingParams(max_tokens=0))
    assert [(p.text, p.steps, p.finish_reason) for p in pieces] == [("", [], "length")]


async def test_merge_keeps_each_choice_in_order(served):
    streams = [
        gen.run_choice(served, PROMPT, sampling.choice_params(SamplingParams(max_tokens=6, seed=3), j), [])
        for j in range(3)
    ]
    texts = ["", "", ""]
    async for index, piece in gen.merge(streams):
        texts[index] += piece.text
    alone = [
        await gen.collect(
            gen.run_choice(
                served, PROMPT, sampling.choice_params(SamplingParams(max_tokens=6, seed=3), j), []
            )
        )
        for j in range(3)
    ]
    assert texts == [p.text for p in alone]
    assert len(set(texts)) == 3


def test_context_check(served):
    context = served.engine.info.max_model_len
    limits = Limits(max_tokens=context)
    assert sampling.check_context(served, 10, None, limits) == context - 10
    assert sampling.check_context(served, 10, None, Limits(max_tokens=100)) == 100
    assert sampling.check_context(served, context, 0, limits) == 0
    with pytest.raises(ContextLengthError):
        sampling.check_context(served, context - 1, 2, limits)
    with pytest.raises(ContextLengthError):
        sampling.check_context(served, context, None, limits)
    with pytest.raises(InvalidRequestError, match="at most 100"):
        sampling.check_context(served, 10, 101, Limits(max_tokens=100))


def test_sampling_params_defaults_and_checks(served):
    limits = Limits(max_top_logprobs=5)
    params = sampling.sampling_params(served, limits, max_tokens=7)
    assert params == SamplingParams(max_tokens=7, temperature=1.0, top_p=1.0)
    params = sampling.sampling_params(
        served,
        limits,
        max_tokens=3,
        temperature=0.5,
        top_p=0.9,
        seed=-1,
        top_logprobs=5,
        presence_penalty=0.25,
        frequency_penalty=-0.5,
        logit_bias={"7": 2.5},
    )
    expected = SamplingParams(
        max_tokens=3,
        temperature=0.5,
        top_p=0.9,
        seed=2**64 - 1,  # the unsigned 64-bit seed it wraps to
        top_logprobs=5,
        presence_penalty=0.25,
        frequency_penalty=-0.5,
        logit_bias={7: 2.5},
    )
    assert params == expected
    # each API's name for the alternatives per token, in the message and the param
    for field in ("top_logprobs", "logprobs", "top_logprobs_num"):
        with pytest.raises(InvalidRequestError, match=f"^{field} must be at most 5$") as raised:
            sampling.sampling_params(served, limits, max_tokens=1, top_logprobs=6, top_logprobs_field=field)
        assert raised.value.param == field
    with pytest.raises(InvalidRequestError, match="is not a token id") as raised:
        sampling.sampling_params(
            served, limits, max_tokens=1, logit_bias={str(served.engine.info.vocab_size): 1}
        )
    assert raised.value.param == "logit_bias"
