"""What a route's decorator says of its operation beyond what Litestar reads from it (path,
methods, summary, description, tags, status): our routes decode their own bodies, JSON or
MessagePack, and build their own responses, so the request type, the response media types and the
documented statuses are declared here, in the decorator's `opt`:

    @post("/v1/tokenize", summary="Tokenize", description="...", tags=["Tokenizer"], opt={OPENAPI:
        Operation(request=TokenizeRequest, content={"application/json": TokenizeResponse})})

gateway/contract/document.py reads these from the handlers and assembles the document.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

OPENAPI = "openapi"  # the key of an Operation in a route handler's `opt`

# A schema: a type msgspec describes (a Struct, `A | list[A]`, an Annotated list, ...), or a JSON
# Schema literal whose leaves may be such types (`{"oneOf": [A, B]}`).
Schema = Any

# The server-sent events of a streamed answer (OpenAPI 3.1: the schema of one event).
SSE: dict[str, Any] = {
    "type": "object",
    "description": "Server-sent events: `data: <chunk JSON>` lines, then `data: [DONE]`. An error while "
    'streaming is sent as `data: {"error": {...}}` before `[DONE]`.',
    "properties": {"data": {"type": "string", "description": "A chunk's JSON, or `[DONE]`."}},
    "required": ["data"],
}
TEXT: dict[str, Any] = {"type": "string"}
EMPTY_TEXT: dict[str, Any] = {"type": "string", "maxLength": 0}


@dataclass(frozen=True)
class Reply:
    """A documented response that is neither the success nor the error object."""

    description: str
    content: Mapping[str, Schema]


@dataclass(frozen=True)
class Operation:
    """`request`: the body's type (the route decodes it); `content`: the success response's schema
    by media type; `errors`: statuses the route itself answers with the error object (those of the
    guard, the body limit and shutdown are added by where the route sits); `replies`: statuses
    whose body is something else; `example`: a request body."""

    content: Mapping[str, Schema]
    request: type | None = None
    errors: tuple[str, ...] = ("400", "404", "500", "503")
    replies: Mapping[str, Reply] = field(default_factory=dict)
    example: Mapping[str, Any] | None = None
