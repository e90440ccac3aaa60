"""vLLM's and SGLang's sampling fields on the real model: each honoured, as transformers'
`generate` makes of it, or refused with a 400 naming it; never silently ignored (docs/api.md,
"Sampling fields")."""

from __future__ import annotations

import math

import pytest

from tests.conftest import MODEL

COMPLETIONS, CHAT, GENERATE = "/v1/completions", "/v1/chat/completions", "/generate"
PROMPT = "The capital of France is"
# field -> a value that would change the output, which the gateway does not do
REFUSED = {
    "prompt_logprobs": 1,
    "spaces_between_special_tokens": False,
    "use_beam_search": True,
    "best_of": 2,
    "length_penalty": 0.5,
}
# field -> values that change nothing, accepted
NEUTRAL = {
    "top_k": [-1, 0],
    "min_p": [0.0],
    "repetition_penalty": [1.0],
    "min_tokens": [0],
    "ignore_eos": [False],
    "stop_token_ids": [[]],
    "bad_words": [[]],
    "skip_special_tokens": [True],
    "spaces_between_special_tokens": [True],
    "include_stop_str_in_output": [False],
    "use_beam_search": [False],
    "best_of": [1],
    "length_penalty": [1.0],
}
# field -> a value out of its range
INVALID = {
    "top_k": -2,
    "min_p": 1.5,
    "repetition_penalty": 0.0,
    "stop_token_ids": [10**6],
    "allowed_token_ids": [],
    "bad_words": [""],
    "truncate_prompt_tokens": 0,
    "min_tokens": -1,
}


def body(path: str, **fields) -> dict:
    if path == CHAT:
        return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}


def generated_ids(http, ids: list[int], max_new_tokens: int, **sampling) -> dict:
    answer = http.post(
        GENERATE,
        json={
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **sampling},
        },
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("field", sorted(REFUSED))
def test_a_field_not_honoured_is_refused_by_name(http, path, field):
    answer = http.post(path, json=body(path, **{field: REFUSED[field]}))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("field", sorted(INVALID))
def test_a_value_out_of_range_is_refused_by_name(http, path, field):
    answer = http.post(path, json=body(path, **{field: INVALID[field]}))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"].split("[")[0] == field  # or the item, `bad_words[0]`


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_values_that_change_nothing_are_accepted_and_change_nothing(http, path):
    plain = http.post(path, json=body(path, temperature=0)).json()["choices"][0]
    for field, values in NEUTRAL.items():
        for value in values:
            answer = http.post(path, json=body(path, temperature=0, **{field: value}))
            assert answer.status_code == 200, (field, value, answer.text)
            assert answer.json()["choices"][0] == plain, (field, value)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_top_k_1_is_greedy_whatever_the_temperature(http, path):
    greedy = http.post(path, json=body(path, temperature=0, max_tokens=12)).json()["choices"][0]
    for seed in (1, 2, 3):
        sampled = http.post(path, json=body(path, temperature=1.5, seed=seed, top_k=1, max_tokens=12))
        assert sampled.json()["choices"][0] == greedy


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        ({"repetition_penalty": 5.0}, {"repetition_penalty": 5.0}),
        ({"repetition_penalty": 0.5}, {"repetition_penalty": 0.5}),
        ({"bad_words": [" Paris"]}, "bad_words"),
        ({"allowed_token_ids": [28, 30, 198, 314, 1345]}, "allowed"),
    ],
)
def test_a_greedy_control_is_what_transformers_generate_makes_of_it(http, reference, ours, theirs):
    ids = reference.tokenizer(PROMPT)["input_ids"]
    if theirs == "bad_words":
        barred = reference.tokenizer(" Paris", add_special_tokens=False)["input_ids"]
        theirs = {"bad_words_ids": [barred]}
    elif theirs == "allowed":
        allowed = ours["allowed_token_ids"]
        theirs = {"prefix_allowed_tokens_fn": lambda _batch, _ids: allowed}
    expected = reference.generate(ids, 12, eos_token_id=None, **theirs)
    assert expected != reference.generate(ids, 12, eos_token_id=None)  # the control matters
    completion = http.post(
        COMPLETIONS,
        json={"model": MODEL, "prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **ours},
    ).json()["choices"][0]
    assert completion["text"] == reference.tokenizer.decode(expected)


def chat_ids(reference, content: str) -> list[int]:
    messages = [{"role": "user", "content": content}]
    text = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return reference.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_min_tokens_and_ignore_eos_hold_end_of_sequence_back(http, reference):
    ids = list(chat_ids(reference, "Hi"))
    eos = reference.tokenizer.convert_tokens_to_ids("<|im_end|>")
    plain = reference.generate(ids, 64, eos_token_id=eos)
    assert plain[-1] == eos and len(plain) < 60  # the model ends its turn on its own
    held = reference.generate(ids, 64, eos_token_id=eos, min_new_tokens=len(plain) + 4)
    out = generated_ids(http, ids, 64, min_new_tokens=len(plain) + 4)
    assert out["output_ids"] == held and len(held) > len(plain)
    ignored = generated_ids(http, ids, len(plain) + 6, ignore_eos=True)
    assert ignored["meta_info"]["finish_reason"]["type"] == "length"
    assert ignored["output_ids"] == reference.greedy(ids, len(plain) + 6)
    assert eos in ignored["output_ids"]
    # OpenAI's routes: the same tokens; with skip_special_tokens false the end-of-turn shows
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0}
    answer = http.post(CHAT, json={**chat, "max_tokens": len(plain) + 6, "ignore_eos": True}).json()
    assert answer["usage"]["completion_tokens"] == len(plain) + 6
    assert answer["choices"][0]["finish_reason"] == "length"
    shown = http.post(
        CHAT,
        json={**chat, "max_tokens": len(plain) + 6, "ignore_eos": True, "skip_special_tokens": False},
    ).json()["choices"][0]["message"]["content"]
    assert "<|im_end|>" in shown
    assert (
        shown.replace("<|im_end|>", "").replace("<|im_start|>", "")
        == answer["choices"][0]["message"]["content"]
    )
    min_chat = http.post(CHAT, json={**chat, "max_tokens": 64, "min_tokens": len(plain) + 4}).json()
    assert min_chat["usage"]["completion_tokens"] == len(held)


