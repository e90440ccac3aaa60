"""Dense matrices written into a same-host client's memory: the gateway's side
(gateway/dense/shared_memory.py) over raw HTTP, and AsyncGatewayLM's segments (client/logprob_gateway_client/shared_memory.py)."""

from __future__ import annotations

import asyncio
import base64
import fcntl
import json
import os
import secrets
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch

from bench.launcher import start_gateway
from gateway.dense.parallel_copy import copy_into
from gateway.dense.shared_memory import SharedMemoryWriter
from gateway.errors import InvalidRequestError
from gateway.schemas.logprobs import SharedMemoryTarget
from logprob_gateway_client import AsyncGatewayLM, GatewayClientError
from logprob_gateway_client import shared_memory as client_memory
from logprob_gateway_client.shared_memory import KEY_BYTES
from tests.conftest import MODEL

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not client_memory.memfd_supported(), reason="memfd is Linux only"),
]
VOCAB = 49152
ROWS = [[504, 3575, 282, 4649, 314], [410, 2251, 30], [9690, 2114], [28, 253, 6217, 30]]


def memfd(room: int, *, seal: bool = True) -> tuple[int, str, str]:
    """A segment as a client makes one by hand, with `room` bytes for answers before its key:
    (fd, name, key)."""
    name = f"logprob-gateway-{secrets.token_hex(16)}"
    key = secrets.token_bytes(KEY_BYTES)
    fd = os.memfd_create(name, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, room + KEY_BYTES)
    os.pwrite(fd, key, room)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd, name, key.hex()


def dense(http: httpx.Client, rows, **fields) -> httpx.Response:
    return http.post(
        "/v1/next_token_logprobs", json={"model": MODEL, "input": rows, "layout": "matrix", **fields}
    )


def body_matrix_bytes(http: httpx.Client, rows, dtype: str) -> bytes:
    response = dense(http, rows, encoding_format="base64", dtype=dtype)
    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()["logprobs"])


def target(fd: int, name: str, key: str, **extra) -> dict:
    return {"pid": os.getpid(), "fd": fd, "name": name, "key": key, **extra}


@pytest.mark.parametrize(("dtype", "itemsize", "offset"), [("float32", 4, 0), ("bfloat16", 2, 4096)])
def test_the_matrix_is_written_into_the_segment_and_equals_the_body(http, reference, dtype, itemsize, offset):
    nbytes = len(ROWS) * VOCAB * itemsize
    fd, name, key = memfd(offset + nbytes + 4096)
    try:
        response = dense(http, ROWS, dtype=dtype, shared_memory=target(fd, name, key, offset=offset))
        assert response.status_code == 200, response.text
        document = response.json()
        assert document["object"] == "next_token_logprobs.shared_memory"
        assert (document["rows"], document["vocab_size"], document["dtype"]) == (len(ROWS), VOCAB, dtype)
        assert (document["offset"], document["nbytes"]) == (offset, nbytes)
        assert "logprobs" not in document
        written = os.pread(fd, offset + nbytes + 4096 + KEY_BYTES, 0)
    finally:
        os.close(fd)
    # Only the region named was written, and the key is still there.
    assert written[:offset] == bytes(offset) and written[offset + nbytes :] == bytes(4096) + bytes.fromhex(
        key
    )
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


