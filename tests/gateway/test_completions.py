"""/v1/completions on the real model through the official openai SDK, checked against a direct
transformers forward pass of the same weights."""

from __future__ import annotations

import asyncio

import numpy as np
import openai
import pytest

from tests.conftest import MODEL

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
TOL = 1e-4


def test_greedy_text_and_logprobs_match_direct_forward(client, reference):
    ids = reference.tokenizer(PROMPT).input_ids
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    choice = out.choices[0]
    expected_ids = reference.greedy(ids, 6)
    assert choice.text == reference.tokenizer.decode(expected_ids)
    assert choice.text.startswith(" Paris")
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 6
    rows = reference.logprobs(ids + expected_ids)
    want = [rows[len(ids) - 1 + i, t] for i, t in enumerate(expected_ids)]
    assert np.max(np.abs(np.array(choice.logprobs.token_logprobs) - want)) <= TOL
    for i, top in enumerate(choice.logprobs.top_logprobs):
        row = rows[len(ids) - 1 + i]
        best = np.argsort(-row)[:3]
        expected = {reference.tokenizer.decode([int(t)]): float(row[t]) for t in best}
        for token, value in expected.items():
            assert abs(top[token] - value) <= TOL
    # text offsets index the prompt + completion text
    offsets = choice.logprobs.text_offset
    full = PROMPT + choice.text
    assert offsets[0] == len(PROMPT)
    for token, offset in zip(choice.logprobs.tokens, offsets, strict=True):
        assert full[offset : offset + len(token)] == token


def test_echo_max_tokens_zero_scores_the_prompt(client, reference):
    """The log-likelihood recipe of evaluation harnesses: echo + logprobs + max_tokens=0."""
    text = "Paris is the capital and largest city of France."
    ids = reference.tokenizer(text).input_ids
    out = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=0)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == text
    assert lp.tokens == [reference.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    rows = reference.logprobs(ids)
    want = rows[np.arange(len(ids) - 1), ids[1:]]
    assert np.max(np.abs(np.array(lp.token_logprobs[1:]) - want)) <= TOL
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == text
    assert out.usage.completion_tokens == 0


def test_echo_with_generation_and_top_alternatives(client, reference):
    ids = reference.tokenizer(PROMPT).input_ids
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, logprobs=2, temperature=0
    )
    choice = out.choices[0]
    generated = reference.greedy(ids, 3)
    assert choice.text == PROMPT + reference.tokenizer.decode(generated)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3
    rows = reference.logprobs(ids + generated)
    all_ids = ids + generated
    want = rows[np.arange(len(all_ids) - 1), all_ids[1:]]
    assert np.max(np.abs(np.array(lp.token_logprobs[1:]) - want)) <= TOL
    for position in range(1, len(all_ids)):
        best = int(np.argmax(rows[position - 1]))
        assert (
            abs(lp.top_logprobs[position][reference.tokenizer.decode([best])] - rows[position - 1, best])
            <= TOL
        )


def test_token_id_prompts_equal_string_prompts(client, reference):
    ids = reference.tokenizer(PROMPT).input_ids
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_several_prompts_and_n_are_ordered_prompt_major(client, reference):
    prompts = ["The capital of France is", "One, two, three,"]
    out = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=3, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for k, prompt in enumerate(prompts):
        ids = reference.tokenizer(prompt).input_ids
        expected = reference.tokenizer.decode(reference.greedy(ids, 3))
        assert out.choices[2 * k].text == out.choices[2 * k + 1].text == expected
    assert out.usage.prompt_tokens == sum(len(reference.tokenizer(p).input_ids) for p in prompts)
    assert out.usage.completion_tokens == 12


def test_seed_makes_sampling_reproducible_and_choices_differ(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=3, seed=1234)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1
    other = client.completions.create(**{**kwargs, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in first.choices]


def test_stop_string_cuts_text_and_reports_stop(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    assert "." in base
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=["."])
    assert out.choices[0].text == base[: base.index(".")]
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=["."], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == base[: base.index(".")]


def test_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=1)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1
    assert "".join(c.choices[0].text for c in text_chunks) == whole.text
    tokens = [t for c in text_chunks for t in c.choices[0].logprobs.tokens]
    values = [v for c in text_chunks for v in c.choices[0].logprobs.token_logprobs]
    assert tokens == whole.logprobs.tokens
    assert np.allclose(values, whole.logprobs.token_logprobs, atol=TOL)
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_streaming_echo_sends_the_prompt_first(client):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text == PROMPT
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_async_client_concurrent_requests_match_sequential(async_client, client):
    prompts = ["The capital of France is", "My favourite food is", "def fibonacci(n):", "1, 2, 3, 4,"]
    sequential = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).choices[0].text
        for p in prompts
    ]

    async def run():
        results = await asyncio.gather(
            *(
                async_client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
                for p in prompts
            )
        )
        stream = await async_client.completions.create(
            model=MODEL, prompt=prompts[0], max_tokens=5, temperature=0, stream=True
        )
        streamed = "".join([c.choices[0].text async for c in stream if c.choices])
        return [r.choices[0].text for r in results], streamed

    concurrent, streamed = asyncio.run(run())
    assert concurrent == sequential
    assert streamed == sequential[0]


def test_concurrent_streams_decode_together_each_as_if_alone(gateway, client):
    """Eight streams at once (the engine decodes them in shared passes), two of them streamed and
    one more dropped mid-way: every text and token logprob as when the request ran alone."""
    prompts = [
        f"Tell me about {topic}:"
        for topic in ("cats", "rain", "Paris", "tea", "chess", "ice", "bees", "jazz")
    ]
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0, logprobs=2).choices[0]
        for p in prompts
    ]

    # A client of this test's own event loop: connections do not outlive the loop that opened them.
    async_client = openai.AsyncOpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0)

    async def whole(prompt: str):
        answer = await async_client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=2
        )
        return answer.choices[0].text, answer.choices[0].logprobs.token_logprobs

    async def streamed(prompt: str, keep: int | None = None):
        stream = await async_client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=2, stream=True
        )
        text, logprobs = "", []
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                logprobs += chunk.choices[0].logprobs.token_logprobs
                if keep is not None and len(logprobs) >= keep:
                    await stream.close()  # the client leaves: its stream leaves the batch
                    break
        return text, logprobs

    async def run():
        async with async_client:
            return await asyncio.gather(
                *(whole(p) for p in prompts[:6]),
                *(streamed(p) for p in prompts[6:]),
                streamed(prompts[0], keep=3),
            )

    results = asyncio.run(run())
    for (text, logprobs), single in zip(results[:8], alone, strict=True):
        assert text == single.text
        np.testing.assert_allclose(logprobs, single.logprobs.token_logprobs, rtol=0, atol=1e-4)
    dropped_logprobs = results[8][1]
    np.testing.assert_allclose(dropped_logprobs[:3], alone[0].logprobs.token_logprobs[:3], rtol=0, atol=1e-4)


def test_logit_bias_forces_a_token(client, reference):
    forced = reference.tokenizer(" banana").input_ids[0]
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(forced): 100}
    )
    assert out.choices[0].text == reference.tokenizer.decode([forced] * 3)


def test_models_endpoints(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.owned_by == "logprob-gateway"
    assert card.model_extra["vocab_size"] == 49152 and card.model_extra["max_model_len"] == 8192


def test_health_reports_the_model_ready(http):
    response = http.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "models": [{"name": MODEL, "ready": True, "error": None}]}
