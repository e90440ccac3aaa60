"""Rows an engine writes straight into a client's shared memory (a GPU's copy into memory registered
with its driver): the writer's registration of mappings, and the route skipping its own copy.
The registration is faked here (no GPU); the mock engine writes its rows into the target itself."""

from __future__ import annotations

import fcntl
import os
import secrets
import time

import msgspec
import numpy as np
import pytest
from litestar.testing import TestClient

from gateway.app import serving_app
from gateway.schemas.logprobs import SharedMemoryTarget
from gateway.settings import CacheSettings, ModelSettings, Settings
from gateway.shared_memory import SharedMemoryWriter
from logprob_gateway_client import shared_memory as client_memory
from logprob_gateway_client.shared_memory import KEY_BYTES

pytestmark = pytest.mark.skipif(not client_memory.memfd_supported(), reason="memfd is Linux only")
VOCAB = 49152


class FakePinner:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def register(self, address: int, size: int) -> bool:
        self.calls.append(("register", address))
        return True

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address))


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
    pinner = FakePinner()
    writer = SharedMemoryWriter(max_segments=1, pinner=pinner)
    (a, a_name, a_key), (b, b_name, b_key) = memfd(8192), memfd(8192)
    try:
        first = SharedMemoryTarget(pid=os.getpid(), fd=a, name=a_name, key=a_key)
        view = writer.target(first, 4096)
        address = view.ctypes.data
        assert writer.pinned(first) and pinner.calls == [("register", address)]
        mapping = writer._segments[os.getpid(), a, a_name]
        writer.target(SharedMemoryTarget(pid=os.getpid(), fd=b, name=b_name, key=b_key), 4096)  # pushes a out
        assert not writer.pinned(first)
        assert [call for call in pinner.calls if call[0] == "unregister"] == []  # a view still writes
        assert not mapping.closed
        view[:] = 5  # the mapping is still there to write into
        del view
        writer.target(SharedMemoryTarget(pid=os.getpid(), fd=b, name=b_name, key=b_key), 4096)
        assert pinner.calls[-1] == ("unregister", address) and mapping.closed
        assert os.pread(a, 2, 4095) == b"\x05\x00"
        writer.close()
        assert pinner.calls[-1][0] == "unregister" and len(pinner.calls) == 4
    finally:
        os.close(a)
        os.close(b)


def test_unpinned_writers_never_call_a_pinner():
    writer = SharedMemoryWriter()
    fd, name, key = memfd(4096)
    try:
        target = SharedMemoryTarget(pid=os.getpid(), fd=fd, name=name, key=key)
        writer.target(target, 4096)[:] = 1
        assert not writer.pinned(target)
        writer.close()
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def pinned_app():
    litestar_app, served = serving_app(Settings(models=[ModelSettings(name="mock", backend="mock")]))
    pinner = FakePinner()
    litestar_app.state.shared_memory.pinner = pinner
    with TestClient(served) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        yield litestar_app, client, pinner


def ask(client: TestClient, rows, target: dict) -> dict:
    response = client.post(
        "/v1/next_token_logprobs",
        content=msgspec.msgpack.encode(
            {"model": "mock", "input": rows, "layout": "matrix", "shared_memory": target}
        ),
        headers={"content-type": "application/msgpack", "accept": "application/msgpack"},
    )
    assert response.status_code == 200, response.text
    return msgspec.msgpack.decode(response.content)


def test_the_engine_writes_a_pinned_segment_itself_and_the_route_does_not_copy(pinned_app, monkeypatch):
    litestar_app, client, pinner = pinned_app
    engine = litestar_app.state.registry.models["mock"].engine
    copies = []
    monkeypatch.setattr("gateway.routes.logprobs.copy_into", lambda *args: copies.append(args))
    rows = [[1, 2, 3], [4, 5], [6]]
    fd, name, key = memfd(len(rows) * VOCAB * 4 + 4)
    try:
        written = engine.targets_written
        document = ask(client, rows, {"pid": os.getpid(), "fd": fd, "name": name, "key": key})
        assert document["object"] == "next_token_logprobs.shared_memory"
        assert engine.targets_written == written + 1 and copies == []  # the engine's own write
        assert pinner.calls and pinner.calls[-1][0] == "register"
        got = np.frombuffer(os.pread(fd, len(rows) * VOCAB * 4, 0), "<f4").reshape(len(rows), VOCAB)
        expected = np.stack([engine.logits(r) for r in rows])
        assert np.array_equal(got, expected)
        # From the output cache this time (stored once the engine's own copy was ready): the
        # engine is not asked, and the route copies the cached rows.
        again = ask(client, rows, {"pid": os.getpid(), "fd": fd, "name": name, "key": key})
        assert again["usage"]["cache_hits"] == len(rows) and engine.targets_written == written + 1
        assert len(copies) == 1
        # An offset that splits a float: no target for the engine, the route copies.
        ask(client, [[7, 8]], {"pid": os.getpid(), "fd": fd, "name": name, "key": key, "offset": 2})
        assert engine.targets_written == written + 1 and len(copies) == 2
    finally:
        os.close(fd)


def test_without_an_output_cache_the_engine_keeps_no_copy_of_what_it_wrote(monkeypatch):
    settings = Settings(
        models=[ModelSettings(name="mock", backend="mock")], cache=CacheSettings(enabled=False)
    )
    litestar_app, served = serving_app(settings)
    litestar_app.state.shared_memory.pinner = FakePinner()
    copies = []
    monkeypatch.setattr("gateway.routes.logprobs.copy_into", lambda *args: copies.append(args))
    rows = [[1, 2, 3], [4, 5]]
    fd, name, key = memfd(len(rows) * VOCAB * 4)
    try:
        with TestClient(served) as client:
            deadline = time.monotonic() + 120
            while client.get("/health").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            engine = litestar_app.state.registry.models["mock"].engine
            into, kept = engine.next_token_logprobs_into, []

            async def recording(rows, adapters, target):
                kept.append(target.keep)
                return await into(rows, adapters, target)

            litestar_app.state.registry.models["mock"].batcher._engine_call_into = recording
            document = ask(client, rows, {"pid": os.getpid(), "fd": fd, "name": name, "key": key})
        assert document["object"] == "next_token_logprobs.shared_memory"
        assert kept == [False] and engine.targets_written == 1 and copies == []
        got = np.frombuffer(os.pread(fd, len(rows) * VOCAB * 4, 0), "<f4").reshape(len(rows), VOCAB)
        assert np.array_equal(got, np.stack([engine.logits(r) for r in rows]))
    finally:
        os.close(fd)