@pytest.mark.parametrize(
    "case", ["another name", "another key", "no such process", "no such descriptor", "a regular file"]
)
def test_targets_the_gateway_cannot_open_get_the_matrix_in_the_body(http, tmp_path, case):
    """What a client on another host (or in another PID namespace) would send: the answer comes
    in the body, and nothing is written anywhere."""
    fd, name, key = memfd(len(ROWS) * VOCAB * 4)
    plain = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT)
    named = {
        "another name": target(fd, f"logprob-gateway-{secrets.token_hex(16)}", key),
        "another key": target(fd, name, secrets.token_hex(16)),
        "no such process": {**target(fd, name, key), "pid": _exited_pid()},
        "no such descriptor": target(4_000_000, name, key),
        "a regular file": target(plain, name, key),
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
        ("one byte into the key", "shared_memory", "needs"),
        ("not sealed", "shared_memory", "F_SEAL_SHRINK"),
        ("rows layout", "shared_memory", "layout"),
        ("bad name", "shared_memory.name", "logprob-gateway-"),
        ("name with a final newline", "shared_memory.name", "length"),
        ("key with a final newline", "shared_memory.key", "length"),
        ("key in capitals", "shared_memory.key", "[0-9a-f]"),
        ("no key", "shared_memory", "key"),
        ("bad pid", "shared_memory.pid", ">= 1"),
        ("unknown field", "shared_memory", "path"),
    ],
)
def test_segments_a_client_got_wrong_are_a_400(http, case, param, words):
    """Told only to the segment's owner (its key matched) or about the request itself."""
    room = len(ROWS) * VOCAB * 4 - (1 if case == "one byte into the key" else 0)
    fd, name, key = memfd(room, seal=case != "not sealed")
    fields = {
        "too small": {"shared_memory": target(fd, name, key), "dtype": "float32", "input": ROWS * 2},
        "offset past the end": {"shared_memory": target(fd, name, key, offset=len(ROWS) * VOCAB * 4 - 8)},
        "one byte into the key": {"shared_memory": target(fd, name, key)},
        "not sealed": {"shared_memory": target(fd, name, key)},
        "rows layout": {"shared_memory": target(fd, name, key), "layout": "rows"},
        "bad name": {"shared_memory": target(fd, "memfd:anything", key)},
        "name with a final newline": {"shared_memory": target(fd, name + "\n", key)},
        "key with a final newline": {"shared_memory": target(fd, name, key + "\n")},
        "key in capitals": {"shared_memory": target(fd, name, "F" * 32)},
        "no key": {"shared_memory": {"pid": os.getpid(), "fd": fd, "name": name}},
        "bad pid": {"shared_memory": {**target(fd, name, key), "pid": 0}},
        "unknown field": {"shared_memory": {**target(fd, name, key), "path": "/etc/passwd"}},
    }[case]
    try:
        response = http.post(
            "/v1/next_token_logprobs", json={"model": MODEL, "input": ROWS, "layout": "matrix", **fields}
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param
        assert words in error["message"]
        assert os.pread(fd, room + KEY_BYTES, 0) == bytes(room) + bytes.fromhex(key)  # nothing written
    finally:
        os.close(fd)


# -- other processes' segments ---------------------------------------------------------------

# Another process on the host: a segment filled with random bytes (the last 16 are its key), driven
# over stdin. It never sends a request unless told to ("ask", with its own key).
VICTIM = """
import fcntl, hashlib, json, os, secrets, sys
import httpx

size, sealed, base_url, model = int(sys.argv[1]), sys.argv[2] == "sealed", sys.argv[3], sys.argv[4]
rows = json.loads(sys.argv[5])
name = f"logprob-gateway-{secrets.token_hex(16)}"
fd = os.memfd_create(name, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
os.ftruncate(fd, size)
os.pwrite(fd, secrets.token_bytes(size), 0)
if sealed:
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
print(json.dumps({"pid": os.getpid(), "fd": fd, "name": name}), flush=True)
for command in sys.stdin:
    if command == "hash\\n":
        print(hashlib.sha256(os.pread(fd, size, 0)).hexdigest(), flush=True)
    elif command == "refill\\n":
        os.pwrite(fd, secrets.token_bytes(size - 16), 0)
        print("refilled", flush=True)
    elif command == "ask\\n":
        key = os.pread(fd, 16, size - 16).hex()
        shared_memory = {"pid": os.getpid(), "fd": fd, "name": name, "key": key}
        body = {"model": model, "input": rows, "layout": "matrix", "shared_memory": shared_memory}
        response = httpx.post(base_url + "/v1/next_token_logprobs", json=body, timeout=120)
        document = response.json()
        print(response.status_code, document.get("object") or document["error"]["message"], flush=True)
"""


class Victim:
    def __init__(self, base_url: str, size: int, sealed: bool) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                VICTIM,
                str(size),
                "sealed" if sealed else "unsealed",
                base_url,
                MODEL,
                json.dumps(ROWS),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.segment = json.loads(self._line())

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, "the victim process exited"
        return line.strip()

    def say(self, command: str) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._line()

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        assert self.process.stdout is not None
        self.process.stdout.close()


@pytest.fixture()
def victims(gateway):
    started: list[Victim] = []

    def start(size: int, *, sealed: bool = True) -> Victim:
        started.append(Victim(gateway.base_url, size, sealed))
        return started[-1]

    yield start
    for victim in started:
        victim.close()


def assert_answered_as_if_absent(http: httpx.Client, shared_memory: dict) -> None:
    """The answer to a request naming `shared_memory` is the one for a segment that does not
    exist: the matrix in the body, same status, same bytes."""
    body_matrix_bytes(http, ROWS, "float32")  # both answers from the output cache alike
    absent = dense(
        http, ROWS, encoding_format="base64", shared_memory={**shared_memory, "pid": _exited_pid()}
    )
    response = dense(http, ROWS, encoding_format="base64", shared_memory=shared_memory)
    assert response.status_code == absent.status_code == 200, response.text
    assert response.headers["content-type"] == absent.headers["content-type"]
    assert response.json()["object"] == "next_token_logprobs.matrix"
    assert response.content == absent.content


def name_with_wrong_keys(http, victim) -> None:
    """Name the victim's segment with a random key, then with a real key of another segment."""
    own_fd, _, own_key = memfd(0)
    try:
        for key in (secrets.token_hex(16), own_key):
            assert_answered_as_if_absent(http, {**victim.segment, "key": key})
    finally:
        os.close(own_fd)


def test_naming_another_processs_segment_writes_nothing_there_and_tells_nothing(http, victims):
    room = len(ROWS) * VOCAB * 4
    victim = victims(room + KEY_BYTES)
    before = victim.say("hash")
    name_with_wrong_keys(http, victim)
    assert victim.say("hash") == before
    # The gateway could see the segment all along: its owner's own request is written there.
    assert victim.say("ask") == "200 next_token_logprobs.shared_memory"
    assert victim.say("hash") != before


@pytest.mark.parametrize(
    ("case", "size", "sealed", "owner_hears"),
    [
        ("too small for the answer", 4096, True, "needs"),
        ("too small to hold a key", 8, True, None),
        ("not sealed", len(ROWS) * VOCAB * 4 + KEY_BYTES, False, "F_SEAL_SHRINK"),
    ],
)
def test_what_only_a_segments_owner_is_told_is_hidden_from_others(
    http, victims, case, size, sealed, owner_hears
):
    """Its size and its seals: a 400 for its owner, the body answer for anyone else."""
    victim = victims(size, sealed=sealed)
    before = victim.say("hash")
    assert_answered_as_if_absent(http, {**victim.segment, "key": secrets.token_hex(16)})
    assert victim.say("hash") == before
    if owner_hears is not None:
        status, message = victim.say("ask").split(" ", 1)
        assert status == "400" and owner_hears in message


def test_a_segment_the_gateway_already_maps_is_written_only_for_its_key(http, victims):
    """Its owner used it, so the gateway holds a mapping of it; another process naming it then
    gets no further than with a segment never mapped."""
    victim = victims(len(ROWS) * VOCAB * 4 + KEY_BYTES)
    assert victim.say("ask") == "200 next_token_logprobs.shared_memory"
    assert victim.say("refill") == "refilled"  # so that a write of the same rows would show
    before = victim.say("hash")
    name_with_wrong_keys(http, victim)
    assert victim.say("hash") == before
    assert victim.say("ask") == "200 next_token_logprobs.shared_memory"  # still its owner's to use
    assert victim.say("hash") != before


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


def test_steps_of_varying_size_keep_their_segments(lm):
    """Step sizes vary (particles that die, a caller's own batching). Once a large step has come,
    segments are made that large, so smaller and larger steps take turns in the same ones and
    the gateway maps (and registers with its GPU) no new segment per step."""
    lm._segments.max_bytes = 14 << 20  # three or four segments of these steps, recycled
    rng = np.random.default_rng(5)
    rows = prefixes(16, 80)
    for step in range(16):
        answer = lm.batch_next_token_logprobs_sync(rows[: 16 - step % 4 * 2])
        rows = [r + [int(t)] for r, t in zip(rows, rng.integers(100, 40000, len(rows)), strict=True)]
        del answer
    assert lm.shared_memory_answers >= 16 and lm._segments.created <= 3


def test_resampled_rows_are_asked_for_as_they_are_and_copied_by_the_gateway(lm, socket_lm, http):
    """Particles that resampling duplicated: in shared memory the request names every row, repeats
    included, and the gateway copies the repeats (a GPU engine on its device), so the client
    gathers nothing; over a socket the distinct rows travel once and the client gathers them."""
    distinct = prefixes(6, 90)
    rows = [distinct[i] for i in (0, 1, 0, 2, 3, 1, 4, 5, 0, 5)]
    stats = f"/v1/models/{MODEL}/stats"
    before = http.get(stats).json()
    got = asyncio.run(lm.batch_next_token_logprobs(rows))
    after = http.get(stats).json()
    assert after["rows"] - before["rows"] == len(rows) and after["engine_rows"] - before["engine_rows"] == 6
    assert lm.shared_memory_answers == 1 and in_segment(lm, got)
    sync = lm.batch_next_token_logprobs_sync([r + [7] for r in rows])
    assert lm.shared_memory_answers == 2 and in_segment(lm, sync)
    assert http.get(stats).json()["rows"] - after["rows"] == len(rows)
    over_socket = socket_lm.batch_next_token_logprobs_sync(rows)  # 6 rows, from the output cache
    assert socket_lm.requests_sent == 1 and http.get(stats).json()["rows"] - after["rows"] == len(rows)
    assert torch.equal(got, over_socket)
    for i, j in ((0, 2), (0, 8), (1, 5), (7, 9)):
        assert torch.equal(got[i], got[j])


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
    segments = client_memory.SharedSegments()
    assert segments.lease(client_memory.MIN_BYTES - 1) is None
    first = segments.lease(client_memory.MIN_BYTES)
    assert first is not None
    with pytest.raises(PermissionError):
        os.ftruncate(first.fd, 0)
    segments.release(first)
    assert segments.lease(client_memory.MIN_BYTES) is first
    segments.release(first)
    child_pid = os.getpid() + 1
    monkeypatch.setattr(os, "getpid", lambda: child_pid)
    second = segments.lease(client_memory.MIN_BYTES)
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
    fd, name, key = memfd(len(ROWS) * VOCAB * 4)
    try:
        with httpx.Client(base_url=gateway.base_url, timeout=120) as http:
            response = dense(http, ROWS, encoding_format="base64", shared_memory=target(fd, name, key))
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

    def place(segment: tuple[int, str, str], value: int) -> None:
        fd, name, key = segment
        writer.target(SharedMemoryTarget(pid=os.getpid(), fd=fd, name=name, key=key), 4096).view[:] = value

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
    for fd, _, _ in (b, c, d):
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
        for value, (fd, name, key) in ((3, big), (4, other)):
            writer.target(SharedMemoryTarget(pid=os.getpid(), fd=fd, name=name, key=key), 8192).view[:] = (
                value
            )
            assert os.pread(fd, 8192, 0) == bytes([value]) * 8192
            assert [segment_id[2] for segment_id in writer._segments] == [name]  # only the one being written
    finally:
        writer.close()
        for fd, _, _ in (big, other):
            os.close(fd)


def test_the_writer_maps_and_writes_only_for_the_segments_key():
    writer = SharedMemoryWriter()
    fd, name, key = memfd(4096)

    def named(key: str) -> SharedMemoryTarget:
        return SharedMemoryTarget(pid=os.getpid(), fd=fd, name=name, key=key)

    try:
        assert writer.target(named(secrets.token_hex(16)), 4096) is None and not writer._segments
        writer.target(named(key), 4096).view[:] = 1
        assert writer.target(named(secrets.token_hex(16)), 16) is None  # mapped: proven again each time
        with pytest.raises(InvalidRequestError, match="4096 bytes before its key"):
            writer.target(named(key), 4097)
        assert os.pread(fd, 4096 + KEY_BYTES, 0) == b"\x01" * 4096 + bytes.fromhex(key)
    finally:
        writer.close()
        os.close(fd)
