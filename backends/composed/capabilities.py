"""The composed engine's capabilities that reach both of its engines (adapters, new weights, the
prefix caches) and the dense engine's host memory. Each change lands in both engines or in neither; one under way runs to its end
even when its caller is cancelled, so a departed client never leaves the two engines apart."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Collection, Sequence
from typing import Protocol, TypeVar

import numpy as np

from backends import engine as contract
from backends.errors import EngineUnavailableError, WeightsError
from backends.rows import PackedRows
from backends.types import AnnouncedTensor, ModelInfo, WeightsGroup

log = logging.getLogger(__name__)
T = TypeVar("T")


class ComposedEngine(Protocol):
    """What the capabilities use of backends.composed.engine.ComposedEngine (imported from there,
    this module would close an import cycle)."""

    generation: contract.Engine
    dense: contract.Engine
    info: ModelInfo
    unusable: str | None

    def composed_info(self) -> ModelInfo: ...


async def to_the_end(work: Awaitable[T]) -> T:
    """`work`'s result; a caller cancelled meanwhile still waits for it to end, then is cancelled,
    so nothing changes the engines after the caller (and whatever lock it held) has gone."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
        except BaseException:
            break  # the work's own failure, raised by task.result() below
    if cancelled:
        if not task.cancelled() and task.exception() is not None:
            log.error("composed model: a change its caller left failed: %s", task.exception())
        raise asyncio.CancelledError
    return task.result()


class ComposedAdapters(contract.Adapters):
    """An adapter loads into the dense engine, then the generation engine; when the second
    refuses it, the first unloads it again."""

    def __init__(self, generation: contract.Adapters, dense: contract.Adapters) -> None:
        self.generation = generation
        self.dense = dense

    async def load(self, name: str, path: str) -> None:
        await to_the_end(self._load(name, path))

    async def _load(self, name: str, path: str) -> None:
        await self.dense.load(name, path)
        try:
            await self.generation.load(name, path)
        except Exception:
            await self.dense.unload(name)
            raise

    async def unload(self, name: str) -> None:
        await to_the_end(self._unload(name))

    async def _unload(self, name: str) -> None:
        try:
            await self.dense.unload(name)
        finally:  # an adapter left in one engine would answer for it alone
            await self.generation.unload(name)


async def hand_over(
    lent: contract.OwnTensors, taken: contract.DeviceTensors, names: Collection[str] | None = None
) -> None:
    """The dense engine's tensors (those `names`, or all) loaded into the generation engine on
    the same device."""
    await taken.load(await lent.named(names))


class ComposedCollective(contract.Collective):
    """A trainer's collective joined by the dense engine alone: each update it receives passes on
    to the generation engine on the same device as tensors (no second broadcast). When that
    hand-over fails, the engines hold different weights and the model serves nothing
    (EngineUnavailableError) until weights load into both."""

    def __init__(
        self,
        engine: ComposedEngine,
        dense: contract.Collective,
        lent: contract.OwnTensors,
        taken: contract.DeviceTensors,
    ) -> None:
        self.engine = engine
        self.dense = dense
        self.lent, self.taken = lent, taken

    async def join(self, group: WeightsGroup) -> None:
        await self.dense.join(group)

    async def receive(self, group_name: str, tensors: Sequence[AnnouncedTensor]) -> None:
        await to_the_end(self._receive(group_name, tensors))

    async def _receive(self, group_name: str, tensors: Sequence[AnnouncedTensor]) -> None:
        await self.dense.receive(group_name, tensors)  # WeightsError: nothing changed
        engine = self.engine
        try:
            await hand_over(self.lent, self.taken, [t.name for t in tensors])
        except Exception as exc:
            engine.unusable = (
                f"its engines hold different weights: the generation engine refused the tensors a "
                f"trainer sent ({type(exc).__name__}: {exc}); load weights again"
            )
            log.error("composed model: %s", engine.unusable)
            raise EngineUnavailableError(engine.unusable) from exc

    async def leave(self, group_name: str) -> None:
        await self.dense.leave(group_name)


