"""Rows an engine writes straight into a client's shared memory (a GPU's copy into memory registered
with its driver): the writer's registration of mappings, and the gateway skipping its own copy.
The registration is recorded, not made, here (the mock engine's `host_memory`); the mock writes its
rows into the segment itself. tests/backends/test_cuda_host_writes.py runs the real one on a GPU."""

from __future__ import annotations

import fcntl
import os
import secrets

import msgspec
import numpy as np
import pytest
from litestar.testing import TestClient

from gateway.dense.row_cache import AskedRows
from gateway.dense.shared_memory import SharedMemoryWriter
from gateway.settings import CacheSettings, ModelSettings, Settings
from logprob_gateway_client import shared_memory as client_memory
from logprob_gateway_client.schemas import SharedMemoryTarget
from logprob_gateway_client.shared_memory import KEY_BYTES
from tests.conftest import mock_app_client

pytestmark = pytest.mark.skipif(not client_memory.memfd_supported(), reason="memfd is Linux only")
VOCAB = 49152


class Registrar:
    """Records registrations, as a GPU engine's HostMemory would make them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def register(self, address: int, size: int) -> bool:
        self.calls.append(("register", address))
        return True

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address))

    def empty(self, rows):
        raise AssertionError("the writer never asks for rows of the engine's own")


def memfd(room: int) -> tuple[int, str, str]:
    """A segment with `room` bytes for answers before its key: (fd, name, key)."""
    name = f"logprob-gateway-{secrets.token_hex(16)}"
    key = secrets.token_bytes(KEY_BYTES)
    fd = os.memfd_create(name, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, room + KEY_BYTES)
    os.pwrite(fd, key, room)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd, name, key.hex()


def test_a_pinned_mapping_is_unregistered_before_it_is_unmapped_and_never_while_viewed():
    registrar = Registrar()
    writer = SharedMemoryWriter(max_segments=1)
    (a, a_name, a_key), (b, b_name, b_key) = memfd(8192), memfd(8192)
    second = SharedMemoryTarget(pid=os.getpid(), fd=b, name=b_name, key=b_key)
    try:
        first = SharedMemoryTarget(pid=os.getpid(), fd=a, name=a_name, key=a_key)
        destination = writer.target(first, 4096, registrar)
        view = destination.view
        address = view.ctypes.data
        assert destination.registered and registrar.calls == [("register", address)]
        assert not writer.target(first, 4096, Registrar()).registered  # another engine's: not for it
        mapping = writer._segments[os.getpid(), a, a_name]
        writer.target(second, 4096, registrar)  # pushes a out
        assert (os.getpid(), a, a_name) not in writer._segments
        assert [call for call in registrar.calls if call[0] == "unregister"] == []  # a view still writes
        assert not mapping.closed
        view[:] = 5  # the mapping is still there to write into
        del view, destination
        writer.target(second, 4096, registrar)
        assert registrar.calls[-1] == ("unregister", address) and mapping.closed
        assert os.pread(a, 2, 4095) == b"\x05\x00"
        writer.close()
        assert registrar.calls[-1][0] == "unregister" and len(registrar.calls) == 4
    finally:
        os.close(a)
        os.close(b)


def test_without_a_registrar_nothing_is_registered():
    writer = SharedMemoryWriter()
    fd, name, key = memfd(4096)
    try:
        target = SharedMemoryTarget(pid=os.getpid(), fd=fd, name=name, key=key)
        destination = writer.target(target, 4096)
        destination.view[:] = 1
        assert not destination.registered and not writer._registered
        writer.close()
    finally:
        os.close(fd)


WRITING_MOCK = ModelSettings(name="mock", backend="mock", options={"host_memory": True})


@pytest.fixture(scope="module")
def writing_app():
    with mock_app_client(settings=Settings(models=[WRITING_MOCK])) as app_and_client:
        yield app_and_client


def ask(client: TestClient, rows, target: dict, model: str = "mock") -> dict:
    response = client.post(
        "/v1/next_token_logprobs",
        content=msgspec.msgpack.encode(
            {"model": model, "input": rows, "layout": "matrix", "shared_memory": target}
        ),
        headers={"content-type": "application/msgpack", "accept": "application/msgpack"},
    )
    assert response.status_code == 200, response.text
    return msgspec.msgpack.decode(response.content)


def test_the_engine_writes_a_registered_segment_itself_and_the_gateway_does_not_copy(
    writing_app, monkeypatch
):
    litestar_app, client = writing_app
    engine = litestar_app.state.registry.models["mock"].engine
    writes, registrations = engine.writes, engine.host_memory.calls
    copies = []
    monkeypatch.setattr("gateway.dense.delivery.copy_into", lambda *args: copies.append(args))
    rows = [[1, 2, 3], [4, 5], [6]]
    fd, name, key = memfd(len(rows) * VOCAB * 4 + 4)
    try:
        written = len(writes)
        target = {"pid": os.getpid(), "fd": fd, "name": name, "key": key}
        document = ask(client, rows, target)
        assert document["object"] == "next_token_logprobs.shared_memory"
        # The engine's own write into the segment alone: rows never asked before get no copy
        # for the cache.
        assert writes[written:] == [1] and copies == []
        # The mock's rows land once waited for, as a device's copy may after the engine returns:
        # the answer left after the gateway waited for them in the segment it registered.
        (register, address), (wait, landed) = registrations[-2:]
        assert (register, wait) == ("register", "wait_landed") and landed == address
        got = np.frombuffer(os.pread(fd, len(rows) * VOCAB * 4, 0), "<f4").reshape(len(rows), VOCAB)
        expected = np.stack([engine.logits(r) for r in rows])
        assert np.array_equal(got, expected)
        # Asked again: computed again, and this time the engine also copies them for the cache.
        again = ask(client, rows, target)
        assert again["usage"]["cache_hits"] == 0 and writes[written:] == [1, 2] and copies == []
        os.pwrite(fd, bytes(len(rows) * VOCAB * 4), 0)
        # From the output cache the third time (the engine's own copy, stored once it had landed):
        # the engine is not asked, and the route copies the cached rows.
        monkeypatch.undo()
        again = ask(client, rows, target)
        assert again["usage"]["cache_hits"] == len(rows) and len(writes) == written + 2
        got = np.frombuffer(os.pread(fd, len(rows) * VOCAB * 4, 0), "<f4").reshape(len(rows), VOCAB)
        assert np.array_equal(got, expected)
        monkeypatch.setattr("gateway.dense.delivery.copy_into", lambda *args: copies.append(args))
        # An offset that splits a float: no target for the engine, the gateway copies.
        ask(client, [[7, 8]], {**target, "offset": 2})
        assert len(writes) == written + 2 and len(copies) == 1
    finally:
        os.close(fd)


def test_rows_that_repeat_are_written_by_the_engine_and_cached_once_each(writing_app, monkeypatch):
    """Resampled particles: the request names a row several times; the engine computes each row
    once and writes every repeat itself, and the output cache gets each distinct row once."""
    litestar_app, client = writing_app
    engine = litestar_app.state.registry.models["mock"].engine
    writes = engine.writes
    copies = []
    monkeypatch.setattr("gateway.dense.delivery.copy_into", lambda *args: copies.append(args))
    rows = [[11, 12], [13], [11, 12], [14, 15, 16], [13], [11, 12]]
    fd, name, key = memfd(len(rows) * VOCAB * 4)
    calls, computed = engine.calls, engine.rows_computed
    try:
        written = len(writes)
        target = {"pid": os.getpid(), "fd": fd, "name": name, "key": key}
        ask(client, rows, target)  # first asked: no copy for the cache
        document = ask(client, rows, target)  # asked again: the engine copies them for the cache
        assert document["rows"] == len(rows) and document["nbytes"] == len(rows) * VOCAB * 4
        assert writes[written:] == [1, 2] and copies == [] and engine.calls == calls + 2
        assert engine.rows_computed == computed + 6  # each distinct row once a call
        got = np.frombuffer(os.pread(fd, len(rows) * VOCAB * 4, 0), "<f4").reshape(len(rows), VOCAB)
        assert np.array_equal(got, np.stack([engine.logits(r) for r in rows]))
        # Each distinct row is in the cache under its own key: asked again alone, none is computed.
        monkeypatch.undo()  # the gateway copies cached rows
        for row in [[11, 12], [13], [14, 15, 16]]:
            again = ask(client, [row], {"pid": os.getpid(), "fd": fd, "name": name, "key": key})
            assert again["usage"]["cache_hits"] == 1
            got = np.frombuffer(os.pread(fd, VOCAB * 4, 0), "<f4")
            assert np.array_equal(got, engine.logits(row))
        assert engine.calls == calls + 2
    finally:
        os.close(fd)


def test_without_an_output_cache_the_engine_keeps_no_copy_of_what_it_wrote(monkeypatch):
    settings = Settings(models=[WRITING_MOCK], cache=CacheSettings(enabled=False))
    copies = []
    monkeypatch.setattr("gateway.dense.delivery.copy_into", lambda *args: copies.append(args))
    rows = [[1, 2, 3], [4, 5]]
    fd, name, key = memfd(len(rows) * VOCAB * 4)
    try:
        with mock_app_client(settings=settings) as (litestar_app, client):
            engine = litestar_app.state.registry.models["mock"].engine
            document = ask(client, rows, {"pid": os.getpid(), "fd": fd, "name": name, "key": key})
        assert document["object"] == "next_token_logprobs.shared_memory"
        assert engine.writes == [1] and copies == []  # the segment alone
        got = np.frombuffer(os.pread(fd, len(rows) * VOCAB * 4, 0), "<f4").reshape(len(rows), VOCAB)
        assert np.array_equal(got, np.stack([engine.logits(r) for r in rows]))
    finally:
        os.close(fd)


def test_with_admission_off_the_engine_copies_rows_for_the_cache_at_their_first_ask():
    settings = Settings(models=[WRITING_MOCK], cache=CacheSettings(admission_bytes=0))
    rows = [[21, 22], [23]]
    fd, name, key = memfd(len(rows) * VOCAB * 4)
    target = {"pid": os.getpid(), "fd": fd, "name": name, "key": key}
    try:
        with mock_app_client(settings=settings) as (litestar_app, client):
            engine = litestar_app.state.registry.models["mock"].engine
            assert ask(client, rows, target)["usage"]["cache_hits"] == 0
            assert engine.writes == [2]  # the segment and the cache's copy
            os.pwrite(fd, bytes(len(rows) * VOCAB * 4), 0)
            assert ask(client, rows, target)["usage"]["cache_hits"] == len(rows)
            assert engine.calls == 1
        got = np.frombuffer(os.pread(fd, len(rows) * VOCAB * 4, 0), "<f4").reshape(len(rows), VOCAB)
        assert np.array_equal(got, np.stack([engine.logits(r) for r in rows]))
    finally:
        os.close(fd)


def test_asked_rows_are_remembered_within_their_byte_bound():
    asked = AskedRows(max_bytes=40)  # generations of 20 bytes of keys
    assert not asked.before([b"a" * 10, b"b" * 5])
    # One key asked before is enough; these keys pass 20 bytes: the generation becomes the older.
    assert asked.before([b"b" * 5]) and asked.before([b"zz", b"a" * 10])
    assert not asked.before([b"c" * 10])
    assert asked.before([b"a" * 10])  # still remembered, in the older generation
    assert not asked.before([b"d" * 25])  # another turn: the first generation is forgotten
    assert not asked.before([b"b" * 5])


def test_rows_kept_from_an_answer_in_the_body_are_hits_when_asked_into_memory(writing_app):
    """A row the cache kept from another request's answer is found at its first ask into a
    client's memory: the cache remembers every key it stores."""
    litestar_app, client = writing_app
    engine = litestar_app.state.registry.models["mock"].engine
    rows = [[31, 32], [33]]
    response = client.post("/v1/next_token_logprobs", json={"model": "mock", "input": rows})
    assert response.status_code == 200 and response.json()["usage"]["cache_hits"] == 0
    calls = engine.calls
    fd, name, key = memfd(len(rows) * VOCAB * 4)
    try:
        document = ask(client, rows, {"pid": os.getpid(), "fd": fd, "name": name, "key": key})
        assert document["usage"]["cache_hits"] == len(rows) and engine.calls == calls
        got = np.frombuffer(os.pread(fd, len(rows) * VOCAB * 4, 0), "<f4").reshape(len(rows), VOCAB)
        assert np.array_equal(got, np.stack([engine.logits(r) for r in rows]))
    finally:
        os.close(fd)
