"""Dense matrices written into a same-host client's memory: the gateway's side
(gateway/shared_memory.py) over raw HTTP, and AsyncGatewayLM's segments (gateway/client_shm.py)."""

from __future__ import annotations

import asyncio
import base64
import fcntl
import os
import secrets
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch

from gateway import client_shm
from gateway.client import AsyncGatewayLM, GatewayClientError
from gateway.launcher import start_gateway
from gateway.parallel_copy import copy_into
from gateway.schemas.logprobs import SharedMemoryTarget
from gateway.shared_memory import SharedMemoryWriter
from tests.conftest import MODEL

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not client_shm.supported(), reason="memfd is Linux only"),
]
VOCAB = 49152
ROWS = [[504, 3575, 282, 4649, 314], [410, 2251, 30], [9690, 2114], [28, 253, 6217, 30]]


def memfd(size: int, *, seal: bool = True, name: str | None = None) -> tuple[int, str]:
    """A segment as a client makes one by hand: (fd, name)."""
    name = name or f"logprob-gateway-{secrets.token_hex(16)}"
    fd = os.memfd_create(name, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd, name


def dense(http: httpx.Client, rows, **fields) -> httpx.Response:
    return http.post(
        "/v1/next_token_logprobs", json={"model": MODEL, "input": rows, "layout": "matrix", **fields}
    )


def body_matrix_bytes(http: httpx.Client, rows, dtype: str) -> bytes:
    response = dense(http, rows, encoding_format="base64", dtype=dtype)
    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()["logprobs"])


def target(fd: int, name: str, **extra) -> dict:
    return {"pid": os.getpid(), "fd": fd, "name": name, **extra}


@pytest.mark.parametrize(("dtype", "itemsize", "offset"), [("float32", 4, 0), ("bfloat16", 2, 4096)])
def test_the_matrix_is_written_into_the_segment_and_equals_the_body(http, reference, dtype, itemsize, offset):
    nbytes = len(ROWS) * VOCAB * itemsize
    fd, name = memfd(offset + nbytes + 4096)
    try:
        response = dense(http, ROWS, dtype=dtype, shared_memory=target(fd, name, offset=offset))
        assert response.status_code == 200, response.text
        document = response.json()
        assert document["object"] == "next_token_logprobs.shared_memory"
        assert (document["rows"], document["vocab_size"], document["dtype"]) == (len(ROWS), VOCAB, dtype)
        assert (document["offset"], document["nbytes"]) == (offset, nbytes)
        assert "logprobs" not in document
        written = os.pread(fd, offset + nbytes + 4096, 0)
    finally:
        os.close(fd)
    # Only the region named was written.
    assert written[:offset] == bytes(offset) and written[offset + nbytes :] == bytes(4096)
    # The same rows in the body (from the output cache: bit for bit what was computed).
    assert written[offset : offset + nbytes] == body_matrix_bytes(http, ROWS, dtype)
    if dtype == "float32":
        matrix = np.frombuffer(written, dtype="<f4", count=len(ROWS) * VOCAB).reshape(len(ROWS), VOCAB)
        for got, ids in zip(matrix, ROWS, strict=True):
            assert np.max(np.abs(got - reference.logprobs(ids)[-1])) <= 1e-4


def _exited_pid() -> int:
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(child.stdout)


@pytest.mark.parametrize("case", ["another name", "no such process", "no such descriptor", "a regular file"])
def test_targets_the_gateway_cannot_open_get_the_matrix_in_the_body(http, tmp_path, case):
    """What a client on another host (or in another PID namespace) would send: the answer comes
    in the body, and nothing is written anywhere."""
    fd, name = memfd(len(ROWS) * VOCAB * 4)
    plain = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT)
    named = {
        "another name": target(fd, f"logprob-gateway-{secrets.token_hex(16)}"),
        "no such process": {**target(fd, name), "pid": _exited_pid()},
        "no such descriptor": target(4_000_000, name),
        "a regular file": target(plain, name),
    }[case]
    try:
        response = dense(http, ROWS, encoding_format="base64", shared_memory=named)
        assert response.status_code == 200, response.text
        document = response.json()
        assert document["object"] == "next_token_logprobs.matrix"
        assert base64.b64decode(document["logprobs"]) == body_matrix_bytes(http, ROWS, "float32")
        assert os.pread(fd, len(ROWS) * VOCAB * 4, 0) == bytes(len(ROWS) * VOCAB * 4)
        assert os.fstat(plain).st_size == 0
    finally:
        os.close(fd)
        os.close(plain)


