"""Dense calls over the gateway's Unix socket (gateway/dense/local_socket.py and the client's
client/logprob_gateway_client/local_socket.py): the real model's rows through AsyncGatewayLM's
default path, and the socket's rules (keys, limits, errors, bounds) with raw frames against a
gateway on the mock engine."""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import struct
import tempfile
import time

import httpx
import msgspec
import numpy as np
import pytest
import torch

from bench.launcher import start_gateway, start_mock_gateway
from gateway.access import hash_key
from gateway.dense.local_socket import DIRECTORY_PREFIX, SOCKET_NAME, remove_stale_sockets
from logprob_gateway_client import AsyncGatewayLM, GatewayClientError
from logprob_gateway_client import shared_memory as client_memory
from logprob_gateway_client.local_socket import HEADER
from tests.conftest import MODEL
from tests.gateway.test_shared_memory import memfd, prefixes, target

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not client_memory.memfd_supported(), reason="memfd is Linux only"),
]
KEY = "sk-local-0123456789"
THRIFTY = "sk-thrifty-0123456789"  # a key of its own for the row budget test
VOCAB = 49152
# float32 rows of a batch against one row alone: transformers itself, a batch of prefixes(8, 141)
# against each row alone, differs by up to 2.04e-4
TOL = 5e-4


def steps(lm: AsyncGatewayLM, rows: list[list[int]], count: int) -> list[torch.Tensor]:
    """`count` SMC-like steps: every row grows by its most likely token; the answers, copied."""

    async def run() -> list[torch.Tensor]:
        answers, current = [], rows
        for _ in range(count):
            got = await lm.batch_next_token_logprobs(current)
            answers.append(got.clone())
            current = [r + [int(torch.argmax(g))] for r, g in zip(current, got, strict=True)]
        return answers

    return asyncio.run(run())


def test_same_host_calls_move_to_the_socket_with_the_same_rows(gateway, reference, http):
    lm = AsyncGatewayLM(gateway.base_url, MODEL)
    over_http = AsyncGatewayLM(gateway.base_url, MODEL, local_socket=False)
    try:
        rows = prefixes(8, 40)  # 1.5 MiB: over the client's threshold for shared memory
        local = steps(lm, rows, 4)
        # the first answer came over HTTP and named the socket; the three after it came through it
        assert (lm.shared_memory_answers, lm.local_socket_answers, lm.requests_sent) == (4, 3, 4)
        assert "engine;dur=" in lm.server_timing
        remote = steps(over_http, rows, 4)
        assert (over_http.shared_memory_answers, over_http.local_socket_answers) == (4, 0)
        current = rows
        for got, again in zip(local, remote, strict=True):
            assert torch.equal(got, again)
            for row, ids in zip(got, current, strict=True):
                expected = torch.from_numpy(reference.logprobs(ids)[-1])
                assert torch.max(torch.abs(row - expected)) <= TOL
            current = [r + [int(torch.argmax(g))] for r, g in zip(current, got, strict=True)]
        metrics = http.get("/metrics").text
        assert f'method="LOCAL",model="{MODEL}",route="/v1/next_token_logprobs",status="200"' in metrics
    finally:
        lm.close()
        over_http.close()


def test_a_lost_socket_falls_back_to_http_and_connects_again(gateway, reference):
    lm = AsyncGatewayLM(gateway.base_url, MODEL)
    try:
        rows = prefixes(8, 41)
        steps(lm, rows, 2)
        assert lm.local_socket_answers == 1
        for sock in lm._local._idle:  # as when the gateway restarts: the connection is gone
            sock.shutdown(socket.SHUT_RDWR)
        fresh = prefixes(8, 141)
        got = steps(lm, fresh, 1)[0]  # sent again over HTTP, which names the socket again
        assert lm.local_socket_answers == 1 and lm.shared_memory_answers == 3
        for row, ids in zip(got, fresh, strict=True):
            assert torch.max(torch.abs(row - torch.from_numpy(reference.logprobs(ids)[-1]))) <= TOL
        steps(lm, prefixes(8, 42), 1)
        assert lm.local_socket_answers == 2
    finally:
        lm.close()


