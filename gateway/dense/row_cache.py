"""Output cache of dense rows: in process, or shared by gateway replicas through Redis.

The cache is an optimisation, never part of correctness: any failure of the store (down, slow,
garbage) reads as a miss, and the rows are computed as if there were no cache.

    RowCache          fill, keys, lookup, deferred stores (read-your-writes), statistics
     ├── MemoryRowCache  the engine's rows themselves, in an LRU bounded by the memory they keep
     └── RedisRowCache   framed, checksummed values in Redis (dense/redis_store.py)

`RowCache.fill` is the way through it: the rows it finds go down with the rest, as rows the
engine need not compute (backends/placement.py places them with the computed ones), and it hands
back the computation the caller waits on, whose rows are stored once computed.

Stores are deferred by one mechanism, `QuietTime` (dense/quiet_time.py): a store runs once the
next engine call begins, when the clients that asked wait, not while a client on this host
computes on the answer it just got. A lookup of a key still waiting to be stored runs the store
at once and waits for it; shutdown lets stores finish.

A key is the cache's address of a row's key (backends/rows.py), made once per request in `keys`.
In process, it is bytes: (model fingerprint, adapter) in MessagePack, then the row's key, which
hashes once and compares in C; the value is a read-only view of the matrix the engine returned:
no copy, no framing (engines return a fresh matrix per call and nothing on the response path
writes to it). A matrix's rows go in together, and the least recently used matrix goes whole, as
its memory does.

In Redis, a key is `{namespace}:v{FORMAT}:row:{sha256(model fingerprint, adapter, dtype, token
ids as little-endian int32)}`; a value is a 16-byte header (magic + version, row length, CRC-32
of the payload) and the raw little-endian float32 row. A value whose header, length or checksum
is off is a miss and is deleted. The values of one engine step are views of one buffer, filled
by one copy outside the interpreter lock, on one thread of lower priority.
"""

from __future__ import annotations

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
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np

from backends.placement import Known, Placed
from backends.rows import PackedRows
from gateway.dense.quiet_time import QuietTime
from gateway.dense.redis_store import CacheStats, RedisStore
from gateway.metrics import Metrics
from gateway.settings import CacheSettings
from logprob_gateway_client.buffer_lru import BufferLRU

log = logging.getLogger(__name__)

Key = Hashable  # bytes in process, a string in Redis

FORMAT = 3  # 2: CRC-32 instead of blake2b-64; 3: keys of int32 ids, not int64
_MAGIC = b"LGR" + bytes([FORMAT])
_HEADER = struct.Struct("<4sIQ")  # magic+version, float32 count, CRC-32 of the payload


