"""The event loop never waits on a large text: while the real server tokenizes (or templates) the
longest text its limits allow, /health still answers within 100 ms; a text over the limit is
refused with a 400 that names the limit, before anything tokenizes it."""

from __future__ import annotations

import random
import string
from collections.abc import Callable

import httpx
import pytest

from gateway.prompts import DEFAULT_CHARS_PER_TOKEN
from tests.conftest import MODEL
from tests.gateway.health_probe import health_latencies_during

pytestmark = pytest.mark.slow

HEALTH_BOUND_S = 0.1


def _text(chars: int) -> str:
    """Prose-like text of exactly `chars` characters: many distinct words, so the tokenizer's word
    cache does not shortcut the work as it would for a repeated phrase."""
    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(20_000)]
    text = " ".join(rng.choices(words, k=chars // 5 + 1))
    return text[:chars]


def _cjk(chars: int) -> str:
    """The most tokens per character: rare CJK ideographs, a token per UTF-8 byte or close to it."""
    rng = random.Random(0)
    return "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(chars))


@pytest.fixture(scope="module")
def text_limit(http: httpx.Client) -> int:
    """The default per-text limit, from the context the server publishes."""
    context = http.post("/v1/tokenize", json={"model": MODEL, "prompt": "x"}).json()["max_model_len"]
    return context * DEFAULT_CHARS_PER_TOKEN


def _worst_health_latency(
    base_url: str, request: Callable[[], httpx.Response]
) -> tuple[float, httpx.Response]:
    """The slowest /health answer while `request` runs."""
    during, response = health_latencies_during(base_url, request)
    return max(during), response


def _bodies(text: str) -> dict[str, dict]:
    return {
        "/v1/tokenize": {"model": MODEL, "prompt": text},
        "/v1/completions": {"model": MODEL, "prompt": text, "max_tokens": 1},
        "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": text}]},
        "/generate": {"model": MODEL, "text": text, "sampling_params": {"max_new_tokens": 1}},
        "/v1/next_token_logprobs": {"model": MODEL, "input": text},
    }


@pytest.mark.parametrize("path", list(_bodies("")))
def test_health_answers_while_the_longest_allowed_text_is_tokenized(
    gateway, http: httpx.Client, text_limit: int, path: str
) -> None:
    body = _bodies(_text(text_limit))[path]
    worst, response = _worst_health_latency(gateway.base_url, lambda: http.post(path, json=body))
    if path == "/v1/tokenize":
        assert response.status_code == 200, response.text[:200]
        assert response.json()["count"] > 0
    else:  # tokenized, then more tokens than the context holds
        assert response.status_code == 400, response.text[:200]
        assert response.json()["error"]["code"] == "context_length_exceeded"
    assert worst < HEALTH_BOUND_S, f"/health waited {worst * 1000:.0f} ms while {path} tokenized"


@pytest.mark.parametrize("path", list(_bodies("")))
def test_a_text_over_the_limit_is_refused_before_tokenizing(
    gateway, http: httpx.Client, text_limit: int, path: str
) -> None:
    # ASCII, so the body decodes quickly: what is measured is the tokenizing that does not happen
    body = _bodies("a" * max(text_limit + 1, 3 * 2**20))[path]  # within max_non_dense_body_bytes
    worst, response = _worst_health_latency(gateway.base_url, lambda: http.post(path, json=body))
    assert response.status_code == 400, response.text[:200]
    error = response.json()["error"]
    assert error["code"] == "string_above_max_length"
    assert f"at most {text_limit} are allowed" in error["message"]
    assert worst < HEALTH_BOUND_S, f"/health waited {worst * 1000:.0f} ms while {path} was refused"


def test_a_text_at_the_limit_is_not_refused_for_its_length(http: httpx.Client, text_limit: int) -> None:
    response = http.post("/v1/tokenize", json={"model": MODEL, "prompt": "é" * text_limit})
    assert response.status_code == 200, response.text[:200]


def test_health_answers_while_the_text_with_the_most_tokens_is_tokenized(
    gateway, http: httpx.Client, text_limit: int
) -> None:
    body = {"model": MODEL, "prompt": _cjk(text_limit)}
    worst, response = _worst_health_latency(gateway.base_url, lambda: http.post("/v1/tokenize", json=body))
    assert response.status_code == 200, response.text[:200]
    assert response.json()["count"] > 2 * text_limit
    assert worst < HEALTH_BOUND_S, f"/health waited {worst * 1000:.0f} ms while /v1/tokenize tokenized"
