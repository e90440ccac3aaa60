"""OpenAPI links: which values of a success response other operations take (a served model's name,
an adapter's, token ids), so that a client, or schemathesis's stateful phase, can chain them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.contract.endpoint import Endpoint
from gateway.schemas.chat import ChatCompletionRequest
from gateway.schemas.completions import CompletionRequest
from gateway.schemas.logprobs import DetokenizeRequest, NextTokenLogprobsRequest, TokenizeRequest

MODEL_REQUESTS = (
    CompletionRequest,
    ChatCompletionRequest,
    NextTokenLogprobsRequest,
    TokenizeRequest,
    DetokenizeRequest,
)


def _model_links(source: Endpoint, endpoints: Sequence[Endpoint], model: str) -> dict[str, Any]:
    """Links from a response naming a served model (`model`, a runtime expression) to every
    operation that names one: in its path, or as `model` in its body (the rest of the body is the
    caller's)."""
    links: dict[str, Any] = {}
    for target in endpoints:
        if "{model}" in target.path and target is not source:
            links[target.operation_id] = {"operationId": target.operation_id, "parameters": {"model": model}}
        elif target.operation.request in MODEL_REQUESTS:
            links[target.operation_id] = {
                "operationId": target.operation_id,
                "requestBody": {"model": "{" + model + "}"},
            }
    return links


def links(source: Endpoint, endpoints: Sequence[Endpoint]) -> dict[str, Any]:
    """What the success response of `source` gives that other operations of `endpoints` take."""
    if source.path == "/v1/models":
        return _model_links(source, endpoints, "$response.body#/data/0/id")
    if source.path == "/v1/models/{model}":
        return _model_links(source, endpoints, "$response.body#/id")
    if source.path == "/v1/load_lora_adapter":
        target = next(e for e in endpoints if e.path == "/v1/models/{model}")
        return {
            "describe_adapter": {
                "operationId": target.operation_id,
                "parameters": {"model": "$response.body#/id"},
            }
        }
    if source.operation.request is TokenizeRequest:
        detokenize = next(e for e in endpoints if e.path == source.path.replace("tokenize", "detokenize"))
        body = {"model": "{$request.body#/model}", "tokens": "{$response.body#/tokens}"}
        return {"detokenize": {"operationId": detokenize.operation_id, "requestBody": body}}
    return {}
