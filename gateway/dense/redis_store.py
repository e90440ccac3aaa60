"""Redis (or Valkey) for the output cache shared by replicas: pipelined MGET / SET EX with
timeouts and a circuit breaker. Values are bytes; what they hold is dense/row_cache.py's business.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    errors: int = 0  # store failures (timeouts, connection errors)
    corrupt: int = 0  # values that failed the checks, deleted


Value = bytes | memoryview


class RedisStore:
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
        """Values in key order; None for a miss. Never raises for store failures."""
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
        """Best effort; never raises for store failures."""
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
