"""Weights over a collective, at the engine layer: the answer for engines without the capability,
and backends/transformers/weights_collective.py against a trainer made of TorchRL's own group
code, in this process (gloo on threads). The real engine and a trainer process:
tests/gateway/test_weight_sync.py."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
import typing

import pytest
import torch

from backends.engine import Collective, Engine
from backends.errors import WeightsError
from backends.registry import engine_class
from backends.transformers.weights_collective import (
    DTYPES,
    TRAINER_NCCL_ENV,
    CollectiveGroups,
    match_trainer_nccl_env,
    mismatch,
)
from backends.types import AnnouncedTensor, WeightsGroup
from bench.launcher import free_port
from gateway.errors import NotSupportedError
from gateway.models.served import ServedModel
from gateway.models.weights_update import join_weights_group, leave_weights_group, update_weights_from_group
from gateway.schemas.weight_sync import TensorDtype
from gateway.settings import ModelSettings


async def test_the_base_class_has_no_capability_and_the_gateway_says_the_engine_cannot():
    class Plain(Engine):  # the abstract methods only
        load = next_token_logprobs = prompt_logprobs = generate = None  # type: ignore[assignment]

    engine = Plain()
    assert engine.adapters is None and engine.weights is None
    assert engine.host_memory is None and engine.prefix_cache is None
    served = ServedModel(ModelSettings(name="plain", backend="mock"), engine=engine)
    group = WeightsGroup("g", "127.0.0.1", 1, 1, 2, None, 1.0)
    for call in (
        join_weights_group(served, group),
        update_weights_from_group(served, "g", [AnnouncedTensor("w", "float32", (1,))]),
        leave_weights_group(served, "g"),
    ):
        with pytest.raises(NotSupportedError, match="Plain cannot receive weights over a collective"):
            await call


@pytest.mark.parametrize(
    ("backend", "library"), [("vllm", "vllm"), ("mlx", "mlx_lm"), ("sglang", "transformers")]
)
def test_engines_without_collectives_keep_the_base_classs_answer(backend, library):
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed")
    module = sys.modules[engine_class(backend).__module__]
    own = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, Collective)]
    assert own in ([], [Collective]), f"{module.__name__} has a collective of its own: test it"


def test_the_dtypes_announced_are_the_ones_the_api_takes():
    assert set(DTYPES) == set(typing.get_args(TensorDtype))


def test_nccl_settings_match_torchrls_trainer_unless_the_operator_set_them(monkeypatch):
    """TorchRL disables NCCL's P2P and shared-memory transports in its trainer; a receiver that
    kept them fails the first broadcast, so a join over NCCL sets the same where unset."""
    assert TRAINER_NCCL_ENV == {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
    monkeypatch.setenv("NCCL_P2P_DISABLE", "")  # restored (to unset, where it was) at the end
    monkeypatch.delenv("NCCL_P2P_DISABLE")
    monkeypatch.setenv("NCCL_SHM_DISABLE", "0")  # an operator's choice
    assert match_trainer_nccl_env() == {"NCCL_P2P_DISABLE": "1"}
    assert os.environ["NCCL_P2P_DISABLE"] == "1" and os.environ["NCCL_SHM_DISABLE"] == "0"
    assert match_trainer_nccl_env() == {}


def test_an_announcement_that_does_not_fit_says_why():
    parameters = {"a.weight": torch.zeros(3, 4), "b.weight": torch.zeros(2, dtype=torch.bfloat16)}
    fits = [AnnouncedTensor("a.weight", "float16", (3, 4)), AnnouncedTensor("b.weight", "float32", (2,))]
    assert mismatch(fits, parameters) is None  # floating point converts
    problem = mismatch(
        [
            AnnouncedTensor("a.weight", "float32", (4, 3)),
            AnnouncedTensor("b.weight", "int64", (2,)),
            AnnouncedTensor("c.weight", "float32", (1,)),
            AnnouncedTensor("a.weight", "float32", (3, 4)),
        ],
        parameters,
    )
    assert problem is not None and problem.startswith("4 of 4 tensors do not fit this model")
    assert "'a.weight' has shape [4, 3], this model's has [3, 4]" in problem
    assert "'b.weight' is announced as int64, this model's is bfloat16" in problem
    assert "no parameter 'c.weight'" in problem and "(and 1 more)" in problem


TRAINER = """
import json, sys
from datetime import timedelta
import torch
from torchrl.weight_update.llm.sglang_nccl import _init_custom_process_group

