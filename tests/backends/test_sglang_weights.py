"""The SGLang engine's new weights through SGLang's own calls, against the stand-in SGLang server
(sglang_standin_weights.py: its four weight endpoints, bodies checked against sglang's request
types, a real gloo group joined for updates over a collective): rows follow the weights, SGLang's
refusals are WeightsErrors with its message. The real engine, from disk: the last test (CUDA)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import shutil
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from tests.conftest import engine_rows, require_engine_library

require_engine_library("sglang")

from backends.errors import WeightsError, WeightsGroupError  # noqa: E402
from backends.sglang.engine import SglangEngine  # noqa: E402
from backends.types import AnnouncedTensor, EngineConfig, WeightsGroup  # noqa: E402
from bench.launcher import free_port  # noqa: E402
from tests.backends.sglang_standin import distribution  # noqa: E402
from tests.backends.sglang_standin_weights import directory_version, weights_version  # noqa: E402

STANDIN = [sys.executable, str(Path(__file__).with_name("sglang_standin.py"))]
ROWS = [[1, 2, 3], [7, 8]]


class GlooTrainer:
    """Rank 0 of a two-rank gloo group formed with TorchRL's own `_init_custom_process_group`
    (the trainer's side of SGLang's weight sync), formed on a thread of this process."""

    def __init__(self, name: str) -> None:
        from torchrl.weight_update.llm.sglang_nccl import _init_custom_process_group

        self.name, self.port, self.group = name, free_port(), None

        def form() -> None:
            self.group = _init_custom_process_group(
                backend="gloo",
                init_method=f"tcp://127.0.0.1:{self.port}",
                world_size=2,
                rank=0,
                group_name=name,
                timeout=timedelta(seconds=60),
            )

        self._forming = threading.Thread(target=form, daemon=True)
        self._forming.start()

    def weights_group(self, timeout_s: float = 60.0) -> WeightsGroup:
        return WeightsGroup(self.name, "127.0.0.1", self.port, 1, 2, "gloo", timeout_s)

    def join_body(self) -> dict:
        body = {"master_address": "127.0.0.1", "master_port": self.port, "rank_offset": 1}
        return {**body, "world_size": 2, "group_name": self.name, "backend": "gloo"}

    def formed(self) -> None:
        self._forming.join(60)
        assert self.group is not None

    def broadcast(self, tensors: list[torch.Tensor]) -> threading.Thread:
        """Broadcast `tensors` one after another on a thread; join it once the update answered."""
        self.formed()

        def send() -> None:
            for tensor in tensors:
                torch.distributed.broadcast(tensor, src=0, group=self.group)

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)


def received_version(before: str, tensors: dict[str, torch.Tensor]) -> str:
    """The stand-in's weights after receiving `tensors` over a collective with weights `before`."""
    return weights_version({"": before.encode(), **{n: t.numpy().tobytes() for n, t in tensors.items()}})


@pytest.fixture(scope="module")
async def engine(model_dir):
    config = EngineConfig(
        model=str(model_dir), options={"mode": "server", "server_command": STANDIN, "startup_timeout_s": 120}
    )
    engine = await asyncio.to_thread(SglangEngine.load, config)
    yield engine
    await engine.aclose()


@pytest.fixture
async def original(engine, model_dir):
    """The engine on the weights it started with, at the start of a test."""
    await engine.weights.load(str(model_dir))


def sent(engine, path):
    url = engine.transport.base_url + "/standin/requests"
    return [body for body in httpx.get(url).json() if body.get("path") == path]


async def assert_rows(engine, version):
    rows = await engine_rows(engine, ROWS)
    for row, got in zip(ROWS, rows, strict=True):
        np.testing.assert_allclose(
            got, distribution(row, None, engine.info.vocab_size, version), rtol=0, atol=2e-5
        )


async def test_weights_from_disk_are_served(engine, original, model_dir, scaled_dir):
    assert not engine.weights.held_between_steps  # SGLang's streams run ahead of their reader
    await assert_rows(engine, "")
    await engine.weights.load(str(scaled_dir))
    new = directory_version(scaled_dir)
    await assert_rows(engine, new)
    assert engine.info.path == str(scaled_dir)
    assert new and np.abs(distribution(ROWS[0], None, 100, new) - distribution(ROWS[0], None, 100)).max() > 0
    body = sent(engine, "/update_weights_from_disk")[-1]
    assert body == {"path": "/update_weights_from_disk", "model_path": str(scaled_dir), "flush_cache": True}
    await engine.weights.load(str(model_dir))
    await assert_rows(engine, "")