def test_a_gateway_without_the_socket_keeps_clients_on_http(model_dir, tmp_path):
    gateway = start_gateway(
        ["--model", MODEL, "--dtype", "float32", "--no-local-socket", "--no-cache"], tmp_path / "g.log"
    )
    lm = AsyncGatewayLM(gateway.base_url, MODEL)
    try:
        steps(lm, prefixes(8, 43), 3)
        assert (lm.shared_memory_answers, lm.local_socket_answers) == (3, 0)
    finally:
        lm.close()
        gateway.stop()


# -- the socket's rules, with raw frames (mock engine: gateway-layer rules) ----------------------


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("local")
    settings = f"""
api_keys = ["{hash_key(KEY, "alice")}", "{hash_key(THRIFTY, "thrifty")}"]

[limits]
max_body_bytes = 65536
header_timeout_s = 1
body_timeout_s = 1
local_idle_timeout_s = 3
rows_per_minute_per_key = 200
max_local_in_flight = 2
max_local_connections = 6
max_unfinished_body_bytes = 100000

"""
    gateway = start_mock_gateway(workdir, settings, slow_delay_s=0.5)
    yield gateway
    gateway.stop()


class Segment:
    """A sealed memfd of this process with room for `rows` rows."""

    def __init__(self, rows: int) -> None:
        self.fd, self.name, self.key = memfd(rows * VOCAB * 4 + 4096)

    def target(self) -> dict:
        return target(self.fd, self.name, self.key)

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture(scope="module")
def segment():
    made = Segment(16)
    yield made
    made.close()


def request(model: str, rows: list[list[int]], segment: Segment | None, **extra) -> bytes:
    body = {"model": model, "input": rows, "layout": "matrix", **extra}
    if segment is not None:
        body["shared_memory"] = segment.target()
    return msgspec.msgpack.encode(body)


@pytest.fixture(scope="module")
def socket_path(secured, segment) -> str:
    """The socket the gateway names in an answer written into this process's memory."""
    response = httpx.post(
        secured.base_url + "/v1/next_token_logprobs",
        content=request("mock", prefixes(8, 1), segment),
        headers={"Content-Type": "application/msgpack", "Authorization": f"Bearer {KEY}"},
    )
    assert response.status_code == 200, response.text
    path = response.headers[HEADER]
    assert os.stat(path).st_mode & 0o777 == 0o666 and os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o711
    return path