@pytest.mark.parametrize(
    ("case", "param", "words"),
    [
        ("too small", "shared_memory", "needs"),
        ("offset past the end", "shared_memory", "needs"),
        ("not sealed", "shared_memory", "F_SEAL_SHRINK"),
        ("rows layout", "shared_memory", "layout"),
        ("bad name", "shared_memory.name", "logprob-gateway-"),
        ("bad pid", "shared_memory.pid", ">= 1"),
        ("unknown field", "shared_memory", "path"),
    ],
)
def test_segments_a_client_got_wrong_are_a_400(http, case, param, words):
    fd, name = memfd(len(ROWS) * VOCAB * 4, seal=case != "not sealed")
    fields = {
        "too small": {"shared_memory": target(fd, name), "dtype": "float32", "input": ROWS * 2},
        "offset past the end": {"shared_memory": target(fd, name, offset=len(ROWS) * VOCAB * 4 - 8)},
        "not sealed": {"shared_memory": target(fd, name)},
        "rows layout": {"shared_memory": target(fd, name), "layout": "rows"},
        "bad name": {"shared_memory": target(fd, "memfd:anything")},
        "bad pid": {"shared_memory": {**target(fd, name), "pid": 0}},
        "unknown field": {"shared_memory": {**target(fd, name), "path": "/etc/passwd"}},
    }[case]
    try:
        response = http.post(
            "/v1/next_token_logprobs", json={"model": MODEL, "input": ROWS, "layout": "matrix", **fields}
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param
        assert words in error["message"]
        assert os.pread(fd, 64, 0) == bytes(64)  # nothing written
    finally:
        os.close(fd)


# -- the client ---------------------------------------------------------------------------------


@pytest.fixture()
def lm(gateway):
    client = AsyncGatewayLM(gateway.base_url, MODEL)
    yield client
    client.close()


@pytest.fixture()
def socket_lm(gateway):
    client = AsyncGatewayLM(gateway.base_url, MODEL, shared_memory=False)
    yield client
    client.close()


def prefixes(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(100, 40000, size=3)] for _ in range(count)]


def in_segment(lm: AsyncGatewayLM, answer: torch.Tensor) -> bool:
    """Whether the answer's memory is one of the client's segments."""
    return any(
        np.shares_memory(answer.numpy(), np.frombuffer(s.mapping, dtype=np.uint8))
        for s in lm._segments._segments
        if not s.mapping.closed
    )


def test_the_client_reads_answers_in_place_equal_to_the_body(lm, socket_lm, http, reference):
    rows = prefixes(8, 0)  # 1.5 MiB: over the client's threshold for shared memory
    got = asyncio.run(lm.batch_next_token_logprobs(rows))
    assert lm.shared_memory_answers == 1 and in_segment(lm, got)
    again = socket_lm.batch_next_token_logprobs_sync(rows)
    assert socket_lm.shared_memory_answers == 0 and not in_segment(lm, again)
    assert torch.equal(got, again)
    for row, ids in zip(got, rows, strict=True):
        assert torch.max(torch.abs(row - torch.from_numpy(reference.logprobs(ids)[-1]))) <= 1e-4
    sync = lm.batch_next_token_logprobs_sync(prefixes(8, 1))
    assert lm.shared_memory_answers == 2 and in_segment(lm, sync)
    assert torch.equal(sync, socket_lm.batch_next_token_logprobs_sync(prefixes(8, 1)))
    metrics = http.get("/metrics").text
    assert 'encoding="shared_memory"' in metrics
    small = asyncio.run(lm.batch_next_token_logprobs(prefixes(2, 2)))  # under 1 MiB: in the body
    assert lm.shared_memory_answers == 2 and not in_segment(lm, small)


def test_smc_steps_take_turns_in_two_segments(lm, socket_lm):
    """Every step's answer is new; the caller lets go of a step's rows when it has sampled, so
    with no room to grow the client recycles the oldest segment (its rows leave the row cache)."""
    lm._segments.max_bytes = 0
    rows = prefixes(8, 3)
    for _ in range(6):
        got = lm.batch_next_token_logprobs_sync(rows)
        assert in_segment(lm, got)
        assert torch.equal(got, socket_lm.batch_next_token_logprobs_sync(rows))
        rows = [r + [int(torch.argmax(g))] for r, g in zip(rows, got, strict=True)]
    assert lm.shared_memory_answers == 6 and lm._segments.created == 2
    assert len(lm._cache) == 16  # the rows of the two answers still in segments


def test_a_larger_answer_takes_the_place_of_smaller_ones(lm):
    """Segments sized for small steps (their rows only in the row cache) make room for a larger
    step instead of sending it in the body."""
    lm._segments.max_bytes = 0
    for seed in range(3):
        lm.batch_next_token_logprobs_sync(prefixes(8, 50 + seed))
    larger = lm.batch_next_token_logprobs_sync(prefixes(24, 60))
    assert lm.shared_memory_answers == 4 and in_segment(lm, larger)
    assert len(lm._segments._segments) == 2


def test_answers_the_caller_keeps_are_never_written_over(lm, socket_lm):
    lm._segments.max_bytes = 0
    kept = []
    for seed in range(4):
        answer = lm.batch_next_token_logprobs_sync(prefixes(8, 10 + seed))
        kept.append((answer, answer.clone()))
    # Two segments, both held by the caller: the next two answers came in the body.
    assert lm.shared_memory_answers == 2 and lm._segments.created == 2
    assert [in_segment(lm, a) for a, _ in kept] == [True, True, False, False]
    assert all(torch.equal(a, copy) for a, copy in kept)
    kept.clear()  # let go: the segments take answers again
    assert in_segment(lm, lm.batch_next_token_logprobs_sync(prefixes(8, 20)))
    assert lm._segments.created == 2


