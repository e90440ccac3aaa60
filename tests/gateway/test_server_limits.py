"""The server's limits per connection, through real gateway processes: request heads must arrive
in time (`limits.header_timeout_s`), and clients that never read their dense answers are cut off
(`limits.write_stall_timeout_s`) within the default server-wide budget of answer bytes
(`limits.max_answer_bytes`), measured as the gateway's peak RSS on the real model. The two
timeouts are shortened (the defaults' 15 s and 30 s would be waited out): what a test waits for
is the timeout its gateway was given."""

from __future__ import annotations

import asyncio
import socket
import time
from urllib.parse import urlsplit

import httpx
import msgspec
import pytest

from bench.launcher import GatewayProcess, start_gateway
from gateway.settings import Limits
from tests.conftest import MODEL, memory_kib, start_real_gateway

LIMITS = Limits()  # the defaults under test: the budget of answer bytes
HEADER_TIMEOUT_S = 3
WRITE_STALL_TIMEOUT_S = 5


def _address(gateway: GatewayProcess) -> tuple[str, int]:
    url = urlsplit(gateway.base_url)
    return url.hostname or "127.0.0.1", url.port or 80


@pytest.fixture
def mock_gateway(tmp_path):
    config = tmp_path / "gateway.toml"
    config.write_text(
        f"[limits]\nheader_timeout_s = {HEADER_TIMEOUT_S}\n\n"
        '[[models]]\nname = "mock"\nmodel = "smollm2-135m"\nbackend = "mock"\n'
    )
    gateway = start_gateway(["--config", str(config)], tmp_path / "gateway.log")
    yield gateway
    gateway.stop()


async def _trickle(host: str, port: int, until: float, send: bool) -> tuple[bytes, float | None]:
    """One byte of a request head per second (or nothing); what the server sent, and when it closed."""
    reader, writer = await asyncio.open_connection(host, port)
    head = b"GET /health HTTP/1.1\r\nhost: gateway\r\nx-slow: " + b"a" * 200
    answer, closed_at, sent = b"", None, 0
    try:
        while time.monotonic() < until:
            if send and sent < len(head):
                try:
                    writer.write(head[sent : sent + 1])
                    await writer.drain()
                    sent += 1
                except ConnectionError:
                    closed_at = time.monotonic()
                    break
            try:
                chunk = await asyncio.wait_for(reader.read(65536), 1.0)
            except TimeoutError:
                continue
            except ConnectionError:
                closed_at = time.monotonic()
                break
            if not chunk:
                closed_at = time.monotonic()
                break
            answer += chunk
    finally:
        writer.close()
    return answer, closed_at


def test_request_heads_that_trickle_are_closed_with_408(mock_gateway):
    host, port = _address(mock_gateway)
    timeout = HEADER_TIMEOUT_S

    async def run():
        started = time.monotonic()
        until = started + timeout + 4
        slow = [asyncio.create_task(_trickle(host, port, until, send=True)) for _ in range(50)]
        silent = [asyncio.create_task(_trickle(host, port, until, send=False)) for _ in range(10)]
        served = []
        async with httpx.AsyncClient(base_url=mock_gateway.base_url, timeout=5) as client:
            while time.monotonic() < until - 1:
                served.append((await client.get("/health")).status_code)
                await asyncio.sleep(1)
        return started, await asyncio.gather(*slow, *silent), served

    started, results, served = asyncio.run(run())
    assert served and all(status == 200 for status in served)  # others are served meanwhile
    for answer, closed_at in results:
        assert closed_at is not None, "a connection without a complete head is still open"
        assert closed_at - started >= timeout - 1  # not before its deadline
        assert answer.startswith(b"HTTP/1.1 408 ")
        error = msgspec.json.decode(answer.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"


def _raw_request(host: str, port: int, body: bytes) -> socket.socket:
    """A dense request sent on a socket that will not be read (a small receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, port))
    head = (
        f"POST /v1/next_token_logprobs HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _read_all(sock: socket.socket, limit: int) -> tuple[bytes, bool]:
    """Up to `limit` bytes of what the server sent; and whether the connection ended before."""
    sock.settimeout(10)
    received = bytearray()
    try:
        while len(received) < limit:
            chunk = sock.recv(1 << 20)
            if not chunk:
                return bytes(received), True
            received += chunk
    except ConnectionResetError:
        return bytes(received), True
    except TimeoutError:
        return bytes(received), False
    return bytes(received), False


@pytest.mark.slow
def test_clients_that_never_read_are_cut_off_within_the_answer_budget(model_dir, tmp_path):
    """Eight clients ask for 1,024 rows of base64 float32 each (about 270 MB of body, 700 MB
    reserved) and never read. Unbounded, the gateway held all eight answers (over 3.5 GB) for as long
    as the clients stayed; now it admits what fits its budget (2 GiB: three), answers the rest 429 +
    Retry-After, cuts the admitted ones off once they have read nothing for the stall timeout, and
    serves others throughout. Peak RSS above the idle gateway's stays under the budget + 512 MiB."""
    gateway = start_real_gateway(
        model_dir, tmp_path, f"[limits]\nwrite_stall_timeout_s = {WRITE_STALL_TIMEOUT_S}\n"
    )
    socks: list[socket.socket] = []
    try:
        host, port = _address(gateway)
        pid = gateway.process.pid
        rows = [[1, 2, 3]] * 1024  # one row for the engine (rows are de-duplicated), 1,024 answered
        body = msgspec.json.encode(
            {"model": MODEL, "input": rows, "encoding_format": "base64", "dtype": "float32"}
        )
        idle_kib = memory_kib(pid, "VmRSS")
        socks += [_raw_request(host, port, body) for _ in range(8)]
        time.sleep(3)
        begun = time.monotonic()
        while time.monotonic() - begun < WRITE_STALL_TIMEOUT_S + 6:
            small = httpx.post(
                gateway.base_url + "/v1/next_token_logprobs",
                json={"model": MODEL, "input": [[1, 2]], "encoding_format": "base64"},
                timeout=60,
            )
            assert small.status_code == 200  # others are served throughout
            time.sleep(2)
        peak_kib = memory_kib(pid, "VmHWM")
        answers = [_read_all(sock, limit=64 * 2**20) for sock in socks]
        for i, (data, ended) in enumerate(answers):
            if not ended and not data.startswith(b"HTTP/1.1 429 "):
                # Begun late on a busy machine, or held: unread for a stall timeout again, it ends.
                time.sleep(WRITE_STALL_TIMEOUT_S + 3)
                more, ended = _read_all(socks[i], limit=64 * 2**20)
                answers[i] = (data + more, ended)
    finally:
        for sock in socks:
            sock.close()
        gateway.stop()
    # A cut connection may end in a reset that loses what the client's kernel held: no status then.
    refused = [data for data, _ in answers if data.startswith(b"HTTP/1.1 429 ")]
    cut = [ended for data, ended in answers if not data.startswith(b"HTTP/1.1 429 ")]
    assert cut and all(cut), "an answer nobody read is still held by the gateway"
    assert refused and all(b"retry-after: " in data.lower() for data in refused)
    assert (peak_kib - idle_kib) * 1024 < LIMITS.max_answer_bytes + 512 * 2**20
