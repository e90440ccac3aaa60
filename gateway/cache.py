"""Output cache of dense rows, shared by gateway replicas through Redis, or in-process.

The cache is an optimisation, never part of correctness: any failure of the store (down, slow,
garbage) reads as a miss, and the rows are computed as if there were no cache.

    DenseRowCache             keys, value framing and checks, over one RowStore
    RowStore                  values by key (gateway/row_stores.py)
     ├── MemoryStore          in-process LRU bounded by the memory its values keep alive
     └── RedisStore           pipelined MGET / SET EX, timeouts, circuit breaker

Keys in Redis: `{namespace}:v{FORMAT}:row:{sha256(model fingerprint, adapter, dtype, token ids)}`;
in process, the same inputs as a `RowKey`, which hashes once and costs less than a digest.
Values bound for Redis are framed: a 16-byte header (magic + version, row length, CRC-32 of the
payload) and the raw little-endian float32 row. A value whose header, length or checksum is off is
a miss and is deleted. The values of one engine step are views of one buffer, filled by one copy
outside the interpreter lock, on one thread of lower priority after the response: a client on the
same machine is then sampling from its rows on every core, and a store competing for those cores
costs it more than the store itself.

The in-process store keeps the engine's rows themselves, as read-only views of the matrix the
engine returned: no copy, no framing. A 256-row step is 50 MB; copying it into the cache cost a
client on the same host more time per step than the gateway's whole call through shared memory.
Engines return a fresh matrix per call and nothing on the response path writes to it.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import struct
import sys
import threading
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from backends.base import Landing
from gateway.metrics import Metrics
from gateway.quiet_time import QuietTime
from gateway.row_stores import CacheStats, Key, MemoryStore, RedisStore, RowStore, Value
from gateway.settings import CacheSettings
from logprob_gateway_client.row_key import RowKey

log = logging.getLogger(__name__)

FORMAT = 2  # 2: CRC-32 instead of blake2b-64 (3x faster on 50 MB steps of 256 rows)
_MAGIC = b"LGR" + bytes([FORMAT])
_HEADER = struct.Struct("<4sIQ")  # magic+version, float32 count, CRC-32 of the payload


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):  # Linux: a thread has its own nice value
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


@functools.cache
def _storer() -> ThreadPoolExecutor:
    """Started by the first store bound for Redis, not by importing this module."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-store", initializer=_lower_priority)


def weights_fingerprint(model_dir: str | Path, *extra: str) -> str:
    """Identity of a model's weights without reading them: config.json and every safetensors
    header (tensor names, dtypes, shapes, offsets), plus `extra` (backend, dtype, ...)."""
    digest = hashlib.sha256()
    for part in extra:
        digest.update(part.encode() + b"\0")
    root = Path(model_dir)
    for name in ("config.json", "model.safetensors.index.json"):
        if (root / name).is_file():
            digest.update(name.encode() + b"\0" + (root / name).read_bytes())
    for weights in sorted(root.glob("*.safetensors")):
        with weights.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            digest.update(weights.name.encode() + b"\0" + f.read(min(size, 100_000_000)))
    return digest.hexdigest()