class ComposedWeights(contract.Weights):
    """New weights into the dense engine, which checks every tensor before it copies one, then
    into the generation engine: handed over as tensors on their device where the dense engine
    lends its tensors and the generation engine takes them, from disk again otherwise. When the
    second fails, the first loads its old weights again. If that fails too, the engines hold
    different weights and the model serves nothing (EngineUnavailableError) until weights load
    into both. A trainer's collective reaches the generation engine only by hand-over
    (ComposedCollective)."""

    def __init__(self, engine: ComposedEngine) -> None:
        generation, dense = engine.generation.weights, engine.dense.weights
        assert generation is not None and dense is not None
        self.engine = engine
        # generation streams are the ones an update may hold: the dense engine runs no stream
        self.held_between_steps = generation.held_between_steps
        self.lent, self.taken = dense.own_tensors, generation.device_tensors
        self.collective = None
        if dense.collective is not None and self.lent is not None and self.taken is not None:
            self.collective = ComposedCollective(engine, dense.collective, self.lent, self.taken)

    async def load(self, path: str) -> None:
        await to_the_end(self._load(path))

    async def _load(self, path: str) -> None:
        engine = self.engine
        dense, generation = engine.dense.weights, engine.generation.weights
        assert dense is not None and generation is not None
        old = engine.dense.info.path
        await dense.load(path)  # WeightsError: nothing changed anywhere
        try:
            if self.lent is not None and self.taken is not None:
                await hand_over(self.lent, self.taken)
            else:
                await generation.load(path)
        except Exception as exc:
            await self._restore(old, exc)
            raise
        finally:
            engine.info = engine.composed_info()
        engine.unusable = None

    async def _restore(self, old: str, failure: Exception) -> None:
        """The old weights back in both engines after the generation engine failed to load new
        ones; the model unusable when they cannot be."""
        engine = self.engine
        dense, generation = engine.dense.weights, engine.generation.weights
        assert dense is not None and generation is not None
        try:
            await dense.load(old)
            if not isinstance(failure, WeightsError):  # it may hold some of the new tensors
                await generation.load(old)
        except Exception as exc:
            engine.unusable = (
                f"its engines hold different weights: the generation engine failed to load new "
                f"weights ({type(failure).__name__}: {failure}) and the old ones could not be "
                f"restored ({type(exc).__name__}: {exc}); load weights again"
            )
            log.error("composed model: %s", engine.unusable)
            raise EngineUnavailableError(engine.unusable) from failure
        log.warning("composed model: the generation engine refused new weights; the old ones are back")


class ComposedHostMemory(contract.HostMemory):
    """The dense engine's, refusing rows while the engines hold different weights."""

    def __init__(self, engine: ComposedEngine, host_memory: contract.HostMemory) -> None:
        self.engine = engine
        self.host_memory = host_memory

    def register(self, address: int, size: int) -> bool:
        return self.host_memory.register(address, size)

    def unregister(self, address: int) -> None:
        self.host_memory.unregister(address)

    async def write_rows(
        self,
        rows: PackedRows,
        adapters: Sequence[str | None],
        arrays: Sequence[np.ndarray],
        positions: Sequence[int] | None,
    ) -> None:
        if self.engine.unusable is not None:
            raise EngineUnavailableError(self.engine.unusable)
        await self.host_memory.write_rows(rows, adapters, arrays, positions)

    def empty(self, rows: int) -> np.ndarray:
        return self.host_memory.empty(rows)

    def wait_landed(self, array: np.ndarray) -> None:
        self.host_memory.wait_landed(array)


class ComposedPrefixCache(contract.PrefixCache):
    """Both engines' kept prefixes (the dense engine's keys/values, the generation engine's)."""

    def __init__(self, caches: Sequence[contract.PrefixCache]) -> None:
        self.caches = list(caches)

    async def flush(self) -> None:
        for cache in self.caches:
            await cache.flush()
