"""A change of a model's state (new weights, an adapter unloaded, a trainer's collective joined
or left) runs to its end even when the request that asked for it is cancelled (its client went
away): a load continues on its thread regardless, and a trainer is broadcasting into a receive,
so a change cut short would serve new weights under the old `weight_version`, hide an adapter
that is still loaded, or leave the trainer's collective hanging."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)
_running: set[asyncio.Future[Any]] = set()  # changes whose callers left, held until they end


async def to_the_end(change: Awaitable[T]) -> T:
    """`change`'s result; if the caller is cancelled meanwhile, `change` still runs to its end,
    and its outcome is logged."""
    task = asyncio.ensure_future(change)
    _running.add(task)
    task.add_done_callback(_running.discard)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_log_outcome)
        raise


def _log_outcome(task: asyncio.Future[Any]) -> None:
    failure = None if task.cancelled() else task.exception()
    if failure is None:
        log.info("a model change whose client had gone away finished")
    else:
        log.warning("a model change whose client had gone away failed: %s", type(failure).__name__)
