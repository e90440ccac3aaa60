"""A chat stream refused for want of a stream slot costs nothing: the 429 comes before its
template, its grammar's compile and its metrics (mock engine: gateway-layer rules)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import httpx
import pytest

from bench.launcher import start_mock_gateway

CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    gateway = start_mock_gateway(tmp_path_factory.mktemp("admission"), "[limits]\nmax_streams = 1\n", 0.2)
    yield gateway
    gateway.stop()


def _prompt_tokens(http: httpx.Client, model: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("logprob_gateway_prompt_tokens_total{"):
            if f'model="{model}"' in line and 'endpoint="chat"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


@contextlib.contextmanager
def _slot_held(http: httpx.Client, path: str, body: dict) -> Iterator[None]:
    """The server's one stream slot, held by a slow stream until the block ends."""
    holding, release = threading.Event(), threading.Event()

    def hold_the_slot() -> None:
        with http.stream("POST", path, json=body) as answer:
            assert answer.status_code == 200
            for _ in answer.iter_lines():
                holding.set()
                if release.is_set():
                    break

    holder = threading.Thread(target=hold_the_slot)
    holder.start()
    try:
        assert holding.wait(30)
        yield
    finally:
        release.set()
        holder.join(60)


# a grammar that would be a 400 once compiled: the missing slot answers first
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}


def test_a_refused_stream_compiles_nothing_and_counts_nothing(one_slot):
    slow = {"model": "slow", "messages": ASK, "max_tokens": 200, "stream": True}
    with httpx.Client(base_url=one_slot.base_url, timeout=60) as http:
        with _slot_held(http, CHAT, slow):
            before = _prompt_tokens(http, "mock")
            refused = http.post(
                CHAT, json={"model": "mock", "messages": ASK, "max_tokens": 4, "stream": True}
            )
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["type"]
            body = {"model": "mock", "messages": ASK, "stream": True, "response_format": BAD_SCHEMA}
            assert http.post(CHAT, json=body).status_code == 429
            assert _prompt_tokens(http, "mock") == before
        admitted = http.post(CHAT, json={"model": "mock", "messages": ASK, "max_tokens": 2})
        assert admitted.status_code == 200
        assert _prompt_tokens(http, "mock") == before + admitted.json()["usage"]["prompt_tokens"]


def test_a_refused_completion_stream_compiles_nothing(one_slot):
    slow = {"model": "slow", "prompt": "Hello", "max_tokens": 200, "stream": True}
    with httpx.Client(base_url=one_slot.base_url, timeout=60) as http:
        with _slot_held(http, "/v1/completions", slow):
            body = {"model": "mock", "prompt": "Hi", "stream": True, "response_format": BAD_SCHEMA}
            refused = http.post("/v1/completions", json=body)
            assert refused.status_code == 429, refused.text