def test_a_failed_request_never_lends_its_segment_again(lm):
    with pytest.raises(GatewayClientError) as failed:
        lm.batch_next_token_logprobs_sync(prefixes(8, 30), lora_name="no-such-adapter")
    assert failed.value.status in (400, 404)
    assert lm._segments.created == 1 and lm._segments.nbytes == 0  # retired, closed
    lm.batch_next_token_logprobs_sync(prefixes(8, 31))
    assert lm._segments.created == 2


def test_segments_are_sealed_and_forked_children_make_their_own(monkeypatch):
    segments = client_shm.SharedSegments()
    assert segments.lease(client_shm.MIN_BYTES - 1) is None
    first = segments.lease(client_shm.MIN_BYTES)
    assert first is not None
    with pytest.raises(PermissionError):
        os.ftruncate(first.fd, 0)
    segments.release(first)
    assert segments.lease(client_shm.MIN_BYTES) is first
    segments.release(first)
    child_pid = os.getpid() + 1
    monkeypatch.setattr(os, "getpid", lambda: child_pid)
    second = segments.lease(client_shm.MIN_BYTES)
    assert second is not first and second.target()["pid"] == child_pid
    try:  # the child closed its copy of the parent's segment (the number may be in use again)
        inherited = os.readlink(f"/proc/self/fd/{first.fd}") == f"/memfd:{first.name} (deleted)"
    except OSError:
        inherited = False
    assert not inherited
    segments.close()


def test_a_gateway_with_shared_memory_off_answers_in_the_body(model_dir, tmp_path):
    gateway = start_gateway(
        ["--model", MODEL, "--dtype", "float32", "--no-shared-memory"], tmp_path / "gateway.log"
    )
    fd, name = memfd(len(ROWS) * VOCAB * 4)
    try:
        with httpx.Client(base_url=gateway.base_url, timeout=120) as http:
            response = dense(http, ROWS, encoding_format="base64", shared_memory=target(fd, name))
            assert response.json()["object"] == "next_token_logprobs.matrix"
            assert os.pread(fd, 64, 0) == bytes(64)
        with (
            AsyncGatewayLM(gateway.base_url, MODEL) as lm,
            AsyncGatewayLM(gateway.base_url, MODEL, shared_memory=False) as socket_lm,
        ):
            got = lm.batch_next_token_logprobs_sync(prefixes(8, 40))
            assert lm.shared_memory_answers == 0 and not lm._ask_shared_memory  # stopped asking
            assert lm._segments.nbytes == 0  # and gave its segment back
            assert torch.equal(got, socket_lm.batch_next_token_logprobs_sync(prefixes(8, 40)))
    finally:
        os.close(fd)
        gateway.stop()


def test_the_gateway_forgets_mappings_of_closed_segments_and_keeps_few():
    writer = SharedMemoryWriter(max_segments=2)
    a, b, c, d = (memfd(8192) for _ in range(4))

    def place(segment: tuple[int, str], value: int) -> None:
        writer.target(SharedMemoryTarget(pid=os.getpid(), fd=segment[0], name=segment[1]), 4096)[:] = value

    place(a, 7)
    assert os.pread(a[0], 4097, 0) == b"\x07" * 4096 + b"\x00"
    place(b, 8)
    os.close(a[0])  # its client let it go: the gateway's mapping alone would keep it alive
    place(c, 9)
    assert {name for _, _, name in writer._segments} == {b[1], c[1]}
    place(b, 10)  # used: c is now the oldest
    place(d, 11)
    assert {name for _, _, name in writer._segments} == {b[1], d[1]}
    assert os.pread(c[0], 1, 0) == b"\x09" and os.pread(b[0], 1, 0) == b"\x0a"
    writer.close()
    for fd, _ in (b, c, d):
        os.close(fd)


def test_large_copies_run_in_pieces_and_copy_every_byte():
    source = np.random.default_rng(0).integers(0, 256, size=(20 << 20) + 3, dtype=np.uint8)
    destination = np.zeros_like(source)
    copy_into(destination, source)
    assert np.array_equal(destination, source)


def test_a_segment_over_the_gateways_bound_is_still_written_and_pushes_out_the_others():
    writer = SharedMemoryWriter(max_bytes=4096)
    big, other = memfd(8192), memfd(8192)
    try:
        for value, (fd, name) in ((3, big), (4, other)):
            writer.target(SharedMemoryTarget(pid=os.getpid(), fd=fd, name=name), 8192)[:] = value
            assert os.pread(fd, 8192, 0) == bytes([value]) * 8192
            assert [key[2] for key in writer._segments] == [name]  # only the one being written
    finally:
        writer.close()
        for fd, _ in (big, other):
            os.close(fd)
