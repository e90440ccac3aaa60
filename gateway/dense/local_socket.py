"""Dense rows for clients on the gateway's own host, over a Unix socket instead of HTTP.

A client that gets its rows in its own shared memory (gateway/dense/shared_memory.py) still pays
an HTTP exchange per call: its client library, the HTTP parser, the ASGI layers and the router,
which together cost several times what the rest of the gateway does for a small call. Such a
client is told, in the `Logprob-Gateway-Socket` header of an answer written into its memory, where
this socket is; it connects and asks over it from then on. Everyone else keeps HTTP.

Frames, each way: a 4-byte little-endian length, then a MessagePack array.

    client: ["hello", api_key or nil]      server: [0, status, "", error body or ""]
    client: [id, body]                      server: [id, status, server_timing, body]

`body` is what HTTP carries for `POST /v1/next_token_logprobs` in MessagePack; the answer's body
is the same small document saying where the rows lie, or, with status >= 400, the same JSON error
body. The same API keys (once per connection), per-key limits, answer-byte budget, metrics
(method "LOCAL") and errors apply; a request whose answer would not go into shared memory is a
400, so no frame carries rows and a client that reads nothing holds a few hundred bytes.
Bounds: a frame is at most `max_body_bytes`; the hello must come within `header_timeout_s`; a
connection reads no further requests while `max_local_in_flight` of its own are running or its
unread answers pass the transport's high-water mark; requests in flight are cancelled when it
closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Coroutine
from typing import Any

import msgspec

from gateway import requests
from gateway.access import Access
from gateway.body_decode import BodyDecoder
from gateway.dense.service import DenseService
from gateway.errors import (
    EXCEPTION_HANDLERS,
    AuthenticationError,
    InvalidRequestError,
    PayloadTooLargeError,
    RateLimitError,
    RequestTimeoutError,
    ShuttingDownError,
)
from gateway.metrics import Metrics
from gateway.models.registry import ModelRegistry
from gateway.schemas.logprobs import NextTokenLogprobsRequest
from gateway.server.protocol import UnfinishedBodyBytes
from gateway.server.shutdown import Shutdown
from gateway.settings import Limits

log = logging.getLogger(__name__)

ROUTE = "/v1/next_token_logprobs"
_LENGTH = struct.Struct("<I")


def _start(coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """A task for a request frame that runs at once, up to its first wait for the engine (Python
    3.12's eager start), rather than at the event loop's next turn."""
    if sys.version_info >= (3, 12):
        return asyncio.Task(coroutine, loop=asyncio.get_running_loop(), eager_start=True)
    return asyncio.create_task(coroutine)


def error_frame(exc: BaseException) -> tuple[int, bytes]:
    """The status and JSON body HTTP would answer `exc` with (the app's own exception handlers)."""
    for kind in type(exc).__mro__:
        handler = EXCEPTION_HANDLERS.get(kind)
        if handler is not None:
            response = handler(None, exc)
            return response.status_code, response.content
    raise exc  # not an Exception (cancellation): not an answer


DIRECTORY_PREFIX = "logprob-gateway-"
SOCKET_NAME = "dense.sock"


def remove_stale_sockets() -> list[str]:
    """Remove the socket directories that gateways of this user left behind when they died (killed,
    so never closed): those holding only our socket, with nobody listening on it. Returns them."""
    removed = []
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            if not entry.name.startswith(DIRECTORY_PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.getuid() or os.listdir(entry.path) != [
                    SOCKET_NAME
                ]:
                    continue
                path = os.path.join(entry.path, SOCKET_NAME)
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                probe.setblocking(False)  # a live listener with a full backlog answers EAGAIN, not a wait
                try:
                    probe.connect(path)
                    continue  # a live gateway's
                except BlockingIOError:
                    continue
                except ConnectionRefusedError:
                    pass
                finally:
                    probe.close()
                os.unlink(path)
                os.rmdir(entry.path)
                removed.append(entry.path)
    return removed


class LocalSocketServer:
    """Listens on a socket in a directory of its own (mode 0711: its random name is the way in),
    in the event loop of the HTTP server it sits beside."""

    def __init__(
        self,
        dense: DenseService,
        registry: ModelRegistry,
        access: Access,
        limits: Limits,
        metrics: Metrics,
        shutdown: Shutdown,
    ) -> None:
        self.dense, self.registry, self.access, self.limits = dense, registry, access, limits
        self.metrics, self.shutdown = metrics, shutdown
        self.path: str | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self.body_decoder = BodyDecoder(
            limits.decode_worker_bytes, limits.decode_workers, limits.decode_queue
        )
        # bytes its connections hold of frames not yet handled, against the same budget as HTTP's
        self.unfinished_bytes = UnfinishedBodyBytes(limits.max_unfinished_body_bytes)

    async def start(self) -> str:
        remove_stale_sockets()
        directory = tempfile.mkdtemp(prefix=DIRECTORY_PREFIX)
        os.chmod(directory, 0o711)
        path = os.path.join(directory, SOCKET_NAME)
        self._server = await asyncio.get_running_loop().create_unix_server(lambda: _Connection(self), path)
        os.chmod(path, 0o666)  # other users' clients may connect; API keys still apply
        self.path = path
        return path

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            for connection in list(self._connections):
                connection.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
                os.rmdir(os.path.dirname(self.path))
            self.path = None
        await self.body_decoder.aclose()

    async def answer(self, key: str | None, payload: bytes) -> tuple[int, str, bytes]:
        """(status, Server-Timing, body) for one request frame's body; every error becomes its
        HTTP status and error body, as the HTTP route's would."""
        started = time.perf_counter()
        status, model, adapter_label = 500, "", ""
        admission = _Admission(self.access, key)
        self.metrics.in_flight.inc()
        try:
            if self.shutdown.draining:
                raise ShuttingDownError("the server is shutting down; send the request again")
            if key is not None:
                self.access.enter(key)
            try:
                if self.body_decoder.inline(payload):
                    body = requests.decode_body(payload, True, NextTokenLogprobsRequest)
                else:
                    body = await self.body_decoder.decode(
                        payload, True, NextTokenLogprobsRequest, client=key, max_rows=self.limits.max_rows
                    )
                if body.shared_memory is None:
                    raise InvalidRequestError(
                        "the local socket answers into shared memory only: name a segment in "
                        "shared_memory, or ask over HTTP",
                        param="shared_memory",
                    )
                served, adapter = self.registry.resolve(body.model)
                model, adapter_label = served.name, adapter or ""
                answer = await self.dense.serve(
                    served, adapter, body, True, self.limits, admission, body_allowed=False
                )
            finally:
                if key is not None:
                    self.access.leave(key)
            status = 200
            return 200, answer.server_timing, b"".join(answer.parts)
        except Exception as exc:
            status, content = error_frame(exc)
            return status, "", content
        except asyncio.CancelledError:
            status = 499  # the client closed the connection first (nginx's code, as over HTTP)
            raise
        finally:
            if admission.reserved:
                self.access.release_answer_bytes(admission.reserved)
            self.metrics.in_flight.dec()
            metrics = self.metrics
            metrics.child(metrics.requests, ROUTE, "LOCAL", model, adapter_label, str(status)).inc()
            metrics.child(metrics.request_duration, ROUTE, model).observe(time.perf_counter() - started)


class _Admission:
    """gateway.dense.service.Admission of a frame: its key's budgets; LocalSocketServer.answer
    gives the answer's bytes back once the answer is made."""

    def __init__(self, access: Access, key: str | None) -> None:
        self.access, self.key = access, key
        self.reserved = 0

    def take_rows(self, rows: int) -> None:
        self.access.take_rows(self.key, rows)

    def reserve_answer_bytes(self, nbytes: int) -> None:
        self.access.reserve_answer_bytes(nbytes)
        self.reserved = nbytes


class _Connection(asyncio.Protocol):
    def __init__(self, server: LocalSocketServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.key: str | None = None
        self.greeted = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.writable = True  # the client reads its answers (the transport's buffer is under its mark)
        self.reading = True
        self.hello_timer: asyncio.TimerHandle | None = None
        # once greeted: a begun frame's deadline, or, with nothing running, the idle one
        self.deadline: asyncio.TimerHandle | None = None
        self.frame_timed = False  # the frame at the buffer's start has its deadline
        self.counted = 0  # bytes of `buffer` counted in the server's unfinished bytes

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        limit = self.server.limits.max_local_connections
        if len(self.server._connections) >= limit:  # each holds a file descriptor, greeted or not
            self._fail(RateLimitError(f"the local socket has {limit} connections open", retry_after=1))
            return
        self.server._connections.add(self)
        loop = asyncio.get_running_loop()
        self.hello_timer = loop.call_later(self.server.limits.header_timeout_s, self.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._connections.discard(self)
        self.buffer.clear()
        self._count_buffer()
        for timer in (self.hello_timer, self.deadline):
            if timer is not None:
                timer.cancel()
        for task in self.tasks:
            task.cancel()

    def pause_writing(self) -> None:
        self.writable = False
        self._update_reading()

    def resume_writing(self) -> None:
        self.writable = True
        self._update_reading()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._frames()
        if self._count_buffer():
            self._watch()

    def _count_buffer(self) -> bool:
        """Count the buffer's bytes in the server's budget; past it, a 429 frame and the end."""
        budget = self.server.unfinished_bytes
        budget.give_back(self.counted)
        self.counted = 0
        if budget.take(len(self.buffer)):
            self.counted = len(self.buffer)
            return True
        self.buffer.clear()
        self._fail(RateLimitError(budget.refusal(), retry_after=1))
        return False

    def _watch(self) -> None:
        """Arm the connection's deadline: a frame begun must be whole within `body_timeout_s`,
        and a connection with nothing running and nothing begun closes after
        `local_idle_timeout_s` (each idle connection holds a file descriptor)."""
        if not self.greeted or self.transport is None or self.transport.is_closing():
            return
        limits = self.server.limits
        if self.reading and self.buffer:  # read on as far as it goes: a frame is partly in
            if not self.frame_timed:
                self.frame_timed = True
                self._arm(limits.body_timeout_s, self._frame_overdue)
        elif self.tasks or self.buffer:  # requests run, or whole frames wait for them
            self._arm(None, self.close)
        else:
            self._arm(limits.local_idle_timeout_s, self.close)

    def _arm(self, delay: float | None, callback: Any) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = None if delay is None else asyncio.get_running_loop().call_later(delay, callback)

    def _frame_overdue(self) -> None:
        limit = self.server.limits.body_timeout_s
        self._fail(RequestTimeoutError(f"a frame did not arrive whole within {limit:g} s"))

    def _frames(self) -> None:
        limit = self.server.limits.max_body_bytes + 64  # a body and its frame
        while self.reading and len(self.buffer) >= 4 and not self.transport.is_closing():
            (length,) = _LENGTH.unpack_from(self.buffer)
            if length > limit:
                self._fail(PayloadTooLargeError(f"a frame of {length} bytes; the limit is {limit}"))
                return
            if len(self.buffer) < 4 + length:
                return
            frame = bytes(self.buffer[4 : 4 + length])
            del self.buffer[: 4 + length]
            self.frame_timed = False
            self._frame(frame)

    def _frame(self, frame: bytes) -> None:
        try:
            message = msgspec.msgpack.decode(frame)
            tag, value = message
        except (msgspec.DecodeError, TypeError, ValueError, RecursionError):
            self._fail(InvalidRequestError("a frame that is not a MessagePack [id, body] array"))
            return
        if not self.greeted:
            self._hello(tag, value)
        elif isinstance(tag, int) and tag > 0 and isinstance(value, bytes):
            task = _start(self._answer(tag, value))
            self.tasks.add(task)
            self.server.shutdown.requests.add(task)
            task.add_done_callback(self._done)
            self._update_reading()
        else:
            self._fail(InvalidRequestError("a request frame is [id > 0, MessagePack body as bin]"))

    def _hello(self, tag: Any, value: Any) -> None:
        if tag != "hello" or not (value is None or isinstance(value, str)):
            self._fail(InvalidRequestError('the first frame is ["hello", api_key or nil]'))
            return
        keyring = self.server.access.keyring
        if keyring.enabled:
            try:
                self.key = keyring.require(value, "connection")
            except AuthenticationError as exc:
                self._fail(exc)
                return
        self.greeted = True
        if self.hello_timer is not None:
            self.hello_timer.cancel()
        self._send(0, 200, "", b"")
        self._watch()

    def _fail(self, exc: Exception) -> None:
        """An answer to the connection itself (id 0), and its end."""
        status, content = error_frame(exc)
        self._send(0, status, "", content)
        self.close()

    async def _answer(self, request_id: int, payload: bytes) -> None:
        status, timing, content = await self.server.answer(self.key, payload)
        self._send(request_id, status, timing, content)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.server.shutdown.requests.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("local socket request failed", exc_info=task.exception())
        self._update_reading()
        self._watch()

    def _update_reading(self) -> None:
        """Read on only while few requests run and the client reads its answers."""
        if self.transport is None or self.transport.is_closing():
            return
        reading = len(self.tasks) < self.server.limits.max_local_in_flight and self.writable
        if reading and not self.reading:
            self.reading = True
            self.transport.resume_reading()
            self._frames()
            self._count_buffer()
        elif not reading and self.reading:
            self.reading = False
            self.transport.pause_reading()

    def _send(self, request_id: int, status: int, timing: str, content: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        frame = msgspec.msgpack.encode([request_id, status, timing, content])
        self.transport.write(_LENGTH.pack(len(frame)) + frame)
