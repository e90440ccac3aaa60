"""A change of a model's state (new weights, an adapter unloaded) runs to its end even when the
request that asked for it is cancelled (its client went away): a load continues on its thread
regardless, so a change cut short would serve new weights under the old `weight_version`, or
hide an adapter that is still loaded."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)
_running: set[asyncio.Task[Any]] = set()  # changes whose callers left, held until they end


async def to_the_end(change: Coroutine[Any, Any, T]) -> T:
    """`change`'s result; if the caller is cancelled meanwhile, `change` still runs to its end."""
    task = asyncio.ensure_future(change)
    _running.add(task)
    task.add_done_callback(_finished)
    return await asyncio.shield(task)


def _finished(task: asyncio.Task[Any]) -> None:
    _running.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.debug("a model change ended with %s", type(task.exception()).__name__)