class AskedRows:
    """The keys of rows asked for, remembered in two generations of at most `max_bytes` / 2 of
    keys each: a key is forgotten after between that many and twice as many bytes of keys came
    after it. Adding and checking a call's keys are set operations in C."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._recent: set[Key] = set()
        self._older: set[Key] = set()
        self._recent_bytes = 0

    def before(self, keys: Sequence[Key]) -> bool:
        """Whether any of `keys` was asked for (or stored) before; remembers them all."""
        asked = not (self._recent.isdisjoint(keys) and self._older.isdisjoint(keys))
        self.remember(keys)
        return asked

    def remember(self, keys: Sequence[Key]) -> None:
        self._recent.update(keys)
        self._recent_bytes += sum(map(len, keys))  # type: ignore[arg-type]
        if 2 * self._recent_bytes > self.max_bytes:
            self._older, self._recent, self._recent_bytes = self._recent, set(), 0


class RowCache(ABC):
    shared = False  # other processes store into it too

    def __init__(
        self,
        *,
        stats: CacheStats | None = None,
        metrics: Metrics | None = None,
        quiet: QuietTime | None = None,
        admission_bytes: int = 0,
    ) -> None:
        self.stats = stats or CacheStats()
        self.metrics = metrics or Metrics()
        self.quiet = quiet or QuietTime()
        # Rows the engine wrote straight into a client's memory cost a copy of their own to cache:
        # made only for rows asked before (None: always made). Every key stored is remembered too,
        # so in a store of this process alone a row never asked before is not there.
        self.asked = AskedRows(admission_bytes) if admission_bytes else None
        self._storing: dict[Key, asyncio.Task[None]] = {}  # key -> its store still under way
        # Bound once: labels() looks its child up at every call
        self._get_seconds = self.metrics.cache_duration.labels("get")
        self._set_seconds = self.metrics.cache_duration.labels("set")
        self._hits = self.metrics.cache_lookups.labels("hit")
        self._misses = self.metrics.cache_lookups.labels("miss")

    @abstractmethod
    def keys(self, fingerprint: str, adapter: str | None, rows: PackedRows) -> list[Key]:
        """The keys of `rows` of a model (`fingerprint`) and adapter (name and fingerprint)."""

    @abstractmethod
    async def _values(
        self, keys: Sequence[Key], width: int
    ) -> tuple[list[np.ndarray | None] | None, list[Key]]:
        """The rows stored under `keys` (None: a miss; the list None: all are), and the keys whose
        values are corrupt."""

    @abstractmethod
    async def store_rows(self, keys: Sequence[Key], rows: np.ndarray) -> None:
        """Row i of `rows` under keys[i], now."""

    @abstractmethod
    async def _delete(self, keys: Sequence[Key]) -> None: ...

    async def fill(
        self,
        fingerprint: str,
        adapter: str | None,
        rows: PackedRows,
        width: int,
        compute: Callable[[Known | None, bool], Awaitable[Placed]],
        *,
        direct: bool,
    ) -> tuple[Awaitable[Placed], int]:
        """The computation of `rows` (of a model, `fingerprint`, and adapter, its name and
        fingerprint; `width` floats each) that the caller awaits, and how many rows the cache
        found: `compute(known, keep)` gets those rows (per row, or None: none found), and `keep`,
        whether the engine should write a copy of rows it writes from its device for the cache.
        `direct`: the rows go from the engine's device straight into a client's memory. Rows the
        engine computed are stored once computed (`store_later`)."""
        keys = self.keys(fingerprint, adapter, rows)
        # Rows never asked for nor stored before (every SMC step) get no second copy from the
        # device for the cache; asked again, they are kept. In process, they are in no store:
        # not looked up either.
        new = direct and self.asked is not None and not self.asked.before(keys)
        if new and not self.shared:
            self.missed(len(keys))
            return compute(None, False), 0
        found = await self.lookup(keys, width)
        hits = sum(row is not None for row in found)
        computing = asyncio.ensure_future(compute(found if hits else None, direct and not new and not hits))
        computing.add_done_callback(functools.partial(self._store_computed, keys))
        return computing, hits

    def _store_computed(self, keys: Sequence[Key], computing: asyncio.Future[Placed]) -> None:
        """A fill's rows are computed: those the engine computed are stored later."""
        if computing.cancelled() or computing.exception() is not None:  # the request's to report
            return
        computed = computing.result().computed
        if computed is not None:
            kept = keys if computed.asked is None else [keys[i] for i in computed.asked]
            self.store_later(kept, computed.logprobs, computed.landed)

    async def lookup(self, keys: Sequence[Key], width: int) -> list[np.ndarray | None]:
        """The rows stored under `keys` (None: a miss)."""
        started = time.perf_counter()
        storing = set()
        if not self._storing.keys().isdisjoint(keys):  # in C: rows of an SMC step are all new
            storing = {self._storing[key] for key in keys if key in self._storing}
        if storing:  # read-your-writes within the process: a row waiting to be stored is found
            self.quiet.now()
            await asyncio.wait(storing)
        rows, corrupt = await self._values(keys, width)
        self._get_seconds.observe(time.perf_counter() - started)
        if rows is None:
            self.missed(len(keys))
            return [None] * len(keys)
        if corrupt:
            self.stats.corrupt += len(corrupt)
            log.warning("dropping %d corrupted cache values", len(corrupt))
            await self._delete(corrupt)
        hits = sum(r is not None for r in rows)
        self.stats.hits += hits
        self.stats.misses += len(rows) - hits
        self._hits.inc(hits)
        self._misses.inc(len(rows) - hits)
        return rows

    def missed(self, count: int) -> None:
        """`count` rows in no store: counted as misses."""
        self.stats.misses += count
        self._misses.inc(count)

    def store_later(
        self, keys: Sequence[Key], rows: np.ndarray, landed: Callable[[], None] | None = None
    ) -> None:
        """Store `rows` once the next engine call begins (or the quiet time's timeout passes) and
        `landed` (blocking, run in a thread) has returned: rows a device may still be copying into
        them; `lookup` of these keys waits for it."""
        if self.asked is not None:
            self.asked.remember(keys)
        task = asyncio.create_task(self._store_when_quiet(keys, rows, landed))
        self._storing.update(dict.fromkeys(keys, task))
        task.add_done_callback(lambda done: self._stored(keys, done))

    async def _store_when_quiet(
        self, keys: Sequence[Key], rows: np.ndarray, landed: Callable[[], None] | None
    ) -> None:
        await self.quiet.wait()
        if landed is not None:
            await asyncio.to_thread(landed)
        started = time.perf_counter()
        await self.store_rows(keys, rows)
        self._set_seconds.observe(time.perf_counter() - started)

    def _stored(self, keys: Sequence[Key], task: asyncio.Task[None]) -> None:
        for key in keys:
            if self._storing.get(key) is task:
                del self._storing[key]
        if not task.cancelled() and task.exception() is not None:
            log.error("storing %d rows failed", len(keys), exc_info=task.exception())

    async def aclose(self) -> None:
        if self._storing:
            self.quiet.now()
            await asyncio.wait(set(self._storing.values()), timeout=30)