group = _init_custom_process_group(
    backend="gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], world_size=2, rank=0,
    group_name=sys.argv[2], timeout=timedelta(seconds=10),
)
for line in sys.stdin:  # each line: the tensors to broadcast, as [[shape, dtype, value], ...]
    try:
        for shape, dtype, value in json.loads(line):
            tensor = torch.full(shape, value, dtype=getattr(torch, dtype))
            torch.distributed.broadcast(tensor, src=0, group=group)
        print("sent", flush=True)
    except Exception as exc:
        print("failed", type(exc).__name__, flush=True)
"""


class Trainer:
    """Rank 0 in a process of its own: TorchRL's `_init_custom_process_group` with gloo, then
    broadcasts of tensors the test names."""

    def __init__(self, port: int, name: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", TRAINER, str(port), name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def broadcast(self, tensors: list[tuple[list[int], str, float]]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(tensors) + "\n")
        self.process.stdin.flush()

    async def outcome(self) -> str:
        """What the last broadcast came to: "sent", or "failed <error>"."""
        assert self.process.stdout is not None
        return (await asyncio.wait_for(asyncio.to_thread(self.process.stdout.readline), 60)).strip()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
async def joined():
    """A CollectiveGroups on the CPU that has joined a trainer's group named "g"."""
    pytest.importorskip("torchrl")
    port = free_port()
    trainer = Trainer(port, "g")
    groups = CollectiveGroups(torch.device("cpu"))
    try:
        await groups.join(WeightsGroup("g", "127.0.0.1", port, 1, 2, None, 60.0))
        yield groups, trainer
    finally:
        await groups.aclose()
        trainer.stop()


async def test_received_tensors_are_staged_converted_and_refused_when_they_do_not_fit(joined):
    groups, trainer = joined
    parameters = {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}
    announced = [AnnouncedTensor("w", "float32", (2, 3)), AnnouncedTensor("b", "float64", (3,))]
    trainer.broadcast([[[2, 3], "float32", 1.25], [[3], "float64", 2.5]])
    staged = await groups.receive("g", announced, parameters)
    assert await trainer.outcome() == "sent"
    assert torch.equal(staged["w"], torch.full((2, 3), 1.25))
    assert staged["b"].dtype == torch.bfloat16 and torch.equal(
        staged["b"], torch.full((3,), 2.5, dtype=torch.bfloat16)
    )
    assert torch.equal(parameters["w"], torch.zeros(2, 3))  # staged, not loaded
    trainer.broadcast([[[3, 2], "float32", 1.0], [[3], "int32", 1]])
    wrong = [AnnouncedTensor("w", "float32", (3, 2)), AnnouncedTensor("b", "int32", (3,))]
    with pytest.raises(WeightsError, match="received and dropped, no weights changed"):
        await groups.receive("g", wrong, parameters)
    assert await trainer.outcome() == "sent"  # the trainer was not left waiting
    trainer.broadcast([[[2, 3], "float32", 3.0], [[3], "float64", 2.5]])  # the group still works
    assert torch.equal((await groups.receive("g", announced, parameters))["w"], torch.full((2, 3), 3.0))
    assert await trainer.outcome() == "sent"


