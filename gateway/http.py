"""Request decoding and response encoding helpers shared by the routes (JSON and SSE)."""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response.base import ASGIResponse
from litestar.types import Receive, Send

from gateway.access import Access
from gateway.errors import (
    ErrorDetail,
    ErrorResponse,
    GatewayError,
    InvalidRequestError,
    UnsupportedMediaTypeError,
)
from gateway.guard import ANSWER_BYTES_KEY, KEY_NAME, STREAM_KEY
from gateway.metrics import set_labels
from gateway.registry import ModelRegistry, ServedModel
from gateway.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")
_encoder = msgspec.json.Encoder()


MSGPACK_TYPES = ("application/msgpack", "application/vnd.msgpack", "application/x-msgpack")


def is_msgpack(media_type: str | None) -> bool:
    return bool(media_type) and any(t in media_type for t in MSGPACK_TYPES)  # type: ignore[operator]


def is_json(media_type: str) -> bool:
    """application/json or a `+json` type, parameters (charset) aside."""
    essence = media_type.split(";", 1)[0].strip().lower()
    return essence == "application/json" or essence.endswith("+json")


async def decode_json(request: Request, body_type: type[T]) -> T:
    """Decode and validate a JSON body (or MessagePack, by Content-Type; none: JSON); errors
    become 400s in errors.py, another Content-Type (a form, text) a 415 before the body is read."""
    media_type = request.headers.get("content-type")
    binary = is_msgpack(media_type)
    if media_type and not binary and not is_json(media_type):
        raise UnsupportedMediaTypeError(
            f"Content-Type {media_type[:100]!r} is not supported: send the body as application/json "
            f"(or {MSGPACK_TYPES[0]})"
        )
    body = await request.body()
    try:
        try:
            if binary:
                return msgspec.msgpack.decode(body, type=body_type)
            return msgspec.json.decode(body, type=body_type)
        except msgspec.ValidationError as exc:
            return _decode_with_integral_floats(body, binary, body_type, exc)
    except UnicodeDecodeError as exc:
        # msgspec raises this (not a DecodeError) for a string that is not UTF-8, in either format
        raise InvalidRequestError(f"request body has a string that is not valid UTF-8: {exc}") from None
    except RecursionError:
        # msgspec recurses once per level of nesting, in fields the type ignores too
        raise InvalidRequestError("request body is nested too deeply") from None


_INT64 = range(-(2**63), 2**63)


def _integral_floats_to_ints(document: Any) -> bool:
    """Turn, in place, every finite float with no fractional part (within int64) into an int; True
    when there was one. Walks with a stack: documents nest as deep as the body does."""
    changed = False
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            items: Any = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            continue
        for key, value in list(items):
            if isinstance(value, float) and value.is_integer() and int(value) in _INT64:
                node[key] = int(value)
                changed = True
            elif isinstance(value, (dict, list)):
                stack.append(value)
    return changed


def _decode_with_integral_floats(
    body: bytes, binary: bool, body_type: type[T], error: msgspec.ValidationError
) -> T:
    """JSON Schema, and so the OpenAPI document, counts 1.0 as an integer: a body the typed decode
    refused is decoded again with such floats as ints. With none, the typed decode's error stands."""
    try:
        document = msgspec.msgpack.decode(body) if binary else msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        raise error from None
    if not _integral_floats_to_ints(document):
        raise error
    # An error now names a field that is wrong as read, not a 1.0 that the retry accepts.
    return msgspec.convert(document, type=body_type, strict=True)


def wants_msgpack(request: Request) -> bool:
    """MessagePack when the Accept header prefers it to JSON (q-values honoured; ties go to JSON)."""
    best = {"msgpack": -1.0, "json": -1.0}
    for part in request.headers.get("accept", "").split(","):
        media, *params = (p.strip() for p in part.split(";"))
        q = next((p[2:] for p in params if p.startswith("q=")), "1")
        try:
            weight = float(q)
        except ValueError:
            continue
        kind = (
            "msgpack"
            if is_msgpack(media)
            else "json"
            if media in ("application/json", "*/*", "application/*")
            else ""
        )
        if kind:
            best[kind] = max(best[kind], weight)
    return best["msgpack"] > 0 and best["msgpack"] > best["json"]


def msgpack_response(body: Any, status_code: int = 200) -> Response:
    return Response(
        content=msgspec.msgpack.encode(body), status_code=status_code, media_type=MSGPACK_TYPES[0]
    )


SEND_CHUNK_BYTES = 2**20  # a body goes to the server in pieces this large at most