class MemoryRowCache(RowCache):
    """In process: the engine's rows as read-only views, bounded by the memory they keep alive (a
    matrix that several rows view counts once, in full, until the last of them goes)."""

    def __init__(self, max_bytes: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.max_bytes = max_bytes
        self._items = BufferLRU(sys.maxsize, max_bytes)

    @property
    def size(self) -> int:
        return self._items.nbytes

    def keys(self, fingerprint: str, adapter: str | None, rows: PackedRows) -> list[Key]:
        scope = _scope(fingerprint, adapter)
        return [scope + packed for packed in rows.keys]

    async def _values(
        self, keys: Sequence[Key], width: int
    ) -> tuple[list[np.ndarray | None] | None, list[Key]]:
        if self._items.isdisjoint(keys):  # in C: rows of an SMC step are all new
            return None, []
        rows = [self._items.get(key) for key in keys]
        return [row if row is not None and row.shape == (width,) else None for row in rows], []

    async def store_rows(self, keys: Sequence[Key], rows: np.ndarray) -> None:
        frozen = rows.view()  # nothing can write through the cache's views
        frozen.flags.writeable = False
        self._items.put_rows(keys, frozen)

    async def _delete(self, keys: Sequence[Key]) -> None:
        for key in keys:
            self._items.pop(key)


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):  # Linux: a thread has its own nice value
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


@functools.cache
def _framer() -> ThreadPoolExecutor:
    """Started by the first store bound for Redis, not by importing this module."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-store", initializer=_lower_priority)


@functools.lru_cache(maxsize=1024)
def _scope(fingerprint: str, adapter: str | None) -> bytes:
    """What an in-process key starts with: self-delimiting, so no two scopes' keys meet."""
    return msgspec.msgpack.encode((fingerprint, adapter))


def frame(row: np.ndarray) -> bytes:
    return bytes(frame_many(row[None])[0])


