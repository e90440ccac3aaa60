"""The OpenAPI 3.1 document, built from the route handlers and the msgspec types that decode their
requests.

Each handler's decorator declares its operation: Litestar's summary, description and tags, and in
`opt` what Litestar cannot read from a handler that decodes its own body (gateway/contract/operation.py).
The schemas are msgspec's; what the settings and the routes' checks allow is written into them
(gateway/contract/constraints.py), and so are, on the running server, the vocabulary's bounds
(gateway/contract/vocabulary.py). Where each route sits adds its statuses (the guard's key and
limits, the body limit, shutdown) and security; links say which response values other operations
take (gateway/contract/links.py).
"""

from __future__ import annotations

import copy
import inspect
import typing
from collections.abc import Iterable
from typing import Any

import msgspec
from litestar.handlers import HTTPRouteHandler

from gateway.contract.constraints import constrain
from gateway.contract.endpoint import Endpoint, endpoints
from gateway.contract.links import links
from gateway.contract.operation import Schema
from gateway.contract.responses_checks import constrain_responses
from gateway.contract.vocabulary import bound_by_vocabulary
from gateway.errors import ErrorResponse
from gateway.guard import DURING_SHUTDOWN, open_paths
from gateway.schemas.chat import ChatCompletionChunk
from gateway.settings import Settings

REF = "#/components/schemas/{name}"
# Schemas no operation's content names: the error object, and what descriptions name.
COMPONENTS = (ErrorResponse, ChatCompletionChunk)
ERRORS = {
    "400": "Invalid request: a field is missing, of the wrong type or out of range, or the prompt is too long.",
    "401": "Missing or wrong API key (when keys are configured), or admin key on admin endpoints.",
    "403": "Admin endpoints disabled, or a path outside the adapters root.",
    "404": "Unknown model or adapter, or unknown path.",
    "405": "Method not allowed on this path.",
    "413": "Request body too large.",
    "415": "A body that is neither JSON nor MessagePack (by its Content-Type; none is read as JSON).",
    "429": "A per-key limit (requests in flight, rows per minute) or the server's stream limit; see Retry-After.",
    "500": "The engine failed; the service keeps serving.",
    "503": "The model is still loading, or failed to load; or the server is shutting down (see Retry-After).",
    "501": "The engine cannot do this (a restart or another backend can): new weights without a restart, "
    "or over a collective.",
}
MODEL_PARAM = {
    "name": "model",
    "in": "path",
    "required": True,
    "description": "A served model name, or `base:adapter`.",
    "schema": {"type": "string"},
}
INFO = {
    "title": "logprob-gateway",
    "version": "0.1.0",
    "description": "OpenAI-compatible gateway for in-process LLM engines, with dense next-token "
    "log-probabilities over the whole vocabulary. Errors use OpenAI's error object. A request whose "
    "head (request line and headers) is not complete within the server's header timeout gets a 408 "
    "and its connection is closed.",
}


def _is_type(node: Any) -> bool:
    return isinstance(node, type) or typing.get_origin(node) is not None


def _type_leaves(schema: Schema) -> list[Any]:
    """The types in a declared schema (itself, or the leaves of a JSON Schema literal)."""
    if _is_type(schema):
        return [schema]
    if isinstance(schema, dict):
        return [t for value in schema.values() for t in _type_leaves(value)]
    if isinstance(schema, list):
        return [t for value in schema for t in _type_leaves(value)]
    return []


class _Schemas:
    """msgspec's schemas of every type the operations declare, as components and references."""

    def __init__(self, declared: Iterable[Any]) -> None:
        self.types: list[Any] = []
        for t in declared:
            if t not in self.types:
                self.types.append(t)
        inline, components = msgspec.json.schema_components(self.types, ref_template=REF)
        self.inline = inline
        self.components = {name: _cleaned(schema) for name, schema in components.items()}

    def resolve(self, schema: Schema) -> Any:
        """A declared schema in JSON Schema: each type replaced by its schema (a reference)."""
        if _is_type(schema):
            return copy.deepcopy(self.inline[self.types.index(schema)])
        if isinstance(schema, dict):
            return {key: self.resolve(value) for key, value in schema.items()}
        if isinstance(schema, list):
            return [self.resolve(value) for value in schema]
        return copy.deepcopy(schema)

    def content(self, by_media_type: Any) -> dict[str, Any]:
        return {media: {"schema": self.resolve(schema)} for media, schema in by_media_type.items()}


