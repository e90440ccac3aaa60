"""A composed model whose generation engine takes tensors on its device (the SGLang engine, here
against the stand-in SGLang server, which reads them with SGLang's own deserializer) and whose
dense engine is the real transformers engine: new weights, from disk or a trainer's collective,
reach the generation engine as the dense engine's tensors, never a second read or broadcast."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tests.conftest import engine_rows, last_row, require_engine_library

require_engine_library("sglang")

from backends.composed.engine import ComposedEngine  # noqa: E402
from backends.errors import EngineUnavailableError, WeightsError  # noqa: E402
from backends.sglang.engine import SglangEngine  # noqa: E402
from backends.transformers.engine import TransformersEngine  # noqa: E402
from backends.types import AnnouncedTensor, EngineConfig, WeightsGroup  # noqa: E402
from bench.launcher import free_port  # noqa: E402
from tests.backends.sglang_standin import distribution  # noqa: E402
from tests.backends.sglang_standin_weights import weights_version  # noqa: E402
from tests.backends.test_sglang_weights import (  # noqa: E402
    STANDIN,
    cpu_tensors_by_name,
    received_version,
    sent,
)
from tests.backends.test_weight_sync import Trainer  # noqa: E402

ROWS = [[1, 2, 3], [7, 8]]


@pytest.fixture(scope="module")
async def composed(model_dir):
    options = {"mode": "server", "server_command": STANDIN, "startup_timeout_s": 120}
    generation = await asyncio.to_thread(
        SglangEngine.load, EngineConfig(model=str(model_dir), options=options)
    )
    dense = await asyncio.to_thread(
        TransformersEngine.load, EngineConfig(model=str(model_dir), dtype="float32")
    )
    engine = ComposedEngine(generation, dense)
    with cpu_tensors_by_name():
        yield engine
    await engine.aclose()


@pytest.fixture
async def version(composed, model_dir):
    """The stand-in's weights once both engines hold the default model again, at a test's start
    (the stand-in's weights hash in what it held before: from disk first, it holds its own)."""
    await composed.generation.weights.load(str(model_dir))
    await composed.weights.load(str(model_dir))
    return await handed_version(composed, "")


async def handed_version(composed, before: str) -> str:
    """The stand-in's weights after the dense engine's tensors were handed to it."""
    tensors = await composed.dense.weights.own_tensors.named()
    return weights_version({"": before.encode(), **{n: t.numpy().tobytes() for n, t in tensors}})


async def assert_generation_rows(composed, version: str) -> None:
    rows = await engine_rows(composed.generation, ROWS)
    for row, got in zip(ROWS, rows, strict=True):
        want = distribution(row, None, composed.info.vocab_size, version)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


async def test_weights_from_disk_reach_the_generation_engine_as_the_dense_engines_tensors(
    composed, model_dir, version, scaled_dir, scaled
):
    from_disk = len(sent(composed.generation, "/update_weights_from_disk"))
    await composed.weights.load(str(scaled_dir))
    ids = [1, 2, 3, 4]
    got = (await engine_rows(composed, [ids]))[0]
    np.testing.assert_allclose(got, last_row(scaled.model, ids), atol=1e-4)  # float32, as the engine sums
    await assert_generation_rows(composed, await handed_version(composed, version))
    assert len(sent(composed.generation, "/update_weights_from_disk")) == from_disk  # no second read
    assert composed.info.path == str(scaled_dir)


def trainer_update(name: str, value: float) -> tuple[Trainer, dict, WeightsGroup]:
    """A trainer process whose group `name` sets the final norm's weight to `value`: the trainer,
    that tensor by name, and the group to join."""
    port = free_port()
    trainer = Trainer(port, name)
    tensors = {"model.norm.weight": torch.full((576,), value)}
    return trainer, tensors, WeightsGroup(name, "127.0.0.1", port, 1, 2, None, 60.0)


def announced(tensors: dict) -> list[AnnouncedTensor]:
    return [AnnouncedTensor(n, "float32", tuple(t.shape)) for n, t in tensors.items()]


async def test_a_trainers_update_reaches_the_generation_engine_through_the_dense_engine(
    composed, version, reference
):
    collective = composed.weights.collective
    trainer, tensors, group = trainer_update("composed", 1.25)
    try:
        await collective.join(group)
        trainer.broadcast([[[576], "float32", 1.25]])
        await collective.receive(group.name, announced(tensors))
        assert await trainer.outcome() == "sent"
        assert len(sent(composed.generation, "/update_weights_from_distributed")) == 0
        await assert_generation_rows(composed, received_version(version, tensors))
        ids = [5, 6, 7]
        with torch.no_grad():
            norm = reference.model.model.norm.weight
            kept = norm.clone()
            norm.copy_(tensors["model.norm.weight"])
            want = last_row(reference.model, ids)
            norm.copy_(kept)
        np.testing.assert_allclose((await engine_rows(composed, [ids]))[0], want, atol=1e-4)
        await collective.leave(group.name)
    finally:
        trainer.stop()


async def test_tensors_the_generation_engine_refuses_leave_the_model_unusable_until_weights_load(
    composed, version, model_dir, monkeypatch
):
    async def refuse(tensors):
        raise WeightsError("refused")

    monkeypatch.setattr(composed.generation.weights.device_tensors, "load", refuse)
    collective = composed.weights.collective
    trainer, tensors, group = trainer_update("composed_refused", 0.5)
    try:
        await collective.join(group)
        trainer.broadcast([[[576], "float32", 0.5]])
        with pytest.raises(EngineUnavailableError, match="hold different weights.*refused"):
            await collective.receive(group.name, announced(tensors))
        assert await trainer.outcome() == "sent"
        with pytest.raises(EngineUnavailableError):
            await engine_rows(composed, ROWS)
        assert not composed.status().healthy
        await collective.leave(group.name)
    finally:
        trainer.stop()
    monkeypatch.undo()
    await composed.weights.load(str(model_dir))  # both engines again on one set of weights
    assert composed.status().healthy
    await assert_generation_rows(composed, await handed_version(composed, version))