class Raw:
    """A connection to the socket speaking frames by hand."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(path)

    def send(self, message: object) -> None:
        self.send_bytes(msgspec.msgpack.encode(message))

    def send_bytes(self, frame: bytes) -> None:
        self.sock.sendall(struct.pack("<I", len(frame)) + frame)

    def receive(self) -> list | None:
        """The next frame, None when the gateway closed the connection."""
        head = self._exactly(4)
        if head is None:
            return None
        (length,) = struct.unpack("<I", head)
        return msgspec.msgpack.decode(self._exactly(length))

    def _exactly(self, n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def hello(self, key: str | None = KEY) -> list:
        self.send(["hello", key])
        return self.receive()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw(socket_path):
    connection = Raw(socket_path)
    yield connection
    connection.close()


def error_of(frame: list) -> dict:
    return msgspec.json.decode(frame[3])["error"]


def test_answers_are_the_documents_http_gives(secured, raw, segment):
    assert raw.hello() == [0, 200, "", b""]
    rows = prefixes(8, 2)
    raw.send([7, request("mock", rows, segment)])
    request_id, status, timing, body = raw.receive()
    assert (request_id, status) == (7, 200) and "engine;dur=" in timing
    document = msgspec.msgpack.decode(body)
    assert document["object"] == "next_token_logprobs.shared_memory" and document["rows"] == 8
    local = np.frombuffer(os.pread(segment.fd, 8 * VOCAB * 4, 0), dtype="<f4").copy()
    response = httpx.post(
        secured.base_url + "/v1/next_token_logprobs",
        json={"model": "mock", "input": rows, "layout": "matrix", "encoding_format": "base64"},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert local.tobytes() == base64.b64decode(response.json()["logprobs"])


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        (lambda s: request("mock", [[1, 2, VOCAB]], s), 400, "input", "vocabulary"),
        (lambda s: request("mock", [[1, 2, 3]], None), 400, "shared_memory", "shared memory only"),
        (lambda s: request("nope", [[1, 2, 3]], s), 404, "model", "nope"),
        (lambda s: request("mock", [], s), 400, "input", ""),
        (lambda s: msgspec.msgpack.encode({"model": "mock"}), 400, None, "input"),
        (lambda s: b"\xc1", 400, None, "MessagePack"),
        (lambda s: request("mock", [[1]], s, layout="rows"), 400, "shared_memory", "matrix"),
    ],
)
def test_bad_requests_get_the_http_error_and_the_connection_lives_on(
    raw, segment, body, status, param, words
):
    raw.hello()
    raw.send([3, body(segment)])
    frame = raw.receive()
    assert frame[:2] == [3, status]
    error = error_of(frame)
    assert error["param"] == param and words.lower() in error["message"].lower()
    raw.send([4, request("mock", prefixes(6, 3), segment)])
    assert raw.receive()[:2] == [4, 200]


@pytest.mark.parametrize(
    ("key", "words"), [(None, "no API key"), ("sk-wrong", "a wrong API key"), (42, "hello")]
)
def test_a_connection_without_the_key_is_refused_and_closed(raw, key, words):
    frame = raw.hello(key)
    assert frame[:2] == [0, 401 if key != 42 else 400] and words in error_of(frame)["message"]
    assert raw.receive() is None


@pytest.mark.parametrize(
    "first",
    [[1, b"body before hello"], "not an array", ["hello", "k", "extra"]],
    ids=["request", "str", "long"],
)
def test_the_first_frame_must_be_hello(raw, first):
    raw.send(first)
    frame = raw.receive()
    assert frame[:2] == [0, 400]
    assert raw.receive() is None


def test_frames_over_the_body_limit_close_the_connection(raw):
    raw.hello()
    raw.sock.sendall(struct.pack("<I", 65536 + 65))
    frame = raw.receive()
    assert frame[:2] == [0, 413] and "65601" in error_of(frame)["message"]
    assert raw.receive() is None


def test_a_silent_connection_is_closed_after_the_header_timeout(raw):
    started = time.monotonic()
    assert raw.receive() is None
    assert 0.5 <= time.monotonic() - started <= 10


def test_a_frame_that_does_not_arrive_whole_in_time_is_a_408(raw):
    raw.hello()
    raw.sock.sendall(struct.pack("<I", 60000) + b"\x92" + b"\x00" * 100)  # 60,000 bytes announced
    started = time.monotonic()
    frame = raw.receive()
    assert frame[:2] == [0, 408] and error_of(frame)["code"] == "request_timeout"
    assert raw.receive() is None
    assert 0.5 <= time.monotonic() - started <= 10


def test_an_idle_connection_is_closed_and_a_busy_one_is_not(raw, segment):
    raw.hello()
    raw.send([1, request("slow", prefixes(4, 1), segment)])
    for _ in range(8):  # 0.5 s each: a connection busy past the idle timeout stays
        assert raw.receive()[:2] == [1, 200]
        raw.send([1, request("slow", prefixes(4, 1), segment)])
    assert raw.receive()[:2] == [1, 200]
    started = time.monotonic()
    assert raw.receive() is None
    assert 2 <= time.monotonic() - started <= 15


def test_unfinished_frames_stay_within_the_servers_budget(socket_path, raw):
    """Two connections each send 55,000 bytes of a 60,000-byte frame: the second would pass the
    budget of 100,000 unfinished bytes and is answered 429 and closed; the first's frame runs
    into its deadline, and its bytes are freed for the next connection."""
    partial = struct.pack("<I", 60000) + b"\x92" + b"\x00" * 54999
    raw.hello()
    raw.sock.sendall(partial)
    time.sleep(0.2)
    second = Raw(socket_path)
    try:
        second.hello()
        second.sock.sendall(partial)
        frame = second.receive()
        assert frame[:2] == [0, 429] and "unfinished" in error_of(frame)["message"]
        assert second.receive() is None
    finally:
        second.close()
    assert raw.receive()[:2] == [0, 408]  # body_timeout_s: its bytes held no longer
    third = Raw(socket_path)
    try:
        third.hello()
        third.sock.sendall(partial)
        assert third.receive()[:2] == [0, 408]  # room again: its deadline, not the budget
    finally:
        third.close()


def test_connections_beyond_the_limit_are_a_429_and_closed(socket_path, raw):
    raw.hello()
    others = [Raw(socket_path) for _ in range(5)]  # with `raw`: the limit of 6, greeted or not
    try:
        extra = Raw(socket_path)
        frame = extra.receive()
        assert frame[:2] == [0, 429] and error_of(frame)["type"] == "rate_limit_error"
        assert extra.receive() is None
        extra.close()
        others.pop().close()
        time.sleep(0.2)
        others.append(Raw(socket_path))  # a place was freed
        assert others[-1].hello()[:2] == [0, 200]
    finally:
        for other in others:
            other.close()


def test_a_deeply_nested_frame_is_a_400_without_a_traceback(secured, raw):
    raw.hello()
    raw.send_bytes(b"\x91" * 50_000)
    frame = raw.receive()
    assert frame[:2] == [0, 400]
    assert raw.receive() is None
    assert "RecursionError" not in secured.log_path.read_text(errors="replace")


def test_sockets_of_dead_gateways_are_removed_and_live_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead, live, foreign = (tmp_path / f"{DIRECTORY_PREFIX}{name}" for name in ("dead", "live", "foreign"))
    sockets = []
    for directory in (dead, live, foreign):
        directory.mkdir()
        made = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        made.bind(str(directory / SOCKET_NAME))
        sockets.append(made)
    sockets[1].listen()
    (foreign / "other-file").write_text("not ours alone")
    sockets[0].close()  # as a killed gateway leaves it: the file, and nobody listening
    sockets[2].close()
    try:
        assert remove_stale_sockets() == [str(dead)]
        assert not dead.exists() and (live / SOCKET_NAME).exists() and (foreign / SOCKET_NAME).exists()
    finally:
        sockets[1].close()


def test_the_keys_row_budget_applies_as_over_http(secured, raw, segment):
    raw.hello(THRIFTY)
    statuses = []
    for i in range(30):  # 16 rows each: the 200-row minute runs out
        raw.send([i + 1, request("mock", prefixes(16, 100 + i), segment)])
        statuses.append(raw.receive()[1])
        if statuses[-1] == 429:
            break
    assert statuses[-1] == 429 and statuses.count(200) >= 5


def test_a_client_that_goes_away_cancels_its_request(secured, socket_path, segment):
    gone = Raw(socket_path)
    gone.hello()
    gone.send([1, request("slow", prefixes(6, 5), segment)])
    gone.close()
    time.sleep(1.0)
    health = httpx.get(secured.base_url + "/health")
    assert health.status_code == 200
    metrics = httpx.get(secured.base_url + "/metrics").text
    assert 'method="LOCAL",model="slow",route="/v1/next_token_logprobs",status="499"' in metrics


def test_requests_on_one_connection_may_overlap(raw, segment):
    """Ids tell the answers apart: the fast request's answer comes before the slow one's."""
    raw.hello()
    other = Segment(6)
    try:
        raw.send([1, request("slow", prefixes(6, 6), segment)])
        raw.send([2, request("mock", prefixes(6, 7), other)])
        assert [raw.receive()[:2], raw.receive()[:2]] == [[2, 200], [1, 200]]
    finally:
        other.close()


def test_a_connection_runs_at_most_max_local_in_flight_requests(raw, segment):
    """Two run at once (the limit); the third is read once one has ended."""
    raw.hello()
    segments = [Segment(6) for _ in range(2)]
    try:
        sent = time.monotonic()
        for i, target_segment in enumerate([segment, *segments]):
            raw.send([i + 1, request("slow", prefixes(6, 10 + i), target_segment)])
        arrived = {}
        for _ in range(3):
            frame = raw.receive()
            assert frame[1] == 200
            arrived[frame[0]] = time.monotonic() - sent
        assert max(arrived[1], arrived[2]) < arrived[3] and arrived[3] >= 0.9  # two delays of 0.5 s
    finally:
        for made in segments:
            made.close()


def test_the_client_raises_the_gateways_errors_over_the_socket(secured):
    lm = AsyncGatewayLM(secured.base_url, "mock", api_key=KEY)
    try:
        steps(lm, prefixes(8, 8), 2)
        assert lm.local_socket_answers == 1
        with pytest.raises(GatewayClientError) as refused:
            asyncio.run(lm.batch_next_token_logprobs([[1, 2, VOCAB + 5]] * 8))
        assert refused.value.status == 400 and "vocabulary" in str(refused.value)
        assert lm.local_socket_answers == 1
    finally:
        lm.close()
