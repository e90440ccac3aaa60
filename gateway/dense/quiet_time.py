"""Work that can wait runs while an engine computes, when clients on this host wait.

A client on this host gets its answer in its own memory and at once computes on every core (an SMC
loop samples the next tokens from the rows it got), while the gateway, its response sent, still
has work: storing those rows in the output cache. Run then, that work takes a core from the
client's threads, and a parallel region waits for its slowest thread, so the client's sampling
slowed with the cache on (docs/performance.md).
While an engine computes, the clients that asked wait for their answers: work deferred until the
next engine call begins costs them nothing. It waits at most `timeout_s` (no next call).
"""

from __future__ import annotations

import asyncio
import contextlib


class QuietTime:
    def __init__(self, timeout_s: float = 1.0) -> None:
        self.timeout_s = timeout_s
        self._next = asyncio.Event()

    def now(self) -> None:
        """An engine call begins, or the deferred work is needed now: what waits runs."""
        self._next.set()
        self._next = asyncio.Event()

    async def wait(self) -> None:
        """Until the next `now()`, at most `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._next.wait(), self.timeout_s)
