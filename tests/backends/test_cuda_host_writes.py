"""The transformers engine's rows written from the GPU straight into a client's segment, end to end
through the gateway: the mapping registered with the CUDA driver, the engine's one copy into it,
its own copy for the output cache, and the registration undone at shutdown. Needs a CUDA GPU; the
same path with the registration recorded rather than made runs everywhere in
tests/gateway/test_direct_rows.py."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import numpy as np
import torch
from litestar.testing import TestClient

from backends.host_copy import _until
from gateway.app import serving_app
from gateway.settings import CacheSettings, ModelSettings, Settings
from tests.conftest import requires_cuda as cuda
from tests.gateway.test_direct_rows import ask, memfd

ROWS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]


class _Event:
    """A CUDA event's two questions, answered as told; records where `synchronize` blocked."""

    def __init__(self, landed: bool) -> None:
        self.landed = landed
        self.waited_in: list[str] = []

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.waited_in.append(threading.current_thread().name)


async def test_a_copy_that_has_landed_is_not_waited_for_in_a_thread():
    landed, arriving = _Event(True), _Event(False)
    await _until(landed)
    await _until(arriving)
    assert landed.waited_in == []
    assert len(arriving.waited_in) == 1 and arriving.waited_in[0] != threading.current_thread().name


def _serve(model_dir, cache: bool):
    model = ModelSettings(
        name="m", model=str(model_dir), backend="transformers", device="cuda", dtype="float32"
    )
    return serving_app(Settings(models=[model], cache=CacheSettings(enabled=cache)))


def _ready(client: TestClient) -> None:
    deadline = time.monotonic() + 300
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _expected(engine, rows) -> np.ndarray:
    """The rows of a forward pass of each prefix alone, on the engine's own model."""
    with torch.inference_mode():
        return np.stack(
            [
                torch.log_softmax(engine.model(torch.tensor([r], device="cuda")).logits[0, -1].float(), -1)
                .cpu()
                .numpy()
                for r in rows
            ]
        )


def _segment_rows(fd: int, count: int, vocab: int) -> np.ndarray:
    return np.frombuffer(os.pread(fd, count * vocab * 4, 0), "<f4").reshape(count, vocab)


def _recording(engine, monkeypatch) -> tuple[list[bool], list]:
    """Records each write of the engine into registered memory (its `keep`) and each copy the
    gateway makes into a segment."""
    keeps, copies = [], []
    write = engine.host_writes.write_rows

    async def recorded(rows, adapters, into, keep, positions=None):
        keeps.append(keep)
        return await write(rows, adapters, into, keep, positions)

    monkeypatch.setattr(engine.host_writes, "write_rows", recorded)
    monkeypatch.setattr("gateway.dense.delivery.copy_into", lambda *args: copies.append(args))
    return keeps, copies


@cuda
def test_the_gpu_writes_rows_into_a_registered_segment_and_keeps_a_copy_for_the_cache(
    model_dir, monkeypatch, caplog
):
    caplog.set_level(logging.WARNING)
    litestar_app, served = _serve(model_dir, cache=True)
    fd = None
    with TestClient(served) as client:
        _ready(client)
        engine = litestar_app.state.registry.models["m"].engine
        assert engine.host_writes is not None and engine.device.type == "cuda"
        keeps, copies = _recording(engine, monkeypatch)
        vocab = engine.vocab_size
        fd, name, key = memfd(len(ROWS) * vocab * 4)
        target = {"pid": os.getpid(), "fd": fd, "name": name, "key": key}
        document = ask(client, ROWS, target, "m")
        assert document["object"] == "next_token_logprobs.shared_memory"
        assert keeps == [True] and copies == []  # one copy, from the GPU, by the engine
        writer = litestar_app.state.dense.shared_memory
        assert len(writer._registered) == 1  # cudaHostRegister accepted the mapping
        first = _segment_rows(fd, len(ROWS), vocab).copy()
        np.testing.assert_allclose(first, _expected(engine, ROWS), rtol=0, atol=1e-4)
        os.pwrite(fd, bytes(len(ROWS) * vocab * 4), 0)
        # From the output cache: the engine's own copy, stored once it had landed.
        again = ask(client, ROWS, target, "m")
        assert again["usage"]["cache_hits"] == len(ROWS) and keeps == [True] and len(copies) == 1
    os.close(fd)
    assert not writer._registered and not writer._segments  # unregistered, then unmapped
    assert not [r for r in caplog.records if "register" in r.getMessage()]


@cuda
def test_without_an_output_cache_the_gpu_writes_only_the_segment(model_dir, monkeypatch):
    litestar_app, served = _serve(model_dir, cache=False)
    with TestClient(served) as client:
        _ready(client)
        engine = litestar_app.state.registry.models["m"].engine
        keeps, copies = _recording(engine, monkeypatch)
        vocab = engine.vocab_size
        fd, name, key = memfd(len(ROWS) * vocab * 4)
        try:
            document = ask(client, ROWS, {"pid": os.getpid(), "fd": fd, "name": name, "key": key}, "m")
            assert document["object"] == "next_token_logprobs.shared_memory"
            assert keeps == [False] and copies == []
            got = _segment_rows(fd, len(ROWS), vocab)
            np.testing.assert_allclose(got, _expected(engine, ROWS), rtol=0, atol=1e-4)
        finally:
            os.close(fd)


@cuda
def test_rows_written_with_a_copy_kept_land_in_both_places(model_dir):
    from backends.host_copy import register_host_memory, unregister_host_memory, write_rows_into

    rows = torch.randn(4, 1000, device="cuda")
    into = np.zeros((4, 1000), np.float32)
    assert register_host_memory(into.ctypes.data, into.nbytes)
    try:
        written = write_rows_into(rows, into, keep=True)
        assert written.rows is not into
        asyncio.run(written.landed())
        assert np.array_equal(into, rows.cpu().numpy()) and np.array_equal(written.rows, into)
        alone = write_rows_into(rows * 2, into, keep=False)
        asyncio.run(alone.landed())
        assert alone.rows is into and np.array_equal(into, (rows * 2).cpu().numpy())
    finally:
        unregister_host_memory(into.ctypes.data)


@cuda
def test_rows_that_repeat_are_copied_on_the_device(model_dir):
    from backends.host_copy import register_host_memory, unregister_host_memory, write_rows_into

    rows = torch.randn(3, 1000, device="cuda")
    positions = [2, 0, 2, 1, 0, 2]
    into = np.zeros((len(positions), 1000), np.float32)
    assert register_host_memory(into.ctypes.data, into.nbytes)
    try:
        written = write_rows_into(rows, into, keep=True, positions=positions)
        asyncio.run(written.landed())
        assert np.array_equal(into, rows.cpu().numpy()[positions])
        assert np.array_equal(written.rows, rows.cpu().numpy())  # the distinct rows, for the cache
    finally:
        unregister_host_memory(into.ctypes.data)
