"""The transformers engine's capabilities: adapters, new weights (from disk or a trainer's
collective) and its prefix keys/values. Each runs its model work on the engine's worker thread,
so never during a forward pass."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import replace
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from backends import engine as contract
from backends.errors import AdapterError
from backends.rows import PackedRows
from backends.transformers.host_copy import CudaHostMemory, WrittenRows
from backends.transformers.weights_collective import CollectiveGroups
from backends.types import AnnouncedTensor, ModelInfo, WeightsGroup
from backends.weights_in_place import copy_tensors_in_place, copy_weights_in_place, model_parameters

log = logging.getLogger(__name__)
T = TypeVar("T")


class TransformersEngine(Protocol):
    """What the capabilities use of backends.transformers.engine.TransformersEngine (imported from
    there, this module would close an import cycle)."""

    model: Any
    info: ModelInfo
    _peft: Any
    lane: Any
    prefix_kv: Any
    groups: CollectiveGroups
    steps: Any  # its StepScheduler: dense rows and generation steps in shared passes

    def _run(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]: ...

    def _forget_old_weights(self) -> None: ...


class TransformersAdapters(contract.Adapters):
    """PEFT's mixed-adapter batches: the model is wrapped at the first adapter, unwrapped at the last."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.engine = engine

    async def load(self, name: str, path: str) -> None:
        await self.engine._run(self._load, name, path)

    async def unload(self, name: str) -> None:
        await self.engine._run(self._unload, name)

    def _load(self, name: str, path: str) -> None:
        from peft import PeftModel

        engine = self.engine
        if engine.prefix_kv is not None:  # K/V computed under an earlier adapter of this name
            engine.prefix_kv.drop_adapter(name)
        if engine.lane is not None:  # its graphs call the modules PEFT is about to wrap
            engine.lane.clear()
        try:
            if engine._peft is None:
                engine._peft = PeftModel.from_pretrained(
                    engine.model, path, adapter_name=name, is_trainable=False
                )
                engine._peft.eval()
            else:
                engine._peft.load_adapter(path, adapter_name=name, is_trainable=False)
        except Exception as exc:  # shape mismatches, missing modules, unreadable files
            if engine._peft is not None and name in engine._peft.peft_config:
                engine._peft.delete_adapter(name)
            raise AdapterError(
                f"adapter {name!r} does not fit this model: {type(exc).__name__}: {exc}"
            ) from exc

    def _unload(self, name: str) -> None:
        engine = self.engine
        if engine._peft is None or name not in engine._peft.peft_config:
            raise AdapterError(f"adapter {name!r} is not loaded")
        if engine.prefix_kv is not None:
            engine.prefix_kv.drop_adapter(name)
        if len(engine._peft.peft_config) == 1:  # the last one: back to the plain model
            engine.model = engine._peft.unload()
            engine._peft = None
            if engine.lane is not None:
                engine.lane.reset(engine.model)
        else:
            engine._peft.delete_adapter(name)


class TransformersCollective(contract.Collective):
    def __init__(self, engine: TransformersEngine) -> None:
        self.engine = engine

    async def join(self, group: WeightsGroup) -> None:
        await self.engine.groups.join(group)

    async def receive(self, group_name: str, tensors: Sequence[AnnouncedTensor]) -> None:
        engine = self.engine
        parameters = await engine._run(model_parameters, engine.model, True)
        received = await engine.groups.receive(group_name, tensors, parameters)
        await engine._run(self._load_received, received)

    def _load_received(self, received: dict[str, torch.Tensor]) -> None:
        copy_tensors_in_place(model_parameters(self.engine.model, aliases=True), received)
        self.engine._forget_old_weights()
        log.info("%d tensors received over a collective loaded", len(received))

    async def leave(self, group_name: str) -> None:
        await self.engine.groups.leave(group_name)


class TransformersOwnTensors(contract.OwnTensors):
    def __init__(self, engine: TransformersEngine) -> None:
        self.engine = engine

    async def named(self, names: Collection[str] | None = None) -> list[tuple[str, Any]]:
        return await self.engine._run(self._named, names)

    def _named(self, names: Collection[str] | None) -> list[tuple[str, Any]]:
        """On the worker thread, after the device has run every copy into the parameters (they
        were queued on this thread's stream)."""
        parameters = model_parameters(self.engine.model, aliases=names is not None)
        if names is not None:
            parameters = {name: parameters[name] for name in names}
        if any(p.is_cuda for p in parameters.values()):
            torch.cuda.current_stream().synchronize()
        return [(name, p.detach()) for name, p in parameters.items()]


class TransformersWeights(contract.Weights):
    held_between_steps = True  # generation steps are computed when asked for

    def __init__(self, engine: TransformersEngine) -> None:
        self.engine = engine
        self.collective = TransformersCollective(engine)
        self.own_tensors = TransformersOwnTensors(engine)

    async def load(self, path: str) -> None:
        await self.engine._run(self._load, path)

    def _load(self, path: str) -> None:
        copy_weights_in_place(self.engine.model, path)
        self.engine._forget_old_weights()
        self.engine.info = replace(self.engine.info, path=str(path))


class TransformersPrefixCache(contract.PrefixCache):
    def __init__(self, engine: TransformersEngine) -> None:
        self.engine = engine

    async def flush(self) -> None:
        kept = self.engine.prefix_kv
        if kept is not None:  # on the worker thread: never during a forward pass
            await self.engine._run(kept.clear)


class TransformersHostMemory(CudaHostMemory, contract.HostMemory):
    """CudaHostMemory's copies, with rows the engine computes for them."""

    def __init__(self, engine: TransformersEngine) -> None:
        super().__init__(engine.info.vocab_size)
        self.engine = engine

    async def write_rows(
        self,
        rows: PackedRows,
        adapters: Sequence[str | None],
        arrays: Sequence[np.ndarray],
        positions: Sequence[int] | None,
    ) -> None:
        """The rows in a pass shared like any other dense call's, written from the device where
        they go; returns once the copies are queued."""
        into = WrittenRows(arrays, positions)
        await self.engine.steps.submit(
            [(r, k, a, into) for r, k, a in zip(rows.views(), rows.keys, adapters, strict=True)]
        )
