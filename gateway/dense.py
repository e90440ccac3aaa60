"""Dense rows for a request: the output cache first, then the batcher for what it lacks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import numpy as np

from backends.base import RowsTarget
from gateway.cache import DenseRowCache
from gateway.registry import ServedModel

log = logging.getLogger(__name__)


async def dense_rows(
    served: ServedModel,
    cache: DenseRowCache | None,
    rows: Sequence[list[int]],
    adapter: str | None = None,
    store_after: asyncio.Future[None] | None = None,
    target: RowsTarget | None = None,
) -> tuple[np.ndarray, int]:
    """float32 [len(rows), vocab] and how many rows came from the cache (bit-identical to computing
    them). Computed rows are cached once `store_after` is done (the response that carries them).
    When none is cached, the engine may write them into `target` itself (`target.written`)."""
    engine = served.require_engine()
    assert served.batcher is not None
    if cache is None:
        return await served.batcher.submit(rows, adapter, target), 0
    adapter_id = None if adapter is None else f"{adapter}:{served.adapters[adapter].fingerprint}"
    keys = cache.keys(served.fingerprint, adapter_id, rows)
    cached = await cache.lookup(keys, engine.vocab_size)
    missing = [i for i, row in enumerate(cached) if row is None]
    if len(missing) == len(rows):  # nothing cached (every SMC step): the engine's rows as they are
        computed = await served.batcher.submit(rows, adapter, target)
        landing = target.landing if target is not None else None
        cache.store_in_background(keys, computed, store_after, landing)
        return computed, 0
    out = np.empty((len(rows), engine.vocab_size), dtype=np.float32)
    for i, row in enumerate(cached):
        if row is not None:
            out[i] = row
    if missing:
        computed = await served.batcher.submit([rows[i] for i in missing], adapter)
        out[missing] = computed
        cache.store_in_background([keys[i] for i in missing], computed, store_after)
    hits = len(rows) - len(missing)
    log.debug("model %s: %d rows, %d from the cache", served.name, len(rows), hits)
    return out, hits