def _cleaned(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of a type's schema with its description (its docstring) indented as
    `inspect.cleandoc` leaves it, as msgspec from 0.23 writes it: the same document whichever
    msgspec made it."""
    schema = copy.deepcopy(schema)
    if isinstance(schema.get("description"), str):
        schema["description"] = inspect.cleandoc(schema["description"])
    return schema


def _declared_types(operations: Iterable[Any]) -> list[Any]:
    found: list[Any] = []
    for op in operations:
        if op.request is not None:
            found.append(op.request)
        for schema in [*op.content.values(), *(s for r in op.replies.values() for s in r.content.values())]:
            found.extend(_type_leaves(schema))
    return [*found, *COMPONENTS]


def _responses(
    endpoint: Endpoint, every: list[Endpoint], schemas: _Schemas, settings: Settings
) -> dict[str, Any]:
    op = endpoint.operation
    success: dict[str, Any] = {"description": "Success.", "content": schemas.content(op.content)}
    if found := links(endpoint, every):
        success["links"] = found
    responses = {endpoint.ok_status: success}
    statuses = set(op.errors)
    if endpoint.path not in open_paths(metrics_public=settings.metrics_public):
        statuses |= {"401", "429"}
    if op.request is not None:
        statuses |= {"413", "415"}
    if endpoint.path not in DURING_SHUTDOWN:
        statuses.add("503")
    for status in sorted(statuses):
        responses[status] = {
            "description": ERRORS[status],
            "content": {"application/json": {"schema": schemas.resolve(ErrorResponse)}},
        }
    for status, reply in op.replies.items():
        responses[status] = {"description": reply.description, "content": schemas.content(reply.content)}
    return responses


def build_openapi(
    handlers: Iterable[HTTPRouteHandler], settings: Settings | None = None, vocab_size: int | None = None
) -> dict[str, Any]:
    """The document of the route `handlers` (gateway.app.ROUTE_HANDLERS) for `settings`; with
    `vocab_size` (the running server's, once its models have loaded), token ids and `logit_bias`
    keys bounded by it. The handlers are given, not imported: gateway/status.py serves the document."""
    settings = settings or Settings()
    every = endpoints(handlers)
    schemas = _Schemas(_declared_types(e.operation for e in every))
    constrain(schemas.components, settings)
    constrain_responses(schemas.components, settings)
    if vocab_size is not None:
        bound_by_vocabulary(schemas.components, vocab_size)
    unguarded = open_paths(metrics_public=settings.metrics_public)
    paths: dict[str, Any] = {}
    for endpoint in every:
        op = endpoint.operation
        spec: dict[str, Any] = {
            "summary": endpoint.summary,
            "description": endpoint.description,
            "operationId": endpoint.operation_id,
            "tags": endpoint.tags,
            "responses": _responses(endpoint, every, schemas, settings),
        }
        if endpoint.path in unguarded:
            spec["security"] = []
        if "{model}" in endpoint.path:
            spec["parameters"] = [MODEL_PARAM]
        if op.request is not None:
            media: dict[str, Any] = {"schema": schemas.resolve(op.request)}
            if op.example is not None:
                media["example"] = dict(op.example)
            spec["requestBody"] = {"required": True, "content": {"application/json": media}}
        paths.setdefault(endpoint.path, {})[endpoint.method] = spec
    return {
        "openapi": "3.1.0",
        "info": INFO,
        "paths": paths,
        **({"security": [{"apiKey": []}]} if settings.api_keys or settings.api_keys_file else {}),
        "components": {
            "schemas": schemas.components,
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer", "description": "An API key."}},
        },
    }