def _int64_le(ids: Sequence[int]) -> array.array:
    """Token ids as little-endian int64 bytes (a third faster than through numpy for short lists)."""
    packed = array.array("q", ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed


class DenseRowCache:
    def __init__(
        self,
        store: RowStore,
        *,
        namespace: str = "lpg",
        stats: CacheStats | None = None,
        metrics: Metrics | None = None,
        quiet: QuietTime | None = None,
    ) -> None:
        self.store = store
        self.quiet = quiet  # stores wait for it: see gateway/quiet_time.py
        self.namespace = namespace
        self.stats = stats or CacheStats()
        self.metrics = metrics or Metrics()
        self._storing: dict[Key, asyncio.Task[None]] = {}  # key -> its store still under way
        self._prefixes: dict[tuple[str, str | None], hashlib._Hash] = {}  # key hashes, model part done

    def keys(self, fingerprint: str, adapter: str | None, rows: Sequence[Sequence[int]]) -> list[Key]:
        """The keys of `rows`: `key`'s digests for Redis, RowKeys of the same inputs in process."""
        if isinstance(self.store, MemoryStore):
            scope = (fingerprint, adapter)
            return [RowKey(scope, tuple(ids)) for ids in rows]
        return [self.key(fingerprint, adapter, ids) for ids in rows]

    def key(self, fingerprint: str, adapter: str | None, ids: Sequence[int]) -> str:
        prefix = self._prefixes.get((fingerprint, adapter))
        if prefix is None:
            prefix = hashlib.sha256(json.dumps([fingerprint, adapter, "float32"]).encode())
            self._prefixes[fingerprint, adapter] = prefix
        digest = prefix.copy()
        digest.update(_int64_le(ids))
        return f"{self.namespace}:v{FORMAT}:row:{digest.hexdigest()}"

    @staticmethod
    def encode(row: np.ndarray) -> bytes:
        return bytes(DenseRowCache.encode_many(row[None])[0])

    @staticmethod
    def encode_many(rows: np.ndarray) -> list[memoryview]:
        """The values of `rows` [n, width]: views of one buffer [n, header + payload]."""
        count, width = rows.shape
        buffer = np.empty((count, _HEADER.size + 4 * width), dtype=np.uint8)
        buffer[:, _HEADER.size :].view("<f4")[...] = rows  # one copy, outside the interpreter lock
        values = []
        for value in buffer:
            _HEADER.pack_into(value, 0, _MAGIC, width, zlib.crc32(value[_HEADER.size :]))
            values.append(memoryview(value))
        return values

    @staticmethod
    def decode(value: Value, width: int) -> np.ndarray | None:
        if len(value) != _HEADER.size + 4 * width:
            return None
        magic, count, check = _HEADER.unpack_from(value)
        payload = memoryview(value)[_HEADER.size :]
        if magic != _MAGIC or count != width or zlib.crc32(payload) != check:
            return None
        return np.frombuffer(payload, dtype="<f4")

    def _row(self, value: Value, width: int) -> np.ndarray | None:
        if not isinstance(self.store, MemoryStore):
            return self.decode(value, width)
        if isinstance(value, np.ndarray) and value.dtype == np.float32 and value.shape == (width,):
            return value
        return None

    async def lookup(self, keys: Sequence[Key], width: int) -> list[np.ndarray | None]:
        started = time.perf_counter()
        storing = {self._storing[key] for key in keys if key in self._storing}
        if storing:  # read-your-writes within the process: a row being stored is found
            if self.quiet is not None:
                self.quiet.now()
            await asyncio.wait(storing)
        values = await self.store.get_many(keys)
        self.metrics.cache_duration.labels("get").observe(time.perf_counter() - started)
        rows: list[np.ndarray | None] = []
        corrupt = []
        for key, value in zip(keys, values, strict=True):
            row = None if value is None else self._row(value, width)
            if value is not None and row is None:
                corrupt.append(key)
            rows.append(row)
        if corrupt:
            self.stats.corrupt += len(corrupt)
            log.warning("dropping %d corrupted cache values", len(corrupt))
            await self.store.delete_many(corrupt)
        hits = sum(r is not None for r in rows)
        self.stats.hits += hits
        self.stats.misses += len(rows) - hits
        self.metrics.cache_lookups.labels("hit").inc(hits)
        self.metrics.cache_lookups.labels("miss").inc(len(rows) - hits)
        return rows

    async def store_rows(self, keys: Sequence[Key], rows: np.ndarray) -> None:
        started = time.perf_counter()
        if isinstance(self.store, MemoryStore):
            self.store.put_rows(keys, rows)
        else:
            # Megabytes of rows to copy and hash: off the event loop (numpy and zlib release the GIL).
            loop = asyncio.get_running_loop()
            values = await loop.run_in_executor(_storer(), self.encode_many, rows)
            await self.store.set_many(list(zip(keys, values, strict=True)))
        self.metrics.cache_duration.labels("set").observe(time.perf_counter() - started)

    def store_in_background(
        self,
        keys: Sequence[Key],
        rows: np.ndarray,
        after: asyncio.Future[None] | None = None,
        landing: Landing | None = None,
    ) -> None:
        """Store `rows` without holding up the response that carries them, once `after` is done
        (the response written: storing holds the interpreter lock, which the threads writing
        the response need), `landing` has landed (rows still arriving from a GPU) and `quiet`
        says engines compute; `lookup` of these keys waits for it, and `aclose` lets it finish."""
        task = asyncio.create_task(self._store_after(keys, rows, after, landing))
        for key in keys:
            self._storing[key] = task
        task.add_done_callback(lambda done: self._stored(keys, done))

    async def _store_after(
        self,
        keys: Sequence[Key],
        rows: np.ndarray,
        after: asyncio.Future[None] | None,
        landing: Landing | None,
    ) -> None:
        if after is not None:
            await asyncio.wait([after])
        if self.quiet is not None:
            await self.quiet.wait()
        # By the next engine call a GPU's copy has long landed: a thread to wait for it would
        # only cost wake-ups, while the engine needs the interpreter lock.
        if landing is not None and not landing.query():
            await asyncio.to_thread(landing.synchronize)
        await self.store_rows(keys, rows)

    def _stored(self, keys: Sequence[Key], task: asyncio.Task[None]) -> None:
        for key in keys:
            if self._storing.get(key) is task:
                del self._storing[key]
        if not task.cancelled() and task.exception() is not None:
            log.error("storing %d rows failed", len(keys), exc_info=task.exception())

    async def aclose(self) -> None:
        if self._storing:
            if self.quiet is not None:
                self.quiet.now()
            await asyncio.wait(set(self._storing.values()), timeout=30)
        await self.store.aclose()


def build_cache(
    settings: CacheSettings, metrics: Metrics, quiet: QuietTime | None = None
) -> DenseRowCache | None:
    if not settings.enabled:
        return None
    stats = CacheStats()
    store: RowStore
    if settings.redis_url:
        store = RedisStore(
            settings.redis_url,
            ttl_s=settings.ttl_s,
            timeout_s=settings.timeout_s,
            retry_after_s=settings.retry_after_s,
            stats=stats,
            on_error=metrics.cache_errors.inc,
        )
    else:
        store = MemoryStore(settings.memory_bytes)
    return DenseRowCache(store, namespace=settings.namespace, stats=stats, metrics=metrics, quiet=quiet)