def test_stop_token_ids_end_the_text_before_the_token_as_vllm(http, reference):
    ids = reference.tokenizer(PROMPT)["input_ids"]
    expected = reference.greedy(ids, 8)
    stop = expected[3]
    first = expected.index(stop)
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop_token_ids": [stop]}
    answer = http.post(COMPLETIONS, json={**request, "logprobs": 0}).json()["choices"][0]
    assert answer["finish_reason"] == "stop"
    assert len(answer["logprobs"]["tokens"]) == first + 1  # the stop token is generated
    text_before = reference.tokenizer.decode(expected[:first])
    assert answer["text"] == text_before
    kept = http.post(COMPLETIONS, json={**request, "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == reference.tokenizer.decode(expected[: first + 1])


def test_include_stop_str_in_output_keeps_the_stop_string(http):
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    whole = http.post(COMPLETIONS, json=request).json()["choices"][0]["text"]
    stop = whole[3:6]
    cut = http.post(COMPLETIONS, json={**request, "stop": [stop]}).json()["choices"][0]
    kept = http.post(COMPLETIONS, json={**request, "stop": [stop], "include_stop_str_in_output": True})
    assert kept.json()["choices"][0]["text"] == cut["text"] + stop
    assert cut["text"] == whole[: whole.index(stop)]


def test_top_k_and_min_p_sample_only_what_they_keep(http):
    """At temperature 1 every sampled token is among the row's k most likely (reported, raw), and
    at least min_p of the most likely one's probability."""
    for seed in range(4):
        k = http.post(
            COMPLETIONS,
            json=body(COMPLETIONS, temperature=1.0, seed=seed, top_k=3, logprobs=3, max_tokens=16),
        ).json()["choices"][0]["logprobs"]
        for token, top in zip(k["tokens"], k["top_logprobs"], strict=True):
            assert token in sorted(top, key=top.get, reverse=True)[:3]
        p = http.post(
            COMPLETIONS,
            json=body(COMPLETIONS, temperature=1.0, seed=seed, min_p=0.2, logprobs=1, max_tokens=16),
        ).json()["choices"][0]["logprobs"]
        for chosen, top in zip(p["token_logprobs"], p["top_logprobs"], strict=True):
            assert chosen >= max(top.values()) + math.log(0.2) - 1e-4


def test_sampled_with_controls_differs_from_without(http):
    """The controls change what is sampled with a seed: not a no-op on the sampling path."""
    plain = http.post(COMPLETIONS, json=body(COMPLETIONS, temperature=1.0, seed=7, max_tokens=24)).json()
    narrowed = http.post(
        COMPLETIONS, json=body(COMPLETIONS, temperature=1.0, seed=7, max_tokens=24, top_k=2, min_p=0.1)
    ).json()
    assert narrowed["choices"][0]["text"] != plain["choices"][0]["text"]


def test_allowed_token_ids_hold_sampling_to_them(http, reference):
    allowed = [28, 30, 198, 314, 1345]
    answer = http.post(
        COMPLETIONS,
        json=body(COMPLETIONS, temperature=1.2, seed=3, max_tokens=16, allowed_token_ids=allowed, logprobs=0),
    ).json()["choices"][0]
    assert len(answer["logprobs"]["tokens"]) == 16
    shown = {reference.tokenizer.decode([i]) for i in allowed}
    assert set(answer["logprobs"]["tokens"]) <= shown, answer["logprobs"]["tokens"]


def test_truncate_prompt_tokens_keeps_the_last_tokens(http, reference):
    ids = reference.tokenizer(PROMPT)["input_ids"]
    cut = http.post(
        COMPLETIONS, json=body(COMPLETIONS, temperature=0, truncate_prompt_tokens=3, max_tokens=6)
    )
    alone = http.post(COMPLETIONS, json=body(COMPLETIONS, temperature=0, max_tokens=6, prompt=ids[-3:]))
    assert cut.json()["usage"]["prompt_tokens"] == 3
    assert cut.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    whole = http.post(COMPLETIONS, json=body(COMPLETIONS, temperature=0, truncate_prompt_tokens=-1))
    assert whole.json()["usage"]["prompt_tokens"] == len(ids)


def test_generate_honours_sglang_controls(http, reference):
    ids = reference.tokenizer(PROMPT)["input_ids"]
    penalised = generated_ids(http, ids, 10, repetition_penalty=1.8, ignore_eos=True, top_k=5, min_p=0.05)
    expected = reference.generate(ids, 10, eos_token_id=None, repetition_penalty=1.8)
    assert penalised["output_ids"] == expected


def test_generate_refuses_spaces_between_special_tokens_false(http):
    answer = http.post(
        GENERATE, json={"text": "Hi", "sampling_params": {"spaces_between_special_tokens": False}}
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "sampling_params.spaces_between_special_tokens"