async def test_sglangs_refusal_is_a_weights_error_with_its_message(
    engine, original, model_dir, scaled_dir, tmp_path
):
    with pytest.raises(WeightsError, match="Failed to get weights iterator"):
        await engine.weights.load(str(tmp_path / "absent"))
    broken = tmp_path / "broken"
    shutil.copytree(scaled_dir, broken)
    (broken / "extra.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"not json" * 2)
    with pytest.raises(WeightsError, match="(?s)deserializing header of extra.safetensors.*Rolling back"):
        await engine.weights.load(str(broken))
    await assert_rows(engine, "")
    assert engine.info.path == str(model_dir)


async def test_weights_over_a_collective_are_served(engine, original):
    collective = engine.weights.collective
    trainer = GlooTrainer("weight_update_group_standin")
    try:
        await collective.join(trainer.weights_group())
        with pytest.raises(WeightsGroupError, match="exists already"):
            await collective.join(trainer.weights_group())
        tensors = {"model.norm.weight": torch.rand(576), "lm_head.weight": torch.rand(4, 3)}
        announced = [AnnouncedTensor(n, "float32", tuple(t.shape)) for n, t in tensors.items()]
        sending = trainer.broadcast(list(tensors.values()))
        await collective.receive(trainer.name, announced)
        sending.join(10)
        await assert_rows(engine, received_version("", tensors))
        body = sent(engine, "/update_weights_from_distributed")[-1]
        assert body["names"] == list(tensors) and body["shapes"] == [[576], [4, 3]]
        assert body["dtypes"] == ["float32"] * 2 and body["flush_cache"] is True
        await collective.leave(trainer.name)
        assert sent(engine, "/destroy_weights_update_group")[-1]["group_name"] == trainer.name
        with pytest.raises(WeightsGroupError, match="does not exist"):
            await collective.leave(trainer.name)
    finally:
        trainer.close()


async def test_a_join_sglang_fails_is_a_weights_error_with_its_message(engine):
    trainer = GlooTrainer("weight_update_group_nccl")
    nccl = dataclasses.replace(trainer.weights_group(), backend="nccl")  # the stand-in has no GPU
    with pytest.raises(WeightsError, match="^Failed to initialize custom process group: .*NCCL"):
        await engine.weights.collective.join(nccl)
    with pytest.raises(WeightsGroupError, match="does not exist"):  # nothing was joined
        await engine.weights.collective.leave(trainer.name)
    assert engine.status().healthy


async def test_an_unknown_group_is_refused_before_sglang_hears_of_it(engine):
    """SGLang asserts that an update's group exists, and its scheduler dies of a failed assert."""
    before = len(sent(engine, "/update_weights_from_distributed"))
    with pytest.raises(WeightsGroupError, match="no weights update group named 'nobody'"):
        await engine.weights.collective.receive("nobody", [AnnouncedTensor("w", "float32", (1,))])
    assert len(sent(engine, "/update_weights_from_distributed")) == before and engine.status().healthy


async def test_a_join_nobody_answers_is_given_up_at_the_groups_timeout(engine):
    group = WeightsGroup("alone", "127.0.0.1", free_port(), 1, 2, "gloo", 1.0)
    started = time.monotonic()
    with pytest.raises(WeightsError, match="not every rank joined within 1 s"):
        await engine.weights.collective.join(group)
    assert time.monotonic() - started < 5
    with pytest.raises(WeightsGroupError, match="still joining"):  # SGLang has not answered yet
        await engine.weights.collective.receive("alone", [AnnouncedTensor("w", "float32", (1,))])


@contextlib.contextmanager
def cpu_tensors_by_name():
    """CPU tensors shared with another process by shared-memory name: torch's default passes a
    file descriptor, which only a process of the same family may take (a CUDA tensor, as a
    composed model's engines pass them, travels as an IPC handle either way)."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


async def test_tensors_handed_over_are_read_by_sglangs_own_deserializer(engine, original):
    tensors = {"model.norm.weight": torch.rand(576), "lm_head.weight": torch.rand(4, 3)}
    with cpu_tensors_by_name():
        await engine.weights.device_tensors.load(list(tensors.items()))
    await assert_rows(engine, received_version("", tensors))
    body = sent(engine, "/update_weights_from_tensor")[-1]
    assert len(body["serialized_named_tensors"]) == 1 and body["flush_cache"] is True  # one rank
    with pytest.raises(WeightsError, match="no tensors"):
        await engine.weights.device_tensors.load([])


# -- the in-process transport, without CUDA -----------------------------------------------------

# Run with -c from the repository root, where it imports tests/ from.
_ENGINE_MODE = """
import asyncio, json
from tests.backends.sglang_standin import _load_sglang_types
_load_sglang_types()  # sglang's request types without its CUDA-only imports
from backends.sglang.transport import EngineTransport, WEIGHTS_CALLS

class TokenizerManager:  # SGLang's signatures: (obj, request) -> (success, message, ...)
    def __getattr__(self, name):
        async def call(obj, request):
            seen.append([name, type(obj).__name__, request])
            return (name != "destroy_weights_update_group", f"{name} answered", 0)[: 3 if "disk" in name else 2]
        return call

class Engine:
    tokenizer_manager = TokenizerManager()

seen = []
transport = EngineTransport.__new__(EngineTransport)
transport.engine = Engine()
bodies = {
    "update_weights_from_disk": {"model_path": "/m", "flush_cache": True},
    "init_weights_update_group": {"master_address": "h", "master_port": 1, "rank_offset": 1,
                                  "world_size": 2, "group_name": "g", "backend": "gloo"},
    "update_weights_from_distributed": {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]],
                                        "group_name": "g", "flush_cache": True},
    "destroy_weights_update_group": {"group_name": "g"},
    "update_weights_from_tensor": {"serialized_named_tensors": [b"handles"], "flush_cache": True},
}
answers = {name: asyncio.run(transport.weights_call(name, body)) for name, body in bodies.items()}
print(json.dumps({"seen": seen, "answers": answers, "calls": WEIGHTS_CALLS}))
"""


def test_the_in_process_transport_awaits_the_tokenizer_managers_own_methods():
    """In "engine" mode the calls are sglang's own request types, awaited on the tokenizer manager
    (in a process of its own: sglang's types import only with the stand-in's patches)."""
    root = str(Path(__file__).parents[2])
    out = subprocess.run(
        [sys.executable, "-c", _ENGINE_MODE], capture_output=True, text=True, timeout=300, cwd=root
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["seen"] == [[name, type_name, None] for name, type_name in result["calls"].items()]
    assert result["answers"] == {
        "update_weights_from_disk": [True, "update_weights_from_disk answered"],
        "init_weights_update_group": [True, "init_weights_update_group answered"],
        "update_weights_from_distributed": [True, "update_weights_from_distributed answered"],
        "destroy_weights_update_group": [False, "destroy_weights_update_group answered"],
        "update_weights_from_tensor": [True, "update_weights_from_tensor answered"],
    }


# -- the real engine ----------------------------------------------------------------------------


def _cuda() -> bool:
    return torch.cuda.is_available()


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.skipif(not _cuda(), reason="SGLang's engine needs CUDA")
async def test_real_engine_loads_new_weights_from_disk(model_dir, reference, scaled_dir, scaled):
    options = dict(attention_backend="triton", sampling_backend="pytorch", grammar_backend="none")
    config = EngineConfig(
        model=str(model_dir), options=dict(mode="engine", mem_fraction_static=0.3, **options)
    )
    engine = await asyncio.to_thread(SglangEngine.load, config)
    try:
        ids = reference.tokenizer("The capital of France is")["input_ids"]
        before = (await engine_rows(engine, [ids]))[0]
        np.testing.assert_allclose(before, reference.logprobs(ids)[-1], atol=0.05)
        await engine.weights.load(str(scaled_dir))
        after = (await engine_rows(engine, [ids]))[0]  # the prefix again: SGLang's cache flushed
        want, old = scaled.logprobs(ids)[-1], reference.logprobs(ids)[-1]
        np.testing.assert_allclose(after, want, atol=0.05)
        assert np.abs(after - want).mean() < np.abs(after - old).mean()
        with pytest.raises(WeightsError, match="Failed"):
            await engine.weights.load(str(model_dir / "absent"))
        # Still the new weights. Not bit for bit: the prefix now comes from SGLang's radix cache,
        # and a cached prefix's bfloat16 rows differ from a full prefill's by a few hundredths.
        again = (await engine_rows(engine, [ids]))[0]
        np.testing.assert_allclose(again, want, atol=0.05)
        assert np.abs(again - want).mean() < np.abs(again - old).mean()
    finally:
        await engine.aclose()
