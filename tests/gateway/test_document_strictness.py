"""The OpenAPI document can be fuzzed as a client sees it, and refuses what the server refuses.

schemathesis must be able to generate requests, valid and invalid, for every operation of the
document as it is committed and as a server serves it: an operation it cannot generate for is
never fuzzed. And what the document allows the server serves, what the server refuses the document
forbids: checked here for the inputs the document once let through (a non-null `image_data` on
/generate, packed ids that are not base64 of int32 ids).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from gateway.app import ROUTE_HANDLERS
from gateway.contract.document import build_openapi
from gateway.settings import Limits, Settings
from tests.conftest import mock_app_client

SMOLLM2_VOCAB = 49152


def _documents() -> dict[str, dict[str, Any]]:
    return {
        "committed": json.loads((Path(__file__).parents[2] / "openapi" / "openapi.json").read_text()),
        "served": build_openapi(ROUTE_HANDLERS, vocab_size=SMOLLM2_VOCAB),
        "wide limits": build_openapi(
            ROUTE_HANDLERS, Settings(limits=Limits(max_n=128)), vocab_size=SMOLLM2_VOCAB
        ),
    }


def _draws(operation: Any, mode: GenerationMode) -> int:
    """How many cases schemathesis generates for `operation` in `mode` (raises when it cannot)."""
    drawn = 0

    @given(operation.as_strategy(generation_mode=mode))
    @settings(max_examples=5, phases=[Phase.generate], suppress_health_check=list(HealthCheck), database=None)
    def draw(case: Any) -> None:
        nonlocal drawn
        drawn += 1

    draw()
    return drawn


@pytest.mark.parametrize("name", ["committed", "served", "wide limits"])
def test_schemathesis_generates_requests_for_every_operation(name):
    document = _documents()[name]
    failures = []
    for result in schemathesis.openapi.from_dict(document).get_all_operations():
        operation = result.ok()
        modes = [GenerationMode.POSITIVE]
        if operation.body:  # a free-form path parameter has no invalid value
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            try:
                assert _draws(operation, mode) > 0
            except Exception as error:  # noqa: BLE001 — every operation's failure is reported at once
                failures.append(f"{operation.label} ({mode.value}): {str(error).splitlines()[0]}")
    assert failures == []


def _request_schema(document: dict[str, Any], path: str) -> jsonschema.Validator:
    body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**body, "components": document["components"]})


def _packed(ids: list[int]) -> str:
    return base64.b64encode(b"".join(i.to_bytes(4, "little") for i in ids)).decode()


REFUSED = [
    ("/generate", {"text": "a", "image_data": 0}),
    ("/generate", {"text": "a", "image_data": []}),
    ("/v1/next_token_logprobs", {"model": "mock", "input": {"ids": "not base64!", "lengths": [1]}}),
    ("/v1/next_token_logprobs", {"model": "mock", "input": {"ids": "AAAAAA", "lengths": [1]}}),  # unpadded
    ("/v1/next_token_logprobs", {"model": "mock", "input": {"ids": "AAAA", "lengths": [1]}}),  # 3 bytes
    ("/v1/next_token_logprobs", {"model": "mock", "input": {"ids": "", "lengths": [1]}}),
    (
        "/v1/responses",
        {"model": "mock", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
    ),
    ("/v1/responses", {"model": "mock", "input": [{"role": "user"}]}),
    ("/v1/responses", {"model": "mock", "input": [{"type": "function_call_output", "call_id": "c"}]}),
]
SERVED = [
    ("/generate", {"text": "a", "image_data": None, "sampling_params": {"max_new_tokens": 1}}),
    ("/v1/next_token_logprobs", {"model": "mock", "input": {"ids": _packed([1]), "lengths": [1]}}),
    ("/v1/next_token_logprobs", {"model": "mock", "input": {"ids": _packed([1, 2]), "lengths": [2]}}),
    ("/v1/next_token_logprobs", {"model": "mock", "input": {"ids": _packed([1, 2, 3]), "lengths": [1, 2]}}),
    (
        "/v1/responses",
        {
            "model": "mock",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "x"},
            ],
            "max_output_tokens": 1,
        },
    ),
]


@pytest.fixture(scope="module")
def mock_app():
    with mock_app_client() as (_, client):
        yield client


@pytest.mark.parametrize(("path", "body"), REFUSED)
def test_the_document_forbids_what_the_server_refuses(mock_app, path, body):
    document = mock_app.get("/openapi.json").json()
    assert not _request_schema(document, path).is_valid(body)
    answer = mock_app.post(path, json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("path", "body"), SERVED)
def test_the_document_allows_what_the_server_serves(mock_app, path, body):
    document = mock_app.get("/openapi.json").json()
    assert _request_schema(document, path).is_valid(body)
    assert mock_app.post(path, json=body).status_code == 200


def test_the_document_states_the_context_limit_of_max_tokens():
    properties = build_openapi(ROUTE_HANDLERS)["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "max_model_len" in properties["max_tokens"]["description"]
    assert "context_length_exceeded" in properties["max_tokens"]["description"]
