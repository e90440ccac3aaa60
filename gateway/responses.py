"""The answers routes send: JSON, MessagePack, bodies in several buffers, server-sent events."""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response.base import ASGIResponse
from litestar.types import Receive, Send

from gateway.errors import ErrorDetail, ErrorResponse, GatewayError
from gateway.requests import MSGPACK_TYPES

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()


def json_response(body: Any, status_code: int = 200) -> Response:
    return Response(content=_encoder.encode(body), status_code=status_code, media_type="application/json")


def msgpack_response(body: Any, status_code: int = 200) -> Response:
    return Response(
        content=msgspec.msgpack.encode(body), status_code=status_code, media_type=MSGPACK_TYPES[0]
    )


SEND_CHUNK_BYTES = 2**20  # a body goes to the server in pieces this large at most


def _chunks(parts: list[bytes | memoryview]) -> Iterator[bytes | memoryview]:
    """The parts in pieces, each part let go of once its pieces are out: a gigabyte of answer is
    freed as it is sent, not all at once on the event loop at its end."""
    parts.reverse()
    while parts:
        part = parts.pop()
        if len(part) <= SEND_CHUNK_BYTES:
            yield part
            continue
        view = memoryview(part).cast("B")
        del part
        for i in range(0, len(view), SEND_CHUNK_BYTES):
            yield view[i : i + SEND_CHUNK_BYTES]


class _ASGIPartsResponse(ASGIResponse):
    __slots__ = ("parts",)

    def __init__(self, *, parts: Sequence[bytes | memoryview], **kwargs: Any) -> None:
        super().__init__(content_length=sum(memoryview(part).nbytes for part in parts), **kwargs)
        self.parts = list(parts)

    async def send_body(self, send: Send, receive: Receive) -> None:
        # In pieces: uvicorn waits for the client to read before taking the next, so the request
        # (and its reserved answer bytes, gateway.guard) ends when the client has read, not before.
        parts, self.parts = self.parts, []
        for piece in _chunks(parts):
            await send({"type": "http.response.body", "body": piece, "more_body": True})  # type: ignore[typeddict-item]
            del piece
        await send({"type": "http.response.body", "body": b"", "more_body": False})  # type: ignore[typeddict-item]


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
        parts, self.parts = self.parts, []  # the ASGI response alone holds them, to let them go
        return _ASGIPartsResponse(parts=parts, **_asgi_fields(self, kwargs))


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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse_event(body: Any, event: str | None = None) -> bytes:
    """One server-sent event: `data: <json>`, after `event: <event>` where it is named (OpenAI's
    Responses stream names each event by its type)."""
    head = b"event: " + event.encode() + b"\n" if event is not None else b""
    return head + b"data: " + _encoder.encode(body) + b"\n\n"


def _chat_error(error: ErrorDetail) -> bytes:
    return sse_event(ErrorResponse(error=error))


DONE = b"data: [DONE]\n\n"


async def _sse(
    events: AsyncIterator[bytes], error_event: Callable[[ErrorDetail], bytes], ending: bytes
) -> AsyncIterator[bytes]:
    """The stream's events, then `ending`; a failure mid-stream becomes an error event."""
    try:
        async for event in events:
            yield event
    except GatewayError as exc:
        yield error_event(
            ErrorDetail(message=exc.message, type=exc.error_type, param=exc.param, code=exc.code)
        )
    except Exception:
        log.exception("stream failed")
        yield error_event(ErrorDetail(message="internal server error", type="internal_error"))
    if ending:
        yield ending


def sse_response(
    events: AsyncIterator[bytes],
    *,
    error_event: Callable[[ErrorDetail], bytes] = _chat_error,
    ending: bytes = DONE,
) -> EventStreamResponse:
    """`events` as server-sent events; a failure mid-stream is sent as `error_event` makes it (chat's
    `data: {"error": {...}}` by default), and the stream ends with `ending` (`data: [DONE]`; empty:
    nothing)."""
    return EventStreamResponse(
        _sse(events, error_event, ending), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
