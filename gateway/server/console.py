"""What the serving process tells the operator at its terminal: when it is ready, and what Ctrl-C does.

uvicorn says "Uvicorn running on ..." when it listens, before the models have loaded (/health
answers 503 until then), and says nothing after; `announce_ready` logs one line once the models are
loaded and the server listens. Ctrl-C drains like SIGTERM (gateway/server/shutdown.py); uvicorn
turns a second one into a forced exit that cancels whatever still runs at loop close, with a
traceback per request and one for the app's lifespan. `explain_interrupts` says at the first that
a second forces the exit, and at the second ends the requests in flight now through the same path
as an expired grace period (each answered in the error shape, the app's shutdown run), so the
process exits promptly and cleanly; a third is uvicorn's own forced exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterable
from types import FrameType

from gateway.server.shutdown import DrainingServer

log = logging.getLogger(__name__)

_LISTEN_POLL_S = 0.05


def ready_line(models: Iterable[str], host: str, port: int) -> str:
    shown_host = f"[{host}]" if ":" in host else host
    return f"ready: serving {', '.join(models)} on http://{shown_host}:{port}"


def announce_ready(server: DrainingServer, models: Iterable[str], host: str, port: int) -> None:
    """Log the ready line once `server` listens; call it on the event loop once the models loaded."""
    line = ready_line(models, host, port)
    if server.started:
        log.info(line)
        return

    async def when_listening() -> None:
        while not server.started and not server.should_exit:
            await asyncio.sleep(_LISTEN_POLL_S)
        if server.started and not server.should_exit:
            log.info(line)

    task = asyncio.get_running_loop().create_task(when_listening())
    _pending.add(task)  # the loop keeps only a weak reference to a task
    task.add_done_callback(_pending.discard)


_pending: set[asyncio.Task[None]] = set()


def explain_interrupts(server: DrainingServer, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Make Ctrl-C on `server` say what it does and end promptly the second time (see above).
    `loop`: the one the server runs on (default: the running loop when the signal comes)."""
    uvicorn_handler = server.handle_exit

    def handle_exit(sig: int, frame: FrameType | None) -> None:
        state = server.shutdown_state
        if sig != signal.SIGINT:
            uvicorn_handler(sig, frame)
        elif not server.should_exit:
            log.warning(
                "Ctrl-C: draining %d requests in flight, for at most %g s; Ctrl-C again forces the exit",
                len(state.requests),
                server.grace_s,
            )
            uvicorn_handler(sig, frame)
        elif not state.ending:
            log.warning(
                "Ctrl-C again: forcing the exit, ending %d requests in flight now", len(state.requests)
            )
            # on the loop, not inside the signal handler that interrupted it
            try:
                (loop or asyncio.get_running_loop()).call_soon_threadsafe(state.end)
            except RuntimeError:  # no loop runs: nothing is in flight either
                state.end()
        else:
            uvicorn_handler(sig, frame)

    server.handle_exit = handle_exit  # type: ignore[method-assign]
