"""New weights for a served model while it serves, without mixing them with the old.

Every request that reads a model's weights (dense rows, a generated choice, prompt logprobs)
holds the model's `WeightsLock` for reading while it does. An update takes it for writing: it
waits for those requests to finish, on the weights they started with, and holds new ones back
until the engine has the new weights and the model's fingerprint, and with it every output-cache
key (in process and in Redis), has changed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path


class WeightsLock:
    """Many readers or one writer; a waiting writer holds new readers back, so steady traffic
    cannot keep an update waiting for ever. A task that reads already reads on (one request's
    several engine calls), or it would wait for an update that waits for it. Single event loop,
    no lock of its own."""

    def __init__(self) -> None:
        self._readers: dict[asyncio.Task | None, int] = {}  # reading tasks, and how often each
        self._update: asyncio.Event | None = None  # set once the update under way is over
        self._drained: asyncio.Event | None = None  # set once its last reader has left

    @asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        task = asyncio.current_task()
        if task not in self._readers:
            while self._update is not None:
                await self._update.wait()
        self._readers[task] = self._readers.get(task, 0) + 1
        try:
            yield
        finally:
            self._readers[task] -= 1
            if not self._readers[task]:
                del self._readers[task]
                if not self._readers and self._drained is not None:
                    self._drained.set()

    @asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        while self._update is not None:  # one update at a time
            await self._update.wait()
        update = self._update = asyncio.Event()
        self._drained = asyncio.Event()
        try:
            if self._readers:
                await self._drained.wait()
            yield
        finally:
            self._update = self._drained = None
            update.set()


def weight_files_stat(path: str | Path) -> list[str]:
    """Name, size and modification time of each weights file: a checkpoint written again with the
    same tensor shapes (a training step) has the same headers but not the same files."""
    return [
        f"{file.name}:{file.stat().st_size}:{file.stat().st_mtime_ns}"
        for file in sorted(Path(path).glob("*.safetensors"))
    ]