def _chunks(parts: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    pieces: list[bytes | memoryview] = []
    for part in parts:
        if len(part) <= SEND_CHUNK_BYTES:
            pieces.append(part)
            continue
        view = memoryview(part).cast("B")
        pieces.extend(view[i : i + SEND_CHUNK_BYTES] for i in range(0, len(view), SEND_CHUNK_BYTES))
    return pieces


class _ASGIPartsResponse(ASGIResponse):
    __slots__ = ("parts",)

    def __init__(self, *, parts: Sequence[bytes | memoryview], **kwargs: Any) -> None:
        super().__init__(content_length=sum(memoryview(part).nbytes for part in parts), **kwargs)
        self.parts = parts

    async def send_body(self, send: Send, receive: Receive) -> None:
        # In pieces: uvicorn waits for the client to read before taking the next, so the request
        # (and its reserved answer bytes, gateway.guard) ends when the client has read, not before.
        pieces = _chunks(self.parts)
        last = len(pieces) - 1
        for i, piece in enumerate(pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": i < last})  # type: ignore[typeddict-item]


class PartsResponse(Response):
    """A body sent as it lies in memory, in several buffers (a small header, then megabytes of an
    array), under one Content-Length: joining them would copy the array once more."""

    def __init__(
        self,
        parts: Sequence[bytes | memoryview],
        *,
        media_type: str,
        headers: dict[str, str] | None = None,
        background: BackgroundTask | None = None,
    ) -> None:
        super().__init__(content=b"", media_type=media_type, headers=headers, background=background)
        self.parts = parts

    def to_asgi_response(self, request: Request, **kwargs: Any) -> ASGIResponse:  # type: ignore[override]
        return _ASGIPartsResponse(parts=self.parts, **_asgi_fields(self, kwargs))


def _asgi_fields(response: Response, kwargs: dict[str, Any]) -> dict[str, Any]:
    """What Litestar hands `to_asgi_response`, merged with the response's own fields."""
    return {
        "background": response.background or kwargs.get("background"),
        "cookies": itertools.chain(response.cookies, kwargs.get("cookies") or ()),
        "headers": {**(kwargs.get("headers") or {}), **response.headers},
        "media_type": response.media_type,
        "status_code": response.status_code or kwargs.get("status_code"),
    }


class _ASGIEventStream(ASGIResponse):
    __slots__ = ("events",)
    _should_set_content_length = False

    def __init__(self, *, events: AsyncIterator[bytes], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.events = events

    async def send_body(self, send: Send, receive: Receive) -> None:
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class EventStreamResponse(Response):
    """Server-sent events, produced in the request's own task. Litestar's `Stream` produces them in
    a child task and cancels it through anyio when the client leaves; anyio skips a task whose
    wait has just ended, which a producer that never waits long (the mock engine) ends at every
    turn, so generation ran to the end. Here the guard's cancellation of the request's task
    (gateway/guard.py) reaches the producer at its next await."""

    def __init__(self, events: AsyncIterator[bytes], *, headers: dict[str, str] | None = None) -> None:
        super().__init__(content=b"", media_type="text/event-stream", headers=headers)
        self.events = events

    def to_asgi_response(self, request: Request, **kwargs: Any) -> ASGIResponse:  # type: ignore[override]
        return _ASGIEventStream(events=self.events, **_asgi_fields(self, kwargs))


def json_response(body: Any, status_code: int = 200) -> Response:
    return Response(content=_encoder.encode(body), status_code=status_code, media_type="application/json")


def registry(request: Request) -> ModelRegistry:
    return request.app.state.registry


def resolve_model(request: Request, name: str) -> tuple[ServedModel, str | None]:
    """The served model and adapter a request names; labels the request's metrics with them."""
    served, adapter = registry(request).resolve(name)
    set_labels(request.scope, served.name, adapter)
    return served, adapter


def settings(request: Request) -> Settings:
    return request.app.state.settings


def access(request: Request) -> Access:
    return request.app.state.access


def reserve_stream(request: Request) -> None:
    """Take one of the server's stream slots (429 when none is free); gateway.guard gives it back
    when the response ends, however it ends. Without the guard (an app used bare) there is no limit."""
    if KEY_NAME in request.scope:
        access(request).reserve_stream()
        request.scope[STREAM_KEY] = True  # type: ignore[literal-required]


def reserve_answer_bytes(request: Request, nbytes: int) -> None:
    """Reserve the answer's bytes in the server-wide budget (gateway.access); gateway.guard gives
    them back once the response is sent to the client or abandoned. Without the guard: no limit."""
    if KEY_NAME in request.scope:
        access(request).reserve_answer_bytes(nbytes)
        request.scope[ANSWER_BYTES_KEY] = nbytes  # type: ignore[literal-required]


def charge_rows(request: Request, rows: int) -> None:
    """Count dense rows against the API key's per-minute budget (429 when spent)."""
    access(request).take_rows(request.scope.get(KEY_NAME), rows)  # type: ignore[arg-type]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse_event(body: Any) -> bytes:
    return b"data: " + _encoder.encode(body) + b"\n\n"


async def _sse(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The stream's events, then `data: [DONE]`; a failure mid-stream becomes an error event."""
    try:
        async for event in events:
            yield event
    except GatewayError as exc:
        yield sse_event(
            ErrorResponse(error=ErrorDetail(message=exc.message, type=exc.error_type, code=exc.code))
        )
    except Exception:
        log.exception("stream failed")
        yield sse_event(
            ErrorResponse(error=ErrorDetail(message="internal server error", type="internal_error"))
        )
    yield b"data: [DONE]\n\n"


def sse_response(events: AsyncIterator[bytes]) -> EventStreamResponse:
    return EventStreamResponse(_sse(events), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
