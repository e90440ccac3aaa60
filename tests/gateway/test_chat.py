"""/v1/chat/completions on the real model through the official openai SDK."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import MODEL

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _template_ids(reference, messages):
    text = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return reference.tokenizer(text, add_special_tokens=False).input_ids


def test_greedy_chat_matches_direct_generation(client, reference):
    ids = _template_ids(reference, MESSAGES)
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = out.choices[0]
    generated = reference.greedy(ids, 12)
    eos = reference.tokenizer.convert_tokens_to_ids("<|im_end|>")
    if eos in generated:  # the gateway stops at the end-of-turn token and does not show it
        generated = generated[: generated.index(eos) + 1]
    assert choice.message.role == "assistant"
    assert choice.message.content == reference.tokenizer.decode(generated, skip_special_tokens=True)
    assert "Paris" in choice.message.content
    assert choice.finish_reason == ("stop" if generated[-1] == eos else "length")
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(generated)
    rows = reference.logprobs(ids + generated)
    content = choice.logprobs.content
    want = [rows[len(ids) - 1 + i, t] for i, t in enumerate(generated)]
    assert np.max(np.abs(np.array([c.logprob for c in content]) - want)) <= 1e-4
    for i, entry in enumerate(content):
        assert (
            bytes(entry.bytes) == reference.tokenizer.decode([generated[i]]).encode() or generated[i] == eos
        )
        best = int(np.argmax(rows[len(ids) - 1 + i]))
        assert entry.top_logprobs[0].token == reference.tokenizer.decode([best])
        assert abs(entry.top_logprobs[0].logprob - rows[len(ids) - 1 + i, best]) <= 1e-4


def test_system_message_and_content_parts_follow_the_template(client, reference):
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Capital of "}, {"type": "text", "text": "Italy?"}],
        },
    ]
    flat = [messages[0], {"role": "user", "content": "Capital of Italy?"}]
    ids = _template_ids(reference, flat)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    assert out.usage.prompt_tokens == len(ids)
    generated = reference.greedy(ids, 5)
    assert out.choices[0].message.content == reference.tokenizer.decode(generated, skip_special_tokens=True)


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_chat_stop_and_seeded_sampling(client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    text = whole.choices[0].message.content
    cut = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stop=["Paris"]
    )
    assert cut.choices[0].message.content == text[: text.index("Paris")]
    assert cut.choices[0].finish_reason == "stop"
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.2, seed=7, n=2)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
