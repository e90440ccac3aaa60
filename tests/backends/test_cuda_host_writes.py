"""The transformers engine's rows written from the GPU straight into a client's segment, end to end
through the gateway: the mapping registered with the CUDA driver, the engine's one copy into it,
its own copy for the output cache, and the registration undone at shutdown. Needs a CUDA GPU; the
same path with the registration recorded rather than made runs everywhere in
tests/gateway/test_direct_rows.py."""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch
from litestar.testing import TestClient

from gateway.app import serving_app
from gateway.settings import CacheSettings, ModelSettings, Settings
from tests.conftest import engine_rows
from tests.conftest import requires_cuda as cuda
from tests.gateway.test_direct_rows import ask, memfd

ROWS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]


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


def _recording(engine, monkeypatch) -> tuple[list[int], list]:
    """Records each write from the device (how many arrays) and each copy the gateway makes into
    a segment."""
    writes, copies = [], []
    write = engine.host_memory.write_rows

    async def recorded(rows, adapters, arrays, positions):
        writes.append(len(arrays))
        return await write(rows, adapters, arrays, positions)

    monkeypatch.setattr(engine.host_memory, "write_rows", recorded)
    monkeypatch.setattr("gateway.dense.delivery.copy_into", lambda *args: copies.append(args))
    return writes, copies


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
        assert engine.host_memory is not None and engine.device.type == "cuda"
        writes, copies = _recording(engine, monkeypatch)
        vocab = engine.info.vocab_size
        fd, name, key = memfd(len(ROWS) * vocab * 4)
        target = {"pid": os.getpid(), "fd": fd, "name": name, "key": key}
        document = ask(client, ROWS, target, "m")
        assert document["object"] == "next_token_logprobs.shared_memory"
        # one copy into the segment, from the GPU, by the engine; one into its own for the cache
        assert writes == [2] and copies == []
        writer = litestar_app.state.dense.shared_memory
        assert len(writer._registered) == 1  # cudaHostRegister accepted the mapping
        first = _segment_rows(fd, len(ROWS), vocab).copy()
        np.testing.assert_allclose(first, _expected(engine, ROWS), rtol=0, atol=1e-4)
        os.pwrite(fd, bytes(len(ROWS) * vocab * 4), 0)
        # From the output cache: the engine's own copy, whole when the engine returned.
        monkeypatch.undo()
        again = ask(client, ROWS, target, "m")
        assert again["usage"]["cache_hits"] == len(ROWS)
        assert np.array_equal(_segment_rows(fd, len(ROWS), vocab), first)
    os.close(fd)
    assert not writer._registered and not writer._segments  # unregistered, then unmapped
    assert not [r for r in caplog.records if "register" in r.getMessage()]


@cuda
def test_without_an_output_cache_the_gpu_writes_only_the_segment(model_dir, monkeypatch):
    litestar_app, served = _serve(model_dir, cache=False)
    with TestClient(served) as client:
        _ready(client)
        engine = litestar_app.state.registry.models["m"].engine
        writes, copies = _recording(engine, monkeypatch)
        vocab = engine.info.vocab_size
        fd, name, key = memfd(len(ROWS) * vocab * 4)
        try:
            document = ask(client, ROWS, {"pid": os.getpid(), "fd": fd, "name": name, "key": key}, "m")
            assert document["object"] == "next_token_logprobs.shared_memory"
            assert writes == [1] and copies == []
            got = _segment_rows(fd, len(ROWS), vocab)
            np.testing.assert_allclose(got, _expected(engine, ROWS), rtol=0, atol=1e-4)
        finally:
            os.close(fd)


@cuda
def test_rows_land_in_every_array_before_the_write_returns_or_once_waited_for(model_dir):
    from backends.transformers.host_copy import CudaHostMemory, write_rows_into

    memory = CudaHostMemory(1000)
    rows = torch.randn(4, 1000, device="cuda")
    into = np.zeros((4, 1000), np.float32)
    assert memory.register(into.ctypes.data, into.nbytes)
    try:
        own, pageable = memory.empty(4), np.zeros((4, 1000), np.float32)
        write_rows_into(rows, (into, own, pageable), None)
        expected = rows.cpu().numpy()
        assert all(np.array_equal(array, expected) for array in (into, own, pageable))
        # Given the engine's host memory, the answer lands first and the engine's own copy once
        # waited for.
        rows = torch.randn(4, 1000, device="cuda")
        write_rows_into(rows, (into, own), None, memory)
        assert np.array_equal(into, rows.cpu().numpy())
        memory.wait_landed(own)
        assert np.array_equal(own, into)
        memory.wait_landed(own)  # waited for once: nothing is left to wait for
    finally:
        memory.unregister(into.ctypes.data)


@cuda
def test_rows_that_repeat_are_copied_on_the_device(model_dir):
    from backends.transformers.host_copy import CudaHostMemory, write_rows_into

    memory = CudaHostMemory(1000)
    rows = torch.randn(3, 1000, device="cuda")
    positions = [2, 0, 2, 1, 0, 2]
    into = np.zeros((len(positions), 1000), np.float32)
    assert memory.register(into.ctypes.data, into.nbytes)
    try:
        own = memory.empty(len(positions))
        write_rows_into(rows, (into, own), positions)
        assert np.array_equal(into, rows.cpu().numpy()[positions]) and np.array_equal(own, into)
    finally:
        memory.unregister(into.ctypes.data)


@cuda
async def test_the_engine_writes_rows_that_repeat_into_every_array_of_out(model_dir):
    from backends.transformers.engine import TransformersEngine
    from backends.types import EngineConfig

    engine = TransformersEngine.load(EngineConfig(model=str(model_dir), dtype="float32", device="cuda"))
    try:
        rows = [ROWS[0], ROWS[1], ROWS[0], ROWS[2], ROWS[1]]
        out = np.zeros((len(rows), engine.info.vocab_size), np.float32), engine.host_memory.empty(len(rows))
        written = await engine_rows(engine, rows, None, out)
        assert written is out[0] and np.array_equal(out[0], out[1])
        np.testing.assert_allclose(out[0], _expected(engine, rows), rtol=0, atol=1e-4)
    finally:
        await engine.aclose()


@cuda
def test_a_copy_nobody_waits_for_keeps_its_array_until_it_has_landed():
    """A request cancelled during its engine call never waits for its rows: the memory they land in
    stays viewed (so registered, mapped, not reused) until they have landed."""
    import gc
    import weakref

    from backends.transformers.host_copy import CudaHostMemory, write_rows_into

    memory = CudaHostMemory(1 << 16)
    rows = torch.randn(64, 1 << 16, device="cuda")
    torch.cuda._sleep(200_000_000)  # the copy queues behind a long kernel: still under way below
    into = memory.empty(64)
    kept = weakref.ref(into)
    write_rows_into(rows, (into,), None, memory)
    del into
    gc.collect()
    assert kept() is not None
    torch.cuda.synchronize()
    write_rows_into(rows, (memory.empty(64),), None, memory)  # the next call lets go of landed ones
    gc.collect()
    assert kept() is None