def frame_many(rows: np.ndarray) -> list[memoryview]:
    """The Redis values of `rows` [n, width]: views of one buffer [n, header + payload]."""
    count, width = rows.shape
    buffer = np.empty((count, _HEADER.size + 4 * width), dtype=np.uint8)
    buffer[:, _HEADER.size :].view("<f4")[...] = rows  # one copy, outside the interpreter lock
    values = []
    for value in buffer:
        _HEADER.pack_into(value, 0, _MAGIC, width, zlib.crc32(value[_HEADER.size :]))
        values.append(memoryview(value))
    return values


def unframe(value: bytes | memoryview, width: int) -> np.ndarray | None:
    """The row in a Redis value; None when its header, length or checksum is off, or it holds
    NaN or +inf, which no log-probability row does (a checksum is no proof of who wrote it)."""
    if len(value) != _HEADER.size + 4 * width:
        return None
    magic, count, check = _HEADER.unpack_from(value)
    payload = memoryview(value)[_HEADER.size :]
    if magic != _MAGIC or count != width or zlib.crc32(payload) != check:
        return None
    row = np.frombuffer(payload, dtype="<f4")
    return row if bool(np.all(row < np.inf)) else None


class RedisRowCache(RowCache):
    """Shared by replicas: digests as keys, framed values, a store that reads failures as misses."""

    shared = True

    def __init__(self, store: RedisStore, *, namespace: str = "lpg", **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.store = store
        self.namespace = namespace
        self._prefixes: dict[tuple[str, str | None], hashlib._Hash] = {}  # key hashes, model part done

    def keys(self, fingerprint: str, adapter: str | None, rows: PackedRows) -> list[Key]:
        return [self.key(fingerprint, adapter, packed) for packed in rows.keys]

    def key(self, fingerprint: str, adapter: str | None, packed: bytes) -> str:
        """The key of a row whose ids are `packed` (little-endian int32)."""
        prefix = self._prefixes.get((fingerprint, adapter))
        if prefix is None:
            prefix = hashlib.sha256(json.dumps([fingerprint, adapter, "float32"]).encode())
            self._prefixes[fingerprint, adapter] = prefix
        digest = prefix.copy()
        digest.update(packed)
        return f"{self.namespace}:v{FORMAT}:row:{digest.hexdigest()}"

    async def _values(self, keys: Sequence[Key], width: int) -> tuple[list[np.ndarray | None], list[Key]]:
        values = await self.store.get_many(keys)  # type: ignore[arg-type]
        rows = [None if value is None else unframe(value, width) for value in values]
        corrupt = [k for k, v, r in zip(keys, values, rows, strict=True) if v is not None and r is None]
        return rows, corrupt

    async def store_rows(self, keys: Sequence[Key], rows: np.ndarray) -> None:
        # Megabytes of rows to copy and checksum: off the event loop (numpy and zlib release the GIL).
        values = await asyncio.get_running_loop().run_in_executor(_framer(), frame_many, rows)
        await self.store.set_many(list(zip(keys, values, strict=True)))  # type: ignore[arg-type]

    async def _delete(self, keys: Sequence[Key]) -> None:
        await self.store.delete_many(keys)  # type: ignore[arg-type]

    async def aclose(self) -> None:
        await super().aclose()
        await self.store.aclose()


def build_cache(settings: CacheSettings, metrics: Metrics, quiet: QuietTime) -> RowCache | None:
    if not settings.enabled:
        return None
    stats = CacheStats()
    admission = settings.admission_bytes
    if not settings.redis_url:
        return MemoryRowCache(
            settings.memory_bytes, stats=stats, metrics=metrics, quiet=quiet, admission_bytes=admission
        )
    store = RedisStore(
        settings.redis_url,
        ttl_s=settings.ttl_s,
        timeout_s=settings.timeout_s,
        retry_after_s=settings.retry_after_s,
        stats=stats,
        on_error=metrics.cache_errors.inc,
    )
    return RedisRowCache(
        store,
        namespace=settings.namespace,
        stats=stats,
        metrics=metrics,
        quiet=quiet,
        admission_bytes=admission,
    )