async def test_a_tensor_too_large_to_drop_leaves_the_group_and_the_trainer_fails(joined):
    groups, trainer = joined
    parameters = {"w": torch.zeros(2, 3)}
    trainer.broadcast([[[1 << 21], "float32", 1.0]])  # 8 MiB, beyond what the engine receives to drop
    with pytest.raises(WeightsError, match="left group 'g'"):
        await groups.receive("g", [AnnouncedTensor("w", "float32", (1 << 21,))], parameters)
    assert (await trainer.outcome()).startswith("failed")  # at once: no hanging broadcast
    with pytest.raises(WeightsError, match="no weights update group named 'g'"):
        await groups.receive("g", [AnnouncedTensor("w", "float32", (2, 3))], parameters)


async def test_a_trainer_that_dies_mid_transfer_changes_nothing_and_the_group_is_left(joined):
    groups, trainer = joined
    parameters = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    announced = [AnnouncedTensor("w", "float32", (2, 3)), AnnouncedTensor("b", "float32", (3,))]
    receiving = asyncio.create_task(groups.receive("g", announced, parameters))
    trainer.broadcast([[[2, 3], "float32", 1.0]])  # the first of two, then gone
    assert await trainer.outcome() == "sent"
    trainer.stop()
    with pytest.raises(WeightsError, match="no weights changed, and this engine left the group"):
        await asyncio.wait_for(receiving, 60)
    assert torch.equal(parameters["w"], torch.zeros(2, 3))


async def test_a_name_is_joined_once_and_a_trainer_that_never_comes_times_out():
    groups = CollectiveGroups(torch.device("cpu"))
    started = asyncio.get_running_loop().time()
    with pytest.raises(WeightsError, match="Failed to initialize custom process group"):
        await groups.join(WeightsGroup("late", "127.0.0.1", free_port(), 1, 2, None, 1.0))
    assert asyncio.get_running_loop().time() - started < 30
    with pytest.raises(WeightsError, match="needs an engine on a CUDA device"):
        await groups.join(WeightsGroup("nccl", "127.0.0.1", free_port(), 1, 2, "nccl", 1.0))
    with pytest.raises(WeightsError, match="does not exist"):
        await groups.leave("late")
    await groups.aclose()


async def test_joins_given_up_on_are_answered_at_the_timeout_and_bounded_in_number():
    """A peer that accepts connections but never answers holds torch's join for ever: each join is
    answered at its timeout all the same, and at most `max_pending_joins` may still be trying."""
    pending = 3
    groups = CollectiveGroups(torch.device("cpu"))
    loop = asyncio.get_running_loop()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        port = listener.getsockname()[1]
        started = loop.time()
        joins = [
            groups.join(WeightsGroup(f"g{i}", "127.0.0.1", port, 1, 2, None, 0.5, pending))
            for i in range(pending)
        ]
        failures = await asyncio.gather(*joins, return_exceptions=True)
        assert loop.time() - started < 2.5
        assert all(isinstance(f, WeightsError) and "within 0.5 s" in str(f) for f in failures), failures
        with pytest.raises(WeightsError, match="still trying to reach their trainers"):
            await groups.join(WeightsGroup("one-more", "127.0.0.1", port, 1, 2, None, 0.5, pending))
    # the listener is gone: the threads fail, and their places are free, every one (a bound of 1
    # lets a join through only when no other is still trying)
    deadline = loop.time() + 30
    alone = WeightsGroup("g0", "127.0.0.1", port, 1, 2, None, 0.5, max_pending_joins=1)
    while "still trying to reach their trainers" in (failure := await join_failure(groups, alone)):
        assert loop.time() < deadline, "the joins given up on never ended"
        await asyncio.sleep(0.1)
    assert "Failed to initialize custom process group" in failure
    await groups.aclose()


async def join_failure(groups: CollectiveGroups, group: WeightsGroup) -> str:
    """Why `group` was not joined."""
    with pytest.raises(WeightsError) as failure:
        await groups.join(group)
    return str(failure.value)
