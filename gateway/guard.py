"""The ASGI layer around the whole app: API keys, per-key request limits, cancellation of a
request's work when its client goes away, and the end of requests at shutdown.

It wraps the app (not Litestar's per-route middleware) so that unknown paths need a key too, and
so that it sees the whole life of a streamed response. Errors it raises itself are written here in
OpenAI's error format, like every other error.
"""

from __future__ import annotations

import asyncio
import contextlib

from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.access import Access
from gateway.errors import (
    AuthenticationError,
    GatewayError,
    ShuttingDownError,
    error_body,
    retry_after_headers,
)
from gateway.metrics import DISCONNECTED_KEY
from gateway.server.shutdown import Shutdown

STREAM_KEY = "logprob_gateway.stream"  # set by a route that reserved a stream slot
ANSWER_BYTES_KEY = "logprob_gateway.answer_bytes"  # bytes a route reserved for its answer
DURING_SHUTDOWN = {"/health", "/metrics"}  # still answered while the server drains
KEY_NAME = "logprob_gateway.key"  # the API key's name, for per-key limits in routes


def _bearer(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


async def _send_error(send: Send, exc: GatewayError) -> None:
    body = error_body(exc.message, exc.error_type, exc.param, exc.code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in retry_after_headers(exc).items()]
    if isinstance(exc, AuthenticationError):
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": exc.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def open_paths(*, metrics_public: bool) -> frozenset[str]:
    """The paths served without a key where keys are configured (the OpenAPI document says so too)."""
    return frozenset({"/health", "/metrics"} if metrics_public else {"/health"})


def guard(app: ASGIApp, access: Access, shutdown: Shutdown, *, metrics_public: bool) -> ASGIApp:
    unguarded = open_paths(metrics_public=metrics_public)

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        if shutdown.draining and scope["path"] not in DURING_SHUTDOWN:
            await _send_error(send, _shutting_down())
            return
        key = None
        try:
            if access.keyring.enabled and scope["path"] not in unguarded:
                key = access.keyring.require(
                    _bearer(scope), "request", "; send 'Authorization: Bearer <key>'"
                )
            scope[KEY_NAME] = key  # type: ignore[literal-required]
            if key is not None:
                access.enter(key)
        except GatewayError as exc:
            await _send_error(send, exc)
            return
        try:
            await _cancel_on_disconnect(app, scope, receive, send, shutdown)
        finally:
            if key is not None:
                access.leave(key)
            if scope.get(STREAM_KEY):
                access.release_stream()
            if scope.get(ANSWER_BYTES_KEY):
                access.release_answer_bytes(scope[ANSWER_BYTES_KEY])  # type: ignore[literal-required]

    return guarded


def _shutting_down() -> ShuttingDownError:
    return ShuttingDownError("the server is shutting down; send the request again")


async def _cancel_on_disconnect(
    app: ASGIApp, scope: Scope, receive: Receive, send: Send, shutdown: Shutdown
) -> None:
    """Run the app, and cancel it if the client disconnects before the response is complete.

    uvicorn keeps running a handler whose client has gone until it writes; cancelling it stops
    the engine work behind it (vLLM requests are aborted, queued dense rows are dropped, and
    generation stops at the next token). The body is read only as fast as the app asks for it;
    once it is in, one watcher reads `receive` for the disconnect and answers the app's own reads.
    Cancelled at the end of a shutdown's grace period, the request ends in the error shape: a 503
    when nothing was sent yet, an error event and `data: [DONE]` ending a stream.
    """
    disconnected = asyncio.Event()
    started = stream = False  # the response's head was sent; it is a stream of server-sent events
    done = False  # the response's last byte was handed to the server
    task: asyncio.Task[None] | None = None

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        disconnected.set()
        if not done and task is not None:
            scope[DISCONNECTED_KEY] = True  # type: ignore[literal-required]
            task.cancel()

    watcher: asyncio.Task[None] | None = None

    async def app_receive() -> Message:
        nonlocal watcher
        if watcher is not None:
            await disconnected.wait()
            return {"type": "http.disconnect"}
        message = await receive()
        if message["type"] == "http.disconnect":  # gone before its body was in: no answer reaches it
            scope[DISCONNECTED_KEY] = True  # type: ignore[literal-required]
            disconnected.set()
        elif not message.get("more_body", False):
            watcher = asyncio.create_task(watch())
        return message

    async def app_send(message: Message) -> None:
        nonlocal done, started, stream
        if message["type"] == "http.response.start":
            started = True
            stream = any(
                name == b"content-type" and value.startswith(b"text/event-stream")
                for name, value in message.get("headers", ())
            )
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            done = True
        await send(message)

    task = asyncio.create_task(app(scope, app_receive, app_send))
    shutdown.requests.add(task)
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if shutdown.ending and not scope.get(DISCONNECTED_KEY) and current and not current.cancelling():
            await _end_at_shutdown(send, started, stream, done)
        elif not scope.get(DISCONNECTED_KEY):
            raise  # the server itself is cancelling us
    finally:
        shutdown.requests.discard(task)
        task.cancel()
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher


async def _end_at_shutdown(send: Send, started: bool, stream: bool, done: bool) -> None:
    """End a request that the shutdown cancelled; a body other than a stream's is left as it is."""
    exc = _shutting_down()
    # A client that reads nothing would hold this write until uvicorn cancels us in turn: let it.
    with contextlib.suppress(asyncio.CancelledError):
        if not started:
            await _send_error(send, exc)
        elif stream and not done:
            error = error_body(exc.message, exc.error_type, code=exc.code)
            event = b"data: " + error + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": False})
