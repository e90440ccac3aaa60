"""Request heads and bodies cost the server a bounded amount, through a real gateway process: a
head larger than `limits.max_head_bytes` is refused as soon as that many bytes are in, a body
must arrive whole within `limits.body_timeout_s`, and a huge body that fails validation is
refused without decoding it twice while /health stays quick."""

from __future__ import annotations

import asyncio
import threading
import time
from urllib.parse import urlsplit

import httpx
import msgspec
import pytest

from tests.launcher import start_mock_gateway


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    settings = "[limits]\nmax_head_bytes = 8192\nbody_timeout_s = 1\n"
    started = start_mock_gateway(tmp_path_factory.mktemp("bodies"), settings, slow_delay_s=0.1)
    yield started
    started.stop()


def _address(gateway) -> tuple[str, int]:
    url = urlsplit(gateway.base_url)
    return url.hostname, url.port


async def _exchange(host: str, port: int, chunks: list[bytes], pause_s: float) -> tuple[bytes, float]:
    """Send `chunks` `pause_s` apart until the server answers or closes; its bytes, and when."""
    reader, writer = await asyncio.open_connection(host, port)
    started, answer = time.monotonic(), b""
    try:
        for chunk in chunks:
            try:
                writer.write(chunk)
                await writer.drain()
            except ConnectionError:
                break
            try:
                answer += await asyncio.wait_for(reader.read(65536), pause_s)
                break
            except TimeoutError:
                continue
        while True:
            data = await asyncio.wait_for(reader.read(65536), 20)
            if not data:
                break
            answer += data
    except ConnectionError:
        pass
    finally:
        writer.close()
    return answer, time.monotonic() - started


def test_a_head_larger_than_the_limit_is_a_431_at_once(gateway):
    host, port = _address(gateway)
    head = b"GET /health HTTP/1.1\r\nhost: gateway\r\nx-big: "
    chunks = [head] + [b"a" * 65536] * 2000  # 128 MiB of one header line, if it were all read
    answer, took = asyncio.run(_exchange(host, port, chunks, 0.01))
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert msgspec.json.decode(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == (
        "request_header_fields_too_large"
    )
    assert took < 10
    assert httpx.get(gateway.base_url + "/health", headers={"x-fine": "a" * 4000}).status_code == 200


def test_a_body_that_trickles_is_a_408_within_the_body_timeout(gateway):
    host, port = _address(gateway)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        b"content-length: 1000\r\n\r\n"
    )
    answer, took = asyncio.run(_exchange(host, port, [head] + [b" "] * 100, 0.2))
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert msgspec.json.decode(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert took < 8
    assert httpx.get(gateway.base_url + "/health").status_code == 200


def test_huge_bodies_that_fail_validation_keep_health_quick(tmp_path):
    """64 MiB dense bodies whose first field is wrong: refused by the typed decode alone (once
    taken for the integral-float retry, which decoded the whole body again untyped, seconds each).
    The default limits: bodies this large arrive within the default body timeout."""
    gateway = start_mock_gateway(tmp_path, "", slow_delay_s=0.1)
    rows = b"[" + b",".join([b"[1,2,3,4,5,6,7,8,9,1,2,3,4,5,6,7]"] * 1_900_000) + b"]"
    body = b'{"model": 5, "input": ' + rows + b"}"
    assert len(body) > 60 * 2**20
    answers, latencies = [], []

    def post():
        answers.append(
            httpx.post(
                gateway.base_url + "/v1/next_token_logprobs",
                content=body,
                headers={"content-type": "application/json"},
                timeout=60,
            )
        )

    senders = [threading.Thread(target=post) for _ in range(3)]
    try:
        _poll_health(gateway, senders, latencies)
    finally:
        gateway.stop()
    assert [a.status_code for a in answers] == [400] * 3
    assert all("`str`" in a.json()["error"]["message"] for a in answers)
    assert max(latencies) < 1.5, sorted(latencies)[-5:]  # 5.6 s before, on 2 cores busy with the suite


def _poll_health(gateway, senders: list[threading.Thread], latencies: list[float]) -> None:
    """Start `senders` and time /health until they are done."""
    for sender in senders:
        sender.start()
    with httpx.Client(base_url=gateway.base_url, timeout=30) as client:
        while any(sender.is_alive() for sender in senders):
            started = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.02)
    for sender in senders:
        sender.join()
