"""HTTP/1.1 POSTs over plain asyncio sockets, each response body read straight into one buffer.

A dense step is tens of megabytes. httpx (through h11) hands a body over in 64 KiB pieces, each
passing through Python, and on loopback that costs several times the transfer itself
(docs/performance.md). This client sends one request per pooled keep-alive connection and
reads the body with `loop.sock_recv_into` into a buffer of the announced Content-Length.

It speaks only what the gateway answers: a Content-Length body, no transfer or content coding.
Anything else raises `UnsupportedResponse`, and `AsyncGatewayLM` then uses httpx, as it does for
https URLs and proxies. A request on a pooled connection that the server closed meanwhile (its
keep-alive timeout) is sent again once on a new connection, before any of its answer has arrived.
"""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np

_HEAD_LIMIT = 64 * 1024  # status line and headers


class UnsupportedResponse(Exception):
    """The server answered in a form this client does not read (chunked, compressed, no length)."""


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # names lower-cased; a repeated header keeps its last value
    body: memoryview  # writable bytes


def usable_for(base_url: str) -> bool:
    """Plain http, and no proxy configured for the host (httpx would honour the proxy)."""
    parts = urlsplit(base_url)
    if parts.scheme != "http" or not parts.hostname:
        return False
    proxies = urllib.request.getproxies()
    return not (("http" in proxies or "all" in proxies) and not urllib.request.proxy_bypass(parts.hostname))


class _StaleConnection(Exception):
    """A pooled connection closed by the server before any byte of the answer."""


class SocketHTTPClient:
    def __init__(self, base_url: str, headers: Mapping[str, str], timeout: float) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "localhost"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout
        host_header = parts.netloc.rpartition("@")[2]
        self._head = f"Host: {host_header}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._idle: list[socket.socket] = []

    async def post(self, path: str, body: bytes) -> RawResponse:
        request = (
            f"POST {self.prefix}{path} HTTP/1.1\r\n{self._head}Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        async with asyncio.timeout(self.timeout):
            while self._idle:  # a pooled connection; the server may have closed it since
                sock = self._idle.pop()
                try:
                    return await self._exchange(sock, request)
                except _StaleConnection:
                    continue
            try:
                return await self._exchange(await self._connect(), request)
            except _StaleConnection:
                raise ConnectionError("the server closed the connection without answering") from None

    async def _connect(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        error: OSError | None = None
        for family, kind, proto, _, address in await loop.getaddrinfo(
            self.host, self.port, type=socket.SOCK_STREAM
        ):
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, address)
            except OSError as exc:
                sock.close()
                error = exc
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        raise error or OSError(f"cannot resolve {self.host}")

    async def _exchange(self, sock: socket.socket, request: bytes) -> RawResponse:
        """One request and its answer; the socket goes back to the pool only after a whole answer."""
        keep = False
        try:
            response, keep = await self._send_and_read(sock, request)
            return response
        finally:
            if keep:
                self._idle.append(sock)
            else:
                sock.close()

    async def _send_and_read(self, sock: socket.socket, request: bytes) -> tuple[RawResponse, bool]:
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_sendall(sock, request)
        except (BrokenPipeError, ConnectionResetError):
            raise _StaleConnection from None
        head = bytearray(_HEAD_LIMIT)
        view = memoryview(head)
        filled = 0
        while True:  # until the end of a final (non-1xx) header block
            end = head.find(b"\r\n\r\n", 0, filled)
            if end >= 0:
                status, headers = _parse_head(bytes(head[:end]))
                if not 100 <= status < 200:
                    break
                view[: filled - end - 4] = view[end + 4 : filled]  # an interim answer: dropped
                filled -= end + 4
                continue
            if filled == len(head):
                raise UnsupportedResponse("response headers over 64 KiB")
            try:
                n = await loop.sock_recv_into(sock, view[filled:])
            except ConnectionResetError:
                n = 0
            if n == 0:
                if filled == 0:
                    raise _StaleConnection
                raise ConnectionError("the server closed the connection mid-answer")
            filled += n
        if "transfer-encoding" in headers or "content-encoding" in headers:
            raise UnsupportedResponse("a transfer- or content-coded body")
        if "content-length" not in headers:
            raise UnsupportedResponse("no Content-Length")
        length = int(headers["content-length"])
        # numpy's empty buffer is not zero-filled first (bytearray's is): every page is written once.
        body = memoryview(np.empty(length, dtype=np.uint8))
        target = body
        got = min(filled - end - 4, length)
        target[:got] = view[end + 4 : end + 4 + got]
        while got < length:
            n = await loop.sock_recv_into(sock, target[got:])
            if n == 0:
                raise ConnectionError(f"the response ended after {got} of {length} bytes")
            got += n
        keep = headers.get("connection", "").lower() != "close" and filled - end - 4 <= length
        return RawResponse(status, headers, body), keep

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    if not version.startswith("HTTP/1."):
        raise UnsupportedResponse(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(rest[:3]), headers
