"""vLLM's and SGLang's sampling fields on the real model: each honoured or refused with a 400 naming
it, never silently ignored (docs/api.md, "Sampling fields")."""

from __future__ import annotations

import pytest

from tests.conftest import MODEL

COMPLETIONS, CHAT, GENERATE = "/v1/completions", "/v1/chat/completions", "/generate"
# field -> a value that would change the output, which the gateway does not do
CHANGING = {
    "top_k": 5,
    "min_p": 0.5,
    "repetition_penalty": 5.0,
    "min_tokens": 3,
    "ignore_eos": True,
    "stop_token_ids": [504],
    "bad_words": [" Paris"],
    "allowed_token_ids": [504],
    "truncate_prompt_tokens": 3,
    "prompt_logprobs": 1,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "include_stop_str_in_output": True,
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


def body(path: str, **fields) -> dict:
    if path == CHAT:
        return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
    return {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, **fields}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("field", sorted(CHANGING))
def test_a_field_that_would_change_the_output_is_refused_by_name(http, path, field):
    answer = http.post(path, json=body(path, **{field: CHANGING[field]}))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field


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


def test_generate_refuses_spaces_between_special_tokens_false(http):
    answer = http.post(
        GENERATE, json={"text": "Hi", "sampling_params": {"spaces_between_special_tokens": False}}
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "sampling_params.spaces_between_special_tokens"
