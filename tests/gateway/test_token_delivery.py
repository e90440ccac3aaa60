"""What each API asks of the engine per token (`SamplingParams.logprobs`, `stream_interval`): logprobs
only where the answer reports them, tokens in bursts only where the answer is sent whole and no stop
string or stop token can end the choice early. Driven through HTTP on the mock engine, whose
`generate` records the parameters it gets."""

from __future__ import annotations

import pytest

from backends.mock import MockEngine
from gateway.generation.sampling import WHOLE_RESPONSE_INTERVAL
from tests.conftest import mock_app_client

BURST = WHOLE_RESPONSE_INTERVAL


@pytest.fixture(scope="module")
def client():
    with mock_app_client() as (_, client):
        yield client


@pytest.fixture
def asked(monkeypatch):
    """The (logprobs, stream_interval) of each generation the engine runs during one test."""
    seen = []
    generate = MockEngine.generate

    def recording(self, ids, params, adapter=None):
        seen.append((params.logprobs, params.stream_interval))
        return generate(self, ids, params, adapter)

    monkeypatch.setattr(MockEngine, "generate", recording)
    return seen


def _post(client, path, body):
    response = client.post(path, json={"max_tokens": 3, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response


@pytest.mark.parametrize(
    "body, want",
    [
        ({}, (False, BURST)),
        ({"logprobs": 0}, (True, BURST)),  # the chosen token's logprob
        ({"stream": True}, (False, 1)),
        ({"stop": ["zz"]}, (False, 1)),
        ({"logprobs": 2, "stream": True}, (True, 1)),
    ],
)
def test_completions(client, asked, body, want):
    _post(client, "/v1/completions", {"model": "mock", "prompt": [1, 2], **body})
    assert asked == [want]


@pytest.mark.parametrize(
    "body, want",
    [
        ({}, (False, BURST)),
        ({"logprobs": False}, (False, BURST)),
        ({"logprobs": True, "top_logprobs": 1}, (True, BURST)),
        ({"stream": True}, (False, 1)),
        ({"stop": "zz"}, (False, 1)),
    ],
)
def test_chat(client, asked, body, want):
    messages = [{"role": "user", "content": "hi"}]
    _post(client, "/v1/chat/completions", {"model": "mock", "messages": messages, **body})
    assert asked == [want]


@pytest.mark.parametrize(
    "body, sampling, want",
    [
        ({}, {}, (False, BURST)),
        ({"return_logprob": True}, {}, (True, BURST)),
        ({"stream": True}, {}, (False, 1)),
        ({}, {"stop": "zz"}, (False, 1)),
        ({}, {"stop_token_ids": [3]}, (False, 1)),
    ],
)
def test_sglang_generate(client, asked, body, sampling, want):
    sampling = {"max_new_tokens": 3, "temperature": 0, **sampling}
    response = client.post(
        "/generate", json={"model": "mock", "input_ids": [1, 2], "sampling_params": sampling, **body}
    )
    assert response.status_code == 200, response.text
    assert asked == [want]
