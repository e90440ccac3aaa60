"""logprob_gateway_client.socket_transport, through an httpx.AsyncClient, against scripted HTTP
servers on loopback: bodies byte for byte in one chunk, pooled keep-alive connections, servers
that close idle connections, failures as httpx's exceptions, and the answers it hands to httpx's
own transport."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import os
import socket
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import msgspec
import numpy as np
import pytest

from logprob_gateway_client import AsyncGatewayLM
from logprob_gateway_client.socket_transport import SocketTransport, usable_for
from logprob_gateway_client.wire import read_into_buffer

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


def client_of(url: str, transport: SocketTransport, timeout: float = 10, **headers: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, transport=transport, timeout=timeout, headers=headers)


def idle_sockets(transport: SocketTransport) -> list[socket.socket]:
    return [sock for idle in transport._idle.values() for sock in idle]


BODY = os.urandom(3_000_000)  # several socket buffers' worth, so it arrives in many reads


async def test_body_arrives_byte_for_byte_in_one_chunk_and_the_connection_is_reused():
    async def handler(request: bytes, writer: asyncio.StreamWriter) -> bool:
        reply = answer(BODY, "content-type: application/msgpack", "server-timing: rows;dur=1")
        for start in range(0, len(reply), 700_000):  # in pieces, with pauses between them
            writer.write(reply[start : start + 700_000])
            await writer.drain()
            await asyncio.sleep(0.01)
        return True

    async with scripted(handler) as (server, url):
        transport = SocketTransport()
        async with client_of(url + "/api/", transport, Accept="application/msgpack") as client:
            async with client.stream("POST", "/v1/next_token_logprobs", content=b"first") as first:
                chunks = [chunk async for chunk in first.aiter_raw()]
            async with client.stream("POST", "/v1/next_token_logprobs", content=b"second body") as second:
                body = await read_into_buffer(second)
            (sock,) = idle_sockets(transport)
        assert sock.fileno() == -1  # closing the client closed the pooled connection
    assert first.status_code == 200 and first.headers["server-timing"] == "rows;dur=1"
    # the whole body as one chunk, in the buffer it was read into: numpy's, no copy on the way
    assert len(chunks) == 1 and isinstance(chunks[0], memoryview) and bytes(chunks[0]) == BODY
    assert isinstance(chunks[0].obj, np.ndarray)
    assert isinstance(body, memoryview) and isinstance(body.obj, np.ndarray) and bytes(body) == BODY
    # the response, alive until the collector runs (it refers to its stream and back), keeps none
    read_into = weakref.ref(body.obj)
    del body
    assert read_into() is None and second.status_code == 200
    assert server.connections == 1  # keep-alive: the second request reused the first connection
    head, _, sent = server.requests[1].partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /api/v1/next_token_logprobs HTTP/1.1"
    assert f"Host: {url.removeprefix('http://')}" in lines and "Accept: application/msgpack" in lines
    assert "Content-Length: 11" in lines and sent == b"second body"


async def test_httpx_own_transport_fills_one_buffer_from_many_chunks():
    """The same answer through httpx's transport (https URLs, proxies): the same bytes, gathered."""

    async def handler(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(answer(BODY))
        await writer.drain()
        return True

    async with scripted(handler) as (_, url), httpx.AsyncClient(base_url=url) as client:
        async with client.stream("POST", "/x", content=b"") as response:
            body = await read_into_buffer(response)
    assert isinstance(body, memoryview) and isinstance(body.obj, bytearray) and bytes(body) == BODY


async def test_a_connection_the_server_closed_meanwhile_is_replaced():
    async def handler(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(answer(b"ok"))
        await writer.drain()
        return False  # closes after each answer, as a server whose keep-alive timeout passed

    async with scripted(handler) as (server, url):
        async with client_of(url, SocketTransport()) as client:
            bodies = [(await client.post("/x", content=b"a")).content for _ in range(3)]
    assert bodies == [b"ok"] * 3
    assert server.connections == 3 and len(server.requests) == 3  # each request sent exactly once


async def test_a_new_connection_closed_without_an_answer_is_not_retried():
    async def handler(request: bytes, writer: asyncio.StreamWriter) -> bool:
        return False  # closes without answering

    async with scripted(handler) as (server, url):
        transport = SocketTransport()
        async with client_of(url, transport) as client:
            with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
                await client.post("/x", content=b"a")
            assert not idle_sockets(transport)
    assert len(server.requests) == 1


async def test_connection_close_is_honoured_and_interim_answers_skipped():
    async def handler(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + answer(b"final", "connection: close"))
        await writer.drain()
        await asyncio.sleep(0.05)
        return True  # the server would keep it, but the client must not reuse it

    async with scripted(handler) as (server, url):
        async with client_of(url, SocketTransport()) as client:
            first = await client.post("/x", content=b"")
            second = await client.post("/x", content=b"")
    assert first.status_code == second.status_code == 200
    assert first.content == second.content == b"final"
    assert server.connections == 2


async def test_error_status_comes_back_with_its_body():
    async def handler(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(answer(b'{"error": {"message": "bad"}}', status="400 Bad Request"))
        return True

    async with scripted(handler) as (_, url):
        async with client_of(url, SocketTransport()) as client:
            response = await client.post("/x", content=b"")
    assert response.status_code == 400 and response.reason_phrase == "Bad Request"
    assert response.content == b'{"error": {"message": "bad"}}'


@pytest.mark.parametrize(
    ("reply", "keep", "body"),
    [
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", True, b"ok"),
        (answer(gzip.compress(b"unzipped"), "content-encoding: gzip"), True, b"unzipped"),
        (b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nbody until close", False, b"body until close"),
        (b"HTTP/1.1 200 OK\r\nx-filler: " + b"a" * 70_000 + b"\r\ncontent-length: 2\r\n\r\nok", True, b"ok"),
        (b"SPDY/3 200 OK\r\ncontent-length: 0\r\n\r\n", True, None),  # httpx refuses it too
    ],
    ids=["chunked", "compressed", "no-length", "huge-headers", "not-http1"],
)
async def test_answers_it_cannot_read_go_through_httpx_from_then_on(reply, keep, body):
    async def handler(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(reply)
        await writer.drain()
        return keep

    async with scripted(handler) as (server, url):
        transport = SocketTransport()
        async with client_of(url, transport) as client:
            for sent in (2, 3):  # the refused answer and its retry through httpx; then httpx alone
                if body is None:
                    with pytest.raises(httpx.RemoteProtocolError):
                        await client.post("/x", content=b"")
                else:
                    assert (await client.post("/x", content=b"")).content == body
                assert not transport.reads_sockets and len(server.requests) == sent
                assert not idle_sockets(transport)  # a connection in an unknown state is never reused


async def test_a_truncated_body_fails_and_a_silent_server_times_out():
    async def truncating(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(answer(b"0123456789")[:-4])
        await writer.drain()
        return False

    async with scripted(truncating) as (_, url):
        transport = SocketTransport()
        async with client_of(url, transport) as client:
            with pytest.raises(httpx.RemoteProtocolError, match="after 6 of 10 bytes"):
                await client.post("/x", content=b"")
            assert not idle_sockets(transport) and transport.reads_sockets

    async def silent(request: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(5)
        return False

    async with scripted(silent) as (_, url):
        transport = SocketTransport()
        loop = asyncio.get_running_loop()
        async with client_of(url, transport, timeout=0.3) as client:
            started = loop.time()
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/x", content=b"")
            assert loop.time() - started < 2
            # a request's own timeout (httpx's `timeout` extension) wins over the client's
            started = loop.time()
            with pytest.raises(httpx.TimeoutException):
                await client.post("/x", content=b"", timeout=httpx.Timeout(10, read=0.2))
            assert loop.time() - started < 2
            assert not idle_sockets(transport)


async def test_no_server_is_a_connect_error():
    with socket.socket() as placeholder:  # a port nothing listens on once it is closed
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    async with client_of(f"http://127.0.0.1:{port}", SocketTransport()) as client:
        with pytest.raises(httpx.ConnectError):
            await client.post("/x", content=b"")


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
            packed = msgspec.msgpack.decode(body)["input"]  # the client's packed rows
            ids, ends = np.frombuffer(packed["ids"], "<i4").tolist(), np.cumsum(packed["lengths"])
            rows = [ids[end - length : end] for end, length in zip(ends, packed["lengths"], strict=True)]
            document = {"model": "m", "vocab_size": 3, "rows": len(rows), "dtype": "float32"}
            usage = {"prompt_tokens": 1, "total_tokens": 1}
            writer.write(
                chunked(
                    msgspec.msgpack.encode(
                        {**document, "usage": usage, "logprobs": matrix_for(rows).tobytes()}
                    )
                )
            )
        await writer.drain()
        return True

    async with scripted(handler) as (server, url):
        lm = await asyncio.to_thread(AsyncGatewayLM, url, "m", cache_size=0)
        first = await lm.batch_next_token_logprobs([[1], [2, 3]])
        assert lm._transport is not None and not lm._transport.reads_sockets  # httpx's from now on
        second = await lm.batch_next_token_logprobs([[4]])
        await lm.aclose()
    assert not lm._socket_usable  # remembered by the next client the LM builds
    assert np.array_equal(np.asarray(first), matrix_for([[1], [2, 3]]))
    assert np.array_equal(np.asarray(second), matrix_for([[4]]))
    dense = [r for r in server.requests if r.startswith(b"POST")]
    assert len(dense) == 3  # the refused answer, its retry through httpx, the second request
