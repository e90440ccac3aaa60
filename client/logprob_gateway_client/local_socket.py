"""Dense calls over the gateway's Unix socket, for a client on its host (gateway/dense/local_socket.py
on the other side).

An answer the gateway wrote into this process's memory names, in its `Logprob-Gateway-Socket`
header, a socket on the gateway's host; the client connects, says hello with its API key, and
sends later dense calls there: the same MessagePack bodies and answers as over HTTP, in frames of
a 4-byte little-endian length and a MessagePack array, without an HTTP exchange each time.

A connection carries one call at a time; concurrent calls take connections of their own from a
small pool. The sockets are plain non-blocking sockets driven by whichever event loop calls, so
the pool outlives event loops and closes without one.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import msgspec

from logprob_gateway_client.wire import error_from

HEADER = "Logprob-Gateway-Socket"  # on an answer in shared memory: where the socket is
_LENGTH = struct.Struct("<I")
_DECODER = msgspec.msgpack.Decoder(tuple[int, int, str, bytes])
_ENCODER = msgspec.msgpack.Encoder()
_CALL_ID = 1  # one call at a time per connection: every call can carry the same id


class LocalSocketLost(ConnectionError):
    """The connection closed before the call's answer came: the call may be sent again elsewhere."""


class LocalSocket:
    def __init__(self, path: str, api_key: str | None, timeout: float) -> None:
        self.path = path
        self._api_key = api_key
        self._timeout = timeout
        self._idle: list[socket.socket] = []

    async def connect(self) -> None:
        """One greeted connection, kept idle: OSError when the socket cannot be reached, the
        gateway's error (GatewayClientError) when it refuses the key."""
        self._idle.append(await self._connect())

    async def call(self, body: bytes) -> tuple[bytes, str]:
        """The answer's body and Server-Timing; the gateway's error as over HTTP."""
        sock = self._idle.pop() if self._idle else await self._connect()
        try:
            answered, status, timing, content = await _exchange(sock, [_CALL_ID, body])
        except BaseException:  # cut short (cancelled, say): what the gateway sends next is unknown
            sock.close()
            raise
        if answered == _CALL_ID:
            self._idle.append(sock)
        else:  # an answer to the connection itself (id 0): the gateway closes it
            sock.close()
        if status >= 400:
            raise error_from(status, content)
        return content, timing

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()

    async def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, self.path), self._timeout)
            hello = _exchange(sock, ["hello", self._api_key])
            _, status, _, content = await asyncio.wait_for(hello, self._timeout)
        except BaseException:
            sock.close()
            raise
        if status != 200:
            sock.close()
            raise error_from(status, content)
        return sock


async def _exchange(sock: socket.socket, message: list) -> tuple[int, int, str, bytes]:
    """Send one frame and read the one that answers it: (id, status, Server-Timing, body)."""
    loop = asyncio.get_running_loop()
    frame = _ENCODER.encode(message)
    received = bytearray()
    try:
        await loop.sock_sendall(sock, _LENGTH.pack(len(frame)) + frame)
        while len(received) < 4 or len(received) < 4 + _LENGTH.unpack_from(received)[0]:
            chunk = await loop.sock_recv(sock, 1 << 16)
            if not chunk:
                raise LocalSocketLost("the gateway closed its local socket")
            received += chunk
    except ConnectionError as exc:  # reset, broken pipe: the gateway went away
        raise LocalSocketLost(f"the gateway's local socket: {exc}") from exc
    return _DECODER.decode(received[4:])
