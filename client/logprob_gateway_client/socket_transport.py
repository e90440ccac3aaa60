"""An httpx transport for plain-http URLs that reads each response body straight into one buffer.

A dense answer is tens of megabytes. httpx's own transport (through h11) hands a body over in
64 KiB pieces, each passing through Python, and on loopback that costs several times the transfer
itself (docs/performance.md). `SocketTransport` sends each request over a pooled keep-alive
connection of plain asyncio sockets and reads the body with `loop.sock_recv_into` into one buffer
of the announced Content-Length; the response's stream yields that buffer as its only chunk, which
httpx passes on as it is (`wire.read_into_buffer` keeps it without a copy). httpx's client does
the rest (base URL, headers, timeouts, the response), so `AsyncGatewayLM` has one path, and every
error it sees from the network is an httpx exception.

It reads only what the gateway answers: HTTP/1.x, a Content-Length body, no transfer or content
coding, headers within 64 KiB. An answer in any other form (something between client and gateway
recodes answers) is not read: the request is sent again through httpx's own transport, which
serves every later request too. A request on a pooled connection that the server closed
meanwhile (its keep-alive timeout), before any byte of the answer, is sent again on another
connection.
"""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import urlsplit

import httpx
import numpy as np

_HEAD_LIMIT = 64 * 1024  # status line and headers
_Origin = tuple[str, int]


def usable_for(base_url: str) -> bool:
    """Plain http, and no proxy configured for the host (httpx would honour the proxy)."""
    parts = urlsplit(base_url)
    if parts.scheme != "http" or not parts.hostname:
        return False
    proxies = urllib.request.getproxies()
    return not (("http" in proxies or "all" in proxies) and not urllib.request.proxy_bypass(parts.hostname))


class _Unsupported(Exception):
    """An answer this transport does not read (chunked, compressed, no length); httpx's does."""


class _Stale(Exception):
    """A pooled connection closed by the server before any byte of the answer."""


class _WholeBody(httpx.AsyncByteStream):
    """A body read already, handed over as one chunk."""

    def __init__(self, body: memoryview) -> None:
        self._body: memoryview | None = body

    async def __aiter__(self) -> AsyncIterator[bytes]:
        # Not kept once handed over (nor once closed): httpx's response and its stream refer to each
        # other, so only the garbage collector frees them, later than the reader may drop the body.
        body, self._body = self._body, None
        if body:
            # httpx passes chunks on untouched (aiter_raw without a chunk size): no copy to bytes.
            yield cast(bytes, body)

    async def aclose(self) -> None:
        self._body = None


class SocketTransport(httpx.AsyncBaseTransport):
    """httpx's transport for `http://` requests, reading each answer into one numpy-allocated
    buffer. Honours the request's timeouts (httpx's `timeout` extension) and raises:

    - httpx.ConnectError / ConnectTimeout: no connection to the server ("connect" timeout);
    - httpx.WriteError / WriteTimeout: the request could not be sent ("write");
    - httpx.RemoteProtocolError: the server closed the connection before the whole answer (a
      reset counts as closed), or a status line or Content-Length that is not a number;
    - httpx.ReadError / ReadTimeout: any other socket error while reading, or no byte for
      "read" seconds.

    It opens connections as they are needed (no pool limit, so no PoolTimeout). `reads_sockets`
    turns False for good once an answer needed httpx's own transport. Connections are plain
    sockets; `AsyncGatewayLM` builds a new transport for each event loop all the same, as
    httpx's transport it falls back to holds connections of one loop."""

    def __init__(self) -> None:
        self._idle: dict[_Origin, list[socket.socket]] = {}
        self._httpx: httpx.AsyncHTTPTransport | None = None
        self.reads_sockets = True

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.reads_sockets and request.url.scheme == "http":
            try:
                return await self._send(request)
            except _Unsupported:
                self.reads_sockets = False
                self.close_sockets()
        if self._httpx is None:
            self._httpx = httpx.AsyncHTTPTransport()
        return await self._httpx.handle_async_request(request)

    async def _send(self, request: httpx.Request) -> httpx.Response:
        origin = (request.url.raw_host.decode("ascii"), request.url.port or 80)
        message = _request_bytes(request, await request.aread())
        idle = self._idle.setdefault(origin, [])
        while idle:  # a pooled connection; the server may have closed it since
            try:
                return await self._exchange(idle.pop(), origin, message, request, pooled=True)
            except _Stale:
                continue
        sock = await _connect(origin, request)
        return await self._exchange(sock, origin, message, request, pooled=False)

    async def _exchange(
        self, sock: socket.socket, origin: _Origin, message: bytes, request: httpx.Request, pooled: bool
    ) -> httpx.Response:
        """One request and its answer; the socket goes back to the pool only after a whole answer."""
        keep = False
        try:
            response, keep = await _send_and_read(sock, message, request, pooled)
            return response
        finally:
            if keep and self.reads_sockets:
                self._idle.setdefault(origin, []).append(sock)
            else:
                sock.close()

    def close_sockets(self) -> None:
        """Closes the idle connections (synchronous: also from outside their event loop)."""
        for idle in self._idle.values():
            while idle:
                idle.pop().close()

    async def aclose(self) -> None:
        self.close_sockets()
        if self._httpx is not None:
            await self._httpx.aclose()


