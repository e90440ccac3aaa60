"""New weights for a served model while it serves, without mixing them with the old.

Every request that reads a model's weights (dense rows, a generated choice, prompt logprobs)
holds the model's `WeightsLock` for reading while it does. An update takes it for writing: it
waits for those requests to finish, on the weights they started with, and holds new ones back
until the engine has the new weights and the model's fingerprint, and with it every output-cache
key (in process and in Redis), has changed.

Generation can be paused, as SGLang pauses it for a trainer's update (`/pause_generation`). New
requests then wait at the door. A generated choice passes `step()` before each engine step: while
paused in `abort` mode it ends there (finish reason "abort"); in `retract` or `in_place` mode it is
held there, and a held choice no longer counts as reading, so an update can go ahead while it
waits; after `/continue_generation` it goes on, on the weights it then finds. Requests that do not
step (dense rows, prompt scores) are never held: an update waits for them, so each of their
answers, and each row the output cache stores, comes from one set of weights. Neither are the
streams of an engine that generates ahead of its consumer (vLLM, SGLang): they run to their end,
and an update waits for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Literal

PauseMode = Literal["abort", "retract", "in_place"]


class GenerationAborted(Exception):
    """A generated choice ended by `/pause_generation` in abort mode."""


class ReadersOutlasted(Exception):
    """An update's wait for the weights' readers passed its bound; nothing changed."""

    def __init__(self, running: int, wait_s: float) -> None:
        super().__init__(f"{running} requests still read the weights after {wait_s:g} s")
        self.running, self.wait_s = running, wait_s


class WeightsLock:
    """Many readers or one writer; a waiting writer holds new readers back, so steady traffic
    cannot keep an update waiting for ever. A task that reads already reads on (one request's
    several engine calls), or it would wait for an update that waits for it. Single event loop:
    every change of state wakes whoever waits for one."""

    def __init__(self, hold_at_steps: bool = True) -> None:
        # False for an engine whose streams run ahead of their consumer: nothing to hold them at
        self.hold_at_steps = hold_at_steps
        self._readers: dict[asyncio.Task | None, int] = {}  # reading tasks, and how often each
        self._adapter_readers: dict[str, int] = {}  # readings that use each adapter
        self._held: set[asyncio.Task | None] = set()  # readers held at a step while paused
        self._entering = 0  # requests waiting at the door
        self._update = False  # an update is under way, or waits for readers
        self._pause: PauseMode | None = None
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await self._changed.wait()

    @property
    def paused(self) -> PauseMode | None:
        return self._pause

    @property
    def running(self) -> int:
        """Readers not held at a step: what an update waits for."""
        return len(self._readers) - len(self._held)

    @property
    def waiting(self) -> int:
        """Requests held at the door or at a step."""
        return self._entering + len(self._held)

    async def until_idle(self) -> None:
        """Until nothing runs: every reader gone or held."""
        await self._until(lambda: not self.running)

    def pause(self, mode: PauseMode) -> None:
        self._pause = mode
        self._notify()

    def resume(self) -> None:
        self._pause = None
        self._notify()

    @asynccontextmanager
    async def reading(self, adapter: str | None = None) -> AsyncIterator[None]:
        """The weights read, the `adapter`'s among them, until the block ends."""
        task = asyncio.current_task()
        if task not in self._readers:
            self._entering += 1
            try:
                await self._until(lambda: not self._update and self._pause is None)
            finally:
                self._entering -= 1
        self._readers[task] = self._readers.get(task, 0) + 1
        if adapter is not None:
            self._adapter_readers[adapter] = self._adapter_readers.get(adapter, 0) + 1
        try:
            yield
        finally:
            self._readers[task] -= 1
            if not self._readers[task]:
                del self._readers[task]
                self._notify()
            if adapter is not None:
                self._adapter_readers[adapter] -= 1
                if not self._adapter_readers[adapter]:
                    del self._adapter_readers[adapter]
                    self._notify()

    async def until_unread(self, adapter: str, wait_s: float) -> None:
        """Until no request reads `adapter`; ReadersOutlasted past `wait_s`."""
        try:
            await asyncio.wait_for(self._until(lambda: adapter not in self._adapter_readers), wait_s)
        except TimeoutError:
            raise ReadersOutlasted(self._adapter_readers.get(adapter, 0), wait_s) from None

    async def step(self) -> None:
        """Before an engine step of a generated choice (a reader): GenerationAborted while paused
        in abort mode; held while paused otherwise, and then until no update is under way."""
        if self._pause is None:
            return
        if self._pause == "abort":
            raise GenerationAborted
        task = asyncio.current_task()
        if not self.hold_at_steps or task not in self._readers:
            return
        self._held.add(task)
        self._notify()
        try:
            await self._until(lambda: self._pause == "abort" or (self._pause is None and not self._update))
        finally:
            self._held.discard(task)
            self._notify()
        if self._pause == "abort":
            raise GenerationAborted

    @asynccontextmanager
    async def writing(self, wait_s: float | None = None) -> AsyncIterator[None]:
        """Held once no request reads (`wait_s`: for at most that long, else ReadersOutlasted, and
        the requests held back meanwhile go on)."""
        await self._until(lambda: not self._update)  # one update at a time
        self._update = True
        try:
            try:
                await asyncio.wait_for(self.until_idle(), wait_s)
            except TimeoutError:
                raise ReadersOutlasted(self.running, wait_s or 0.0) from None
            yield
        finally:
            self._update = False
            self._notify()
