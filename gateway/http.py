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
from litestar.response import Stream
from litestar.response.base import ASGIResponse
from litestar.types import Receive, Send

from gateway.access import Access
from gateway.errors import ErrorDetail, ErrorResponse, GatewayError, InvalidRequestError
from gateway.guard import KEY_NAME, STREAM_KEY
from gateway.metrics import set_labels
from gateway.registry import ModelRegistry, ServedModel
from gateway.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")
_encoder = msgspec.json.Encoder()


MSGPACK_TYPES = ("application/msgpack", "application/vnd.msgpack", "application/x-msgpack")


def is_msgpack(media_type: str | None) -> bool:
    return bool(media_type) and any(t in media_type for t in MSGPACK_TYPES)  # type: ignore[operator]


async def decode_json(request: Request, body_type: type[T]) -> T:
    """Decode and validate a JSON body (or MessagePack, by Content-Type); errors become 400s in errors.py."""
    body = await request.body()
    try:
        if is_msgpack(request.headers.get("content-type")):
            return msgspec.msgpack.decode(body, type=body_type)
        return msgspec.json.decode(body, type=body_type)
    except UnicodeDecodeError as exc:
        # msgspec raises this (not a DecodeError) for a string that is not UTF-8, in either format
        raise InvalidRequestError(f"request body has a string that is not valid UTF-8: {exc}") from None


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


class _ASGIPartsResponse(ASGIResponse):
    __slots__ = ("parts",)

    def __init__(self, *, parts: Sequence[bytes | memoryview], **kwargs: Any) -> None:
        super().__init__(content_length=sum(len(part) for part in parts), **kwargs)
        self.parts = parts

    async def send_body(self, send: Send, receive: Receive) -> None:
        last = len(self.parts) - 1
        for i, part in enumerate(self.parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < last})  # type: ignore[typeddict-item]


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
        return _ASGIPartsResponse(
            parts=self.parts,
            background=self.background or kwargs.get("background"),
            cookies=itertools.chain(self.cookies, kwargs.get("cookies") or ()),
            headers={**(kwargs.get("headers") or {}), **self.headers},
            media_type=self.media_type,
            status_code=self.status_code or kwargs.get("status_code"),
        )


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


def sse_response(events: AsyncIterator[bytes]) -> Stream:
    return Stream(
        content=_sse(events),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
