"""Where the output cache keeps its values: by key, get_many / set_many / delete_many.

    RowStore          the interface; a failure of the store reads as a miss, never raises
     ├── MemoryStore  in-process LRU bounded by the memory its values keep alive
     └── RedisStore   shared by replicas: pipelined MGET / SET EX, timeouts, circuit breaker

What a value is (the engine's rows themselves in process, framed bytes for Redis) and how keys
are made is gateway/cache.py's business.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from logprob_gateway_client.buffer_lru import BufferLRU, anchor

log = logging.getLogger(__name__)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    errors: int = 0  # store failures (timeouts, connection errors)
    corrupt: int = 0  # values that failed the checks, deleted


Value = bytes | memoryview | np.ndarray
Key = Hashable  # str in Redis, a RowKey in process


class RowStore(ABC):
    @abstractmethod
    async def get_many(self, keys: Sequence[Key]) -> list[Value | None]:
        """Values in key order; None for a miss. Never raises for store failures."""

    @abstractmethod
    async def set_many(self, items: Sequence[tuple[Key, Value]]) -> None:
        """Best effort; never raises for store failures."""

    @abstractmethod
    async def delete_many(self, keys: Sequence[Key]) -> None: ...

    async def aclose(self) -> None:
        return None


def _memory_of(value: Value) -> tuple[object, int]:
    """The object whose memory a value keeps alive, and its size: a view keeps its whole buffer."""
    owner = value.obj if isinstance(value, memoryview) else value
    if isinstance(owner, np.ndarray):
        owner = anchor(owner)
        return owner, owner.nbytes
    return owner, len(value)


class MemoryStore(RowStore):
    """An in-process LRU bounded by the memory its values keep alive (a buffer that several values
    view counts once, in full, until the last of them goes)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items = BufferLRU(sys.maxsize, max_bytes)

    @property
    def size(self) -> int:
        return self._items.nbytes

    async def get_many(self, keys: Sequence[Key]) -> list[Value | None]:
        return [self._items.get(key) for key in keys]

    async def set_many(self, items: Sequence[tuple[Key, Value]]) -> None:
        for key, value in items:
            self._items.put(key, value, *_memory_of(value))

    def put_rows(self, keys: Sequence[Key], rows: np.ndarray) -> None:
        """Row i of `rows` under keys[i]: read-only views of it, no copy."""
        frozen = rows.view()  # nothing can write through the cache's views
        frozen.flags.writeable = False
        self._items.put_rows(keys, frozen)

    async def delete_many(self, keys: Sequence[Key]) -> None:
        for key in keys:
            self._items.pop(key)


class RedisStore(RowStore):
    """Redis (or Valkey) with bounded latency: every call has a timeout, and after a failure the
    store is skipped for `retry_after_s` (a circuit breaker), so an outage costs one timeout, not
    one per request. The outage is logged once; the store resumes by itself."""

    def __init__(
        self,
        url: str,
        *,
        ttl_s: int,
        timeout_s: float,
        retry_after_s: float,
        stats: CacheStats,
        on_error: Callable[[], None] = lambda: None,
    ) -> None:
        import redis.asyncio as redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # One immediate retry replaces a pooled connection that died with a restarted server;
        # beyond that a failed call is a miss, and the breaker decides when to try again.
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1)
        )
        self.url = url
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.stats = stats
        self._on_error = on_error
        self._skip_until = 0.0
        self._outage = False

    def _available(self) -> bool:
        return time.monotonic() >= self._skip_until

    def _failed(self, exc: BaseException) -> None:
        self.stats.errors += 1
        self._on_error()
        self._skip_until = time.monotonic() + self.retry_after_s
        if not self._outage:
            self._outage = True
            log.warning(
                "redis cache at %s unavailable (%s: %s); serving without it, retrying every %.0f s",
                _redact(self.url),
                type(exc).__name__,
                exc,
                self.retry_after_s,
            )

    def _succeeded(self) -> None:
        if self._outage:
            self._outage = False
            log.warning("redis cache at %s is back", _redact(self.url))

    async def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        if not keys or not self._available():
            return [None] * len(keys)
        try:
            values = await asyncio.wait_for(self._client.mget(list(keys)), self.timeout_s * 2)
        except Exception as exc:
            self._failed(exc)
            return [None] * len(keys)
        self._succeeded()
        return [v if isinstance(v, bytes) else None for v in values]

    async def set_many(self, items: Sequence[tuple[str, Value]]) -> None:
        if not items or not self._available():
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value, ex=self.ttl_s)
            await asyncio.wait_for(pipe.execute(), self.timeout_s * 2)
        except Exception as exc:
            self._failed(exc)
            return
        self._succeeded()

    async def delete_many(self, keys: Sequence[str]) -> None:
        if not keys or not self._available():
            return
        try:
            await asyncio.wait_for(self._client.delete(*keys), self.timeout_s * 2)
        except Exception as exc:
            self._failed(exc)

    async def aclose(self) -> None:
        await self._client.aclose()


def _redact(url: str) -> str:
    """Never log a password embedded in the URL."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return scheme + sep + rest
