"""logprob_gateway_client.socket_transport against scripted HTTP servers on loopback: bodies byte for byte, pooled
keep-alive connections, servers that close idle connections, and every answer it must refuse."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import numpy as np
import pytest

from logprob_gateway_client import AsyncGatewayLM
from logprob_gateway_client.socket_transport import SocketHTTPClient, UnsupportedResponse, usable_for

Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]  # request -> keep the connection?


class ScriptedServer:
    """Reads each request (headers + Content-Length body) and lets a handler write the answer."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                if not await self.handler(request, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def scripted(handler: Handler) -> AsyncIterator[tuple[ScriptedServer, str]]:
    server = ScriptedServer(handler)
    listener = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        listener.close()
        await listener.wait_closed()


def answer(body: bytes, *headers: str, status: str = "200 OK") -> bytes:
    lines = [f"HTTP/1.1 {status}", f"content-length: {len(body)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


BODY = os.urandom(3_000_000)  # several socket buffers' worth, so it arrives in many reads


async def test_body_arrives_byte_for_byte_and_the_connection_is_reused():
    async def handler(request: bytes, writer: asyncio.StreamWriter) -> bool:
        reply = answer(BODY, "content-type: application/msgpack", "server-timing: rows;dur=1")
        for start in range(0, len(reply), 700_000):  # in pieces, with pauses between them
            writer.write(reply[start : start + 700_000])
            await writer.drain()
            await asyncio.sleep(0.01)
        return True

    async with scripted(handler) as (server, url):
        client = SocketHTTPClient(url + "/api/", {"Accept": "application/msgpack"}, timeout=10)
        first = await client.post("/v1/next_token_logprobs", b"first")
        second = await client.post("/v1/next_token_logprobs", b"second body")
        client.close()
    assert first.status == 200 and bytes(first.body) == BODY and bytes(second.body) == BODY
    assert first.headers["server-timing"] == "rows;dur=1"
    assert server.connections == 1  # keep-alive: the second request reused the first connection
    head, _, body = server.requests[1].partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /api/v1/next_token_logprobs HTTP/1.1"
    assert f"Host: {url.removeprefix('http://')}" in lines and "Accept: application/msgpack" in lines
    assert "Content-Length: 11" in lines and body == b"second body"


async def test_a_connection_the_server_closed_meanwhile_is_replaced():
    async def handler(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(answer(b"ok"))
        await writer.drain()
        return False  # closes after each answer, as a server whose keep-alive timeout passed

    async with scripted(handler) as (server, url):
        client = SocketHTTPClient(url, {}, timeout=10)
        bodies = [bytes((await client.post("/x", b"a")).body) for _ in range(3)]
        client.close()
    assert bodies == [b"ok"] * 3
    assert server.connections == 3 and len(server.requests) == 3  # each request sent exactly once


async def test_connection_close_is_honoured_and_interim_answers_skipped():
    async def handler(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + answer(b"final", "connection: close"))
        await writer.drain()
        await asyncio.sleep(0.05)
        return True  # the server would keep it, but the client must not reuse it

    async with scripted(handler) as (server, url):
        client = SocketHTTPClient(url, {}, timeout=10)
        first = await client.post("/x", b"")
        second = await client.post("/x", b"")
        client.close()
    assert bytes(first.body) == bytes(second.body) == b"final"
    assert server.connections == 2


async def test_error_status_comes_back_with_its_body():
    async def handler(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(answer(b'{"error": {"message": "bad"}}', status="400 Bad Request"))
        return True

    async with scripted(handler) as (_, url):
        client = SocketHTTPClient(url, {}, timeout=10)
        response = await client.post("/x", b"")
        client.close()
    assert response.status == 400 and bytes(response.body) == b'{"error": {"message": "bad"}}'


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        answer(b"x", "content-encoding: gzip"),
        b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nbody until close",
        b"HTTP/1.1 200 OK\r\n" + b"x-filler: " + b"a" * 70_000 + b"\r\n\r\n",
        b"SPDY/3 200 OK\r\ncontent-length: 0\r\n\r\n",
    ],
    ids=["chunked", "compressed", "no-length", "huge-headers", "not-http1"],
)
async def test_answers_it_cannot_read_are_refused(reply):
    async def handler(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(reply)
        await writer.drain()
        return True

    async with scripted(handler) as (_, url):
        client = SocketHTTPClient(url, {}, timeout=10)
        with pytest.raises(UnsupportedResponse):
            await client.post("/x", b"")
        assert not client._idle  # a connection in an unknown state is never reused
        client.close()


async def test_a_truncated_body_fails_and_a_silent_server_times_out():
    async def truncating(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(answer(b"0123456789")[:-4])
        await writer.drain()
        return False

    async with scripted(truncating) as (_, url):
        client = SocketHTTPClient(url, {}, timeout=10)
        with pytest.raises(ConnectionError, match="after 6 of 10 bytes"):
            await client.post("/x", b"")
        assert not client._idle

    async def silent(request: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(5)
        return False

    async with scripted(silent) as (_, url):
        client = SocketHTTPClient(url, {}, timeout=0.3)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError):
            await client.post("/x", b"")
        assert loop.time() - started < 2
        assert not client._idle


def test_used_only_for_plain_http_without_a_proxy(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert usable_for("http://127.0.0.1:8000")
    assert not usable_for("https://gateway.example:8443")
    monkeypatch.setenv("http_proxy", "http://proxy.example:3128")
    assert not usable_for("http://gpu-node:8000")
    monkeypatch.setenv("no_proxy", "gpu-node")
    assert usable_for("http://gpu-node:8000")


async def test_the_client_falls_back_to_httpx_when_answers_are_recoded():
    """Something between client and gateway (a proxy) answers dense requests chunked: the client
    reads them through httpx from then on, with the same numbers."""
    vocabulary = msgspec.msgpack.encode(
        {"vocab_size": 3, "tokens": [b"a", b"b", b"c"], "eos_token_ids": [2], "bos_token_id": None}
    )

    def chunked(body: bytes) -> bytes:
        chunks = [body[i : i + 5] for i in range(0, len(body), 5)]
        framed = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
        return (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/msgpack\r\ntransfer-encoding: chunked\r\n\r\n"
            + framed
        )

    def matrix_for(rows: list[list[int]]) -> np.ndarray:
        return np.array([[-float(sum(r)), -1.0, -2.0] for r in rows], dtype=np.float32)

    async def handler(request: bytes, writer: asyncio.StreamWriter) -> bool:
        head, _, body = request.partition(b"\r\n\r\n")
        if head.startswith(b"GET"):
            writer.write(answer(vocabulary, "content-type: application/msgpack"))
        else:
            rows = msgspec.msgpack.decode(body)["input"]
            document = {"vocab_size": 3, "rows": len(rows), "dtype": "float32"}
            writer.write(
                chunked(msgspec.msgpack.encode({**document, "logprobs": matrix_for(rows).tobytes()}))
            )
        await writer.drain()
        return True

    async with scripted(handler) as (server, url):
        lm = await asyncio.to_thread(AsyncGatewayLM, url, "m", cache_size=0)
        first = await lm.batch_next_token_logprobs([[1], [2, 3]])
        assert not lm._socket_usable  # refused by the socket client: httpx from now on
        second = await lm.batch_next_token_logprobs([[4]])
        await lm.aclose()
    assert np.array_equal(np.asarray(first), matrix_for([[1], [2, 3]]))
    assert np.array_equal(np.asarray(second), matrix_for([[4]]))
    dense = [r for r in server.requests if r.startswith(b"POST")]
    assert len(dense) == 3  # the refused answer, its retry through httpx, the second request