def _request_bytes(request: httpx.Request, body: bytes) -> bytes:
    """The request as sent: its headers as httpx's client built them, the body whole with its length."""
    head = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
    head += [
        b"%s: %s" % (name, value)
        for name, value in request.headers.raw
        if name.lower() not in (b"content-length", b"transfer-encoding")
    ]
    if body or request.method in ("POST", "PUT", "PATCH"):
        head.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def _connect(origin: _Origin, request: httpx.Request) -> socket.socket:
    host, port = origin
    timeout = request.extensions.get("timeout", {}).get("connect")
    loop = asyncio.get_running_loop()
    error: OSError | None = None
    try:
        async with asyncio.timeout(timeout):
            for family, kind, proto, _, address in await loop.getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            ):
                sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                try:
                    await loop.sock_connect(sock, address)
                except OSError as exc:  # the next address, if any
                    sock.close()
                    error = exc
                    continue
                except BaseException:  # cancelled (the timeout among others)
                    sock.close()
                    raise
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
    except TimeoutError as exc:
        raise httpx.ConnectTimeout(f"no connection to {host}:{port} in {timeout} s", request=request) from exc
    except OSError as exc:  # the name did not resolve
        raise httpx.ConnectError(f"{host}:{port}: {exc}", request=request) from exc
    kind_of = httpx.ConnectTimeout if isinstance(error, TimeoutError) else httpx.ConnectError
    raise kind_of(f"{host}:{port}: {error or 'no address'}", request=request) from error


async def _recv_into(
    sock: socket.socket, view: memoryview, timeout: float | None, request: httpx.Request
) -> int:
    """Bytes read into `view`; 0 once the server closed the connection (a reset counts as that).
    The timer is armed only when the read has to wait: most reads of a large body find data."""
    try:
        try:
            return sock.recv_into(view)
        except BlockingIOError:
            pass
        async with asyncio.timeout(timeout):
            return await asyncio.get_running_loop().sock_recv_into(sock, view)
    except ConnectionResetError:
        return 0
    except TimeoutError as exc:
        raise httpx.ReadTimeout(f"no answer for {timeout} s", request=request) from exc
    except OSError as exc:
        raise httpx.ReadError(str(exc), request=request) from exc


async def _send_and_read(
    sock: socket.socket, message: bytes, request: httpx.Request, pooled: bool
) -> tuple[httpx.Response, bool]:
    """The answer, and whether the connection may serve another request."""
    timeouts = request.extensions.get("timeout", {})
    try:
        async with asyncio.timeout(timeouts.get("write")):
            await asyncio.get_running_loop().sock_sendall(sock, message)
    except TimeoutError as exc:
        raise httpx.WriteTimeout(f"request not sent in {timeouts.get('write')} s", request=request) from exc
    except OSError as exc:
        if pooled:
            raise _Stale from None
        raise httpx.WriteError(str(exc), request=request) from exc
    read_timeout = timeouts.get("read")
    head = bytearray(_HEAD_LIMIT)
    view = memoryview(head)
    filled = 0
    while True:  # until the end of a final (non-1xx) header block
        end = head.find(b"\r\n\r\n", 0, filled)
        if end >= 0:
            version, status, reason, fields = _parse_head(bytes(head[:end]), request)
            if not 100 <= status < 200:
                break
            view[: filled - end - 4] = view[end + 4 : filled]  # an interim answer: dropped
            filled -= end + 4
            continue
        if filled == len(head):
            raise _Unsupported("response headers over 64 KiB")
        n = await _recv_into(sock, view[filled:], read_timeout, request)
        if n == 0:
            if filled == 0 and pooled:
                raise _Stale
            where = "without sending a response" if filled == 0 else "in the middle of the headers"
            raise httpx.RemoteProtocolError(f"the server disconnected {where}", request=request)
        filled += n
    headers = {name.lower(): value for name, value in fields}
    start = end + 4
    length = _body_length(request, status, headers)
    # numpy's empty buffer is not zero-filled first (bytearray's is): every page is written once.
    body = memoryview(np.empty(length, dtype=np.uint8))
    got = min(filled - start, length)
    body[:got] = view[start : start + got]
    while got < length:
        n = await _recv_into(sock, body[got:], read_timeout, request)
        if n == 0:
            raise httpx.RemoteProtocolError(
                f"the response ended after {got} of {length} bytes", request=request
            )
        got += n
    connection = headers.get(b"connection", b"").lower()
    keep = (
        b"close" not in connection
        and (version != b"HTTP/1.0" or b"keep-alive" in connection)
        and filled - start <= length  # nothing arrived past the answer
    )
    response = httpx.Response(
        status,
        headers=fields,
        stream=_WholeBody(body),
        request=request,
        extensions={"http_version": version, "reason_phrase": reason},
    )
    return response, keep


def _body_length(request: httpx.Request, status: int, headers: dict[bytes, bytes]) -> int:
    if request.method == "HEAD" or status in (204, 304):
        return 0
    if b"transfer-encoding" in headers or b"content-encoding" in headers:
        raise _Unsupported("a transfer- or content-coded body")
    if b"content-length" not in headers:
        raise _Unsupported("no Content-Length")
    value = headers[b"content-length"]
    if not value.strip().isdigit():
        raise httpx.RemoteProtocolError(f"Content-Length {value[:40]!r}", request=request)
    return int(value)


def _parse_head(head: bytes, request: httpx.Request) -> tuple[bytes, int, bytes, list[tuple[bytes, bytes]]]:
    """HTTP version, status, reason phrase and header fields (names as sent, repeats kept)."""
    status_line, *lines = head.split(b"\r\n")
    version, _, rest = status_line.partition(b" ")
    if not version.startswith(b"HTTP/1."):
        raise _Unsupported(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    code, _, reason = rest.partition(b" ")
    if len(code) != 3 or not code.isdigit():
        raise httpx.RemoteProtocolError(f"a malformed status line: {status_line[:80]!r}", request=request)
    fields = []
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():  # folded or malformed: left to h11
            raise _Unsupported(f"a header line this reader does not parse: {line[:80]!r}")
        fields.append((name, value.strip()))
    return version, int(code), reason, fields
