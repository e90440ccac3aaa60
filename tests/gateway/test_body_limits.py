"""Request heads and bodies cost the server a bounded amount, through a real gateway process: a
head larger than `limits.max_head_bytes` is refused as soon as that many bytes are in, a body
must arrive whole within `limits.body_timeout_s`, half-sent bodies stay within
`limits.max_unfinished_body_bytes`, and huge bodies are decoded off the event loop (`/health`
stays quick)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from urllib.parse import urlsplit

import httpx
import msgspec
import pytest

from bench.launcher import start_mock_gateway
from tests.conftest import memory_kib
from tests.gateway.health_probe import health_latencies_during


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    # bodies of 4 KiB or more are decoded by the worker, smaller ones on the loop
    settings = "[limits]\nmax_head_bytes = 8192\nbody_timeout_s = 1\ndecode_worker_bytes = 4096\n"
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
    assert took < 2  # at once: 2,000 chunks would take 20 s to send
    assert httpx.get(gateway.base_url + "/health", headers={"x-fine": "a" * 4000}).status_code == 200


def _chunked_completion(chunk_bytes: int) -> bytes:
    """A completion request whose body is chunked `chunk_bytes` at a time, up to its last chunk."""
    body = json.dumps({"model": "mock", "prompt": "x" * 2000, "max_tokens": 1}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    )
    pieces = [body[i : i + chunk_bytes] for i in range(0, len(body), chunk_bytes)]
    return head + b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n"


@pytest.mark.hostile
def test_chunked_trailers_larger_than_a_head_are_a_431_at_once(gateway):
    host, port = _address(gateway)
    # 128 MiB of one trailer line, if it were all read: its parse would take minutes of CPU
    chunks = [_chunked_completion(512) + b"x-trailer: "] + [b"a" * 65536] * 2000
    answer, took = asyncio.run(_exchange(host, port, chunks, 0.01))
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert msgspec.json.decode(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == (
        "request_header_fields_too_large"
    )
    assert took < 2
    # Chunks of 16 bytes (framing a third of the bytes) and a short trailer are served.
    fine = _chunked_completion(16) + b"x-trailer: fine\r\n\r\n"
    answer, _ = asyncio.run(_exchange(host, port, [fine], 10))
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert httpx.get(gateway.base_url + "/health").status_code == 200


@pytest.mark.hostile
def test_a_chunked_body_past_its_routes_limit_is_a_413_before_the_rest_is_read(gateway):
    """Another route than the dense one takes 4 MiB (max_non_dense_body_bytes as it ships): a
    chunked body says no length up front, so the 413 comes once 4 MiB are in, not at its end."""
    host, port = _address(gateway)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    piece = b"%x\r\n%s\r\n" % (2**20, b" " * 2**20)
    chunks = [head] + [piece] * 60 + [b"0\r\n\r\n"]  # 60 MiB of a body, if it were all read

    async def send() -> tuple[bytes, int]:
        reader, writer = await asyncio.open_connection(host, port)
        sent, answer = 0, b""
        try:
            for chunk in chunks:
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
                with contextlib.suppress(TimeoutError):
                    answer = await asyncio.wait_for(reader.read(65536), 0.01)
                    break
            answer += await asyncio.wait_for(reader.read(65536), 10)
        except ConnectionError:
            pass
        finally:
            writer.close()
        return answer, sent

    answer, sent = asyncio.run(send())
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert (
        "max_non_dense_body_bytes" in msgspec.json.decode(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    )
    assert sent < 16 * 2**20, sent
    assert httpx.get(gateway.base_url + "/health").status_code == 200


@pytest.mark.hostile
def test_garbage_pipelined_after_a_request_is_a_400_after_that_requests_answer(gateway):
    host, port = _address(gateway)
    body = json.dumps({"model": "slow", "prompt": "hi", "max_tokens": 3}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    answer, _ = asyncio.run(_exchange(host, port, [request + b"NOT HTTP AT ALL\r\n\r\n"], 5))
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    first, rest = answer.split(b"HTTP/1.1 400 ", 1)
    assert msgspec.json.decode(first.split(b"\r\n\r\n", 1)[1])["choices"][0]["text"]
    assert msgspec.json.decode(rest.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"
    assert "Exception in ASGI application" not in gateway.log_path.read_text()


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


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
def test_rows_decoded_by_the_worker_are_answered_as_rows_decoded_in_process(gateway, binary):
    rows = [[(7 * i + j) % 500 + 1 for j in range(1 + i % 5)] for i in range(600)]

    def answer(rows: list[list[int]]) -> list[str]:
        request = {"model": "mock", "input": rows, "encoding_format": "base64"}
        body = msgspec.msgpack.encode(request) if binary else msgspec.json.encode(request)
        media_type = "application/msgpack" if binary else "application/json"
        reply = httpx.post(
            gateway.base_url + "/v1/next_token_logprobs",
            content=body,
            headers={"content-type": media_type, "accept": "application/json"},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        return [row["logprobs"] for row in reply.json()["data"]]

    assert len(msgspec.msgpack.encode(rows)) > 4096
    whole = answer(rows)  # through the worker
    assert len(whole) == 600
    assert [whole[i] for i in (0, 1, 299, 599)] == answer([rows[i] for i in (0, 1, 299, 599)])
    bad = {"model": "mock", "input": rows[:-1] + [[10**6]]}  # the route's own check, after the worker
    reply = httpx.post(gateway.base_url + "/v1/next_token_logprobs", json=bad, timeout=30)
    assert reply.status_code == 400 and "outside the vocabulary" in reply.json()["error"]["message"]


def test_huge_bodies_that_fail_validation_keep_health_quick(tmp_path):
    """64 MiB dense bodies wrong at their first field, and at their last (the whole body decoded
    before the error: seconds of the event loop when decoded there, as the integral-float retry's
    second, untyped decode once was). Decoded in a worker process, /health stays quick. The
    default limits: bodies this large arrive within the default body timeout."""
    gateway = start_mock_gateway(tmp_path, "", slow_delay_s=0.1)
    rows = b"[" + b",".join([b"[1,2,3,4,5,6,7,8,9,1,2,3,4,5,6,7]"] * 1_900_000) + b"]"
    bodies = [b'{"model": 5, "input": ' + rows + b"}", b'{"input": ' + rows + b', "model": 5}'] * 2
    assert all(len(body) > 60 * 2**20 for body in bodies)
    answers: list[httpx.Response] = []

    def post(body: bytes) -> None:
        answers.append(
            httpx.post(
                gateway.base_url + "/v1/next_token_logprobs",
                content=body,
                headers={"content-type": "application/json"},
                timeout=60,
            )
        )

    def send_all() -> None:
        senders = [threading.Thread(target=post, args=(body,)) for body in bodies]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()

    def quick(latencies: list[float]) -> bool:
        # Decoded on the loop, each of the two bodies wrong at their last field holds it 0.8 s
        # here, and a probe waits through each hold (one probe through both: 1.6 s); decoded in
        # the worker, probes wait under 0.1 s, and one of them at most as long as the machine's
        # own hiccups.
        slowest = sorted(latencies)
        return slowest[-2] < 0.5 and slowest[-1] < 1.0

    try:
        rounds = []
        for _ in range(2):  # a held loop is slow every time; a busy machine's hiccups rarely twice
            rounds.append(health_latencies_during(gateway.base_url, send_all)[0])
            if quick(rounds[-1]):
                break
    finally:
        gateway.stop()
    assert [a.status_code for a in answers] == [400] * len(bodies) * len(rounds)
    assert all(
        a.json()["error"]["param"] == "model" and "`str`" in a.json()["error"]["message"] for a in answers
    )
    assert quick(rounds[-1]), [sorted(latencies)[-5:] for latencies in rounds]


def test_half_sent_bodies_stay_within_the_servers_budget_of_unfinished_bytes(tmp_path):
    """Twenty connections each send 6 MiB of an 8 MiB body and wait: the server holds at most
    `max_unfinished_body_bytes` (24 MiB here) of them, and answers the others 429 at once."""
    settings = "[limits]\nmax_unfinished_body_bytes = 25165824\nbody_timeout_s = 60\n"
    gateway = start_mock_gateway(tmp_path, settings, slow_delay_s=0.1)
    host, port = _address(gateway)
    head = (
        b"POST /v1/next_token_logprobs HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        b"content-length: 8388608\r\n\r\n"
    )

    async def half_send(results: list[bytes]) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(head + b" " * (6 * 2**20))
            await writer.drain()
            results.append(await asyncio.wait_for(reader.read(65536), 3))
        except (ConnectionError, TimeoutError):
            results.append(b"")  # still open, its bytes held
        finally:
            writer.close()

    async def main() -> tuple[list[bytes], int]:
        results: list[bytes] = []
        senders = [asyncio.create_task(half_send(results)) for _ in range(20)]
        await asyncio.sleep(2.5)  # every body half-sent, none closed yet
        grown = memory_kib(gateway.process.pid, "VmHWM") - before
        await asyncio.gather(*senders)
        return results, grown

    try:
        before = memory_kib(gateway.process.pid, "VmRSS")
        results, grown_kib = asyncio.run(main())
        assert httpx.get(gateway.base_url + "/health").status_code == 200
    finally:
        gateway.stop()
    # without the budget: +115 MiB here (those bodies' bytes that the server read in)
    assert grown_kib < 48 * 1024, grown_kib
    refused = [r for r in results if r.startswith(b"HTTP/1.1 429 ")]
    assert len(refused) >= 4, [r[:40] for r in results]
    assert b"retry-after: 1" in refused[0].lower()
    assert msgspec.json.decode(refused[0].split(b"\r\n\r\n", 1)[1])["error"]["code"] == "server_busy"


def test_routes_other_than_the_dense_one_take_bodies_up_to_their_own_limit():
    """A valid body of another route is decoded on the event loop, so `max_non_dense_body_bytes`
    (its default, as it ships) bounds it: the largest completion the default model takes (64
    prompts of 8,192 five-digit ids) fits; a larger body is a 413 in the API's error format, by
    its Content-Length or, sent chunked, by its bytes; a dense body as large is decoded."""
    from tests.conftest import mock_app_client

    # spaced after commas, as Python's json module (and so httpx and the openai SDK) writes it
    largest = json.dumps({"model": "mock", "prompt": [[12345] * 8192] * 64, "max_tokens": 1}).encode()
    assert 3.5 * 2**20 < len(largest) <= 4 * 2**20
    too_large = msgspec.json.encode({"model": "mock", "prompt": "a" * (4 * 2**20), "max_tokens": 1})
    dense = msgspec.json.encode(
        {"model": "mock", "input": [[12345] * 2000] * 400, "encoding_format": "base64", "layout": "matrix"}
    )
    assert len(dense) > 4 * 2**20
    headers = {"content-type": "application/json"}
    with mock_app_client() as (_, client):
        assert client.post("/v1/completions", content=largest, headers=headers).status_code != 413
        for content in (too_large, iter([too_large[: 2**20], too_large[2**20 :]])):
            answer = client.post("/v1/completions", content=content, headers=headers)
            assert answer.status_code == 413, answer.text[:300]
            assert "max_non_dense_body_bytes" in answer.json()["error"]["message"]
        answer = client.post("/v1/chat/completions", content=too_large, headers=headers)
        assert answer.status_code == 413
        answer = client.post("/v1/next_token_logprobs", content=dense, headers=headers)
        assert answer.status_code == 200, answer.text[:300]
