"""Graceful shutdown: after SIGTERM, drain, then end what is left cleanly.

    SIGTERM ─► draining: /health answers 503, new requests get a 503, requests in flight go on
            ─► nothing in flight, or `shutdown_grace_s` passed ─► ending: what still runs is cancelled;
               a stream ends with an error event and `data: [DONE]`, an unanswered request gets a
               503 (gateway/guard.py writes both)
            ─► uvicorn's own shutdown: listeners and connections closed, the app's lifespan ends

uvicorn alone closes its listeners at once (a readiness probe then sees a refused connection, not
a 503) and, at the end of its grace period, cancels requests mid-body: a stream's chunked body is
cut, with a traceback per request. A drained shutdown exits 0, not by re-raising SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn
from litestar.types import ASGIApp

from gateway.server.protocol import protocol_with_limits
from gateway.settings import Settings

log = logging.getLogger(__name__)

SHUTDOWN_CANCEL = "logprob_gateway: shutdown grace period over"
ENDING_WAIT_S = 5.0  # for cancelled requests to write their last bytes, before uvicorn closes them


class Shutdown:
    """The shutdown state the app and its guard read, and the requests they let the server end."""

    def __init__(self) -> None:
        self.draining = False  # SIGTERM came: /health is 503, new requests are refused
        self.ending = False  # the grace period is over: requests still running are being cancelled
        self.requests: set[asyncio.Task[None]] = set()  # the app's task of every request in flight

    def end(self) -> None:
        """Cancel every request in flight; each ends itself as gateway/guard.py says."""
        self.ending = True
        for task in self.requests:
            task.cancel(msg=SHUTDOWN_CANCEL)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose exit waits for the app to drain (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, shutdown: Shutdown, grace_s: float) -> None:
        super().__init__(config)
        self.shutdown_state = shutdown
        self.grace_s = grace_s
        self._deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:  # drained, the process exits 0 rather than re-raising SIGTERM
            self._captured_signals.remove(sig)

    async def on_tick(self, counter: int) -> bool:
        should_exit = await super().on_tick(counter)
        if not should_exit or self.force_exit:
            return should_exit
        state = self.shutdown_state
        now = time.monotonic()
        if self._deadline is None:
            log.info("draining: %d requests in flight, for at most %g s", len(state.requests), self.grace_s)
            state.draining = True
            self._deadline = now + self.grace_s
        if not state.requests:
            return True
        if now >= self._deadline and not state.ending:
            log.warning("grace period over: ending %d requests still in flight", len(state.requests))
            state.end()
            self._deadline = now + ENDING_WAIT_S
        return state.ending and now >= self._deadline


def draining_server(
    app: ASGIApp, settings: Settings, shutdown: Shutdown, **uvicorn_options: object
) -> DrainingServer:
    """The server of `app`: its `run()` serves until SIGTERM, SIGINT or `should_exit`, then drains
    and shuts down as described above."""
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=protocol_with_limits(settings.limits),
        timeout_graceful_shutdown=ENDING_WAIT_S,  # the drain happened before uvicorn's own shutdown
        **uvicorn_options,  # type: ignore[arg-type]
    )
    return DrainingServer(config, shutdown, settings.shutdown_grace_s)
