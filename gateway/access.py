"""Who may call the gateway, and how much: API keys kept only as SHA-256 digests, per-key limits
(requests in flight, dense rows per minute), the server-wide number of open streams and the
server-wide budget of dense answers' bytes not yet read by their clients.

A key entry is `[name:]sha256:<64 hex digits>`, one per line in `api_keys_file` (blank lines and
`#` comments allowed) or per item of `api_keys`. `logprob-gateway hash-key` prints the entry
for a key. The name identifies the key in per-key limits; it never leaves the process.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gateway.errors import AuthenticationError, InvalidRequestError, RateLimitError
from gateway.settings import ConfigError, Limits, Settings

_ENTRY = re.compile(r"(?:(?P<name>[A-Za-z0-9_.@-]{1,64}):)?sha256:(?P<digest>[0-9a-f]{64})")
ADMIN = "admin"  # the name requests with the admin key are counted under


def hash_key(key: str, name: str | None = None) -> str:
    """The entry to configure for `key` (the key itself is never stored)."""
    entry = "sha256:" + hashlib.sha256(key.encode()).hexdigest()
    return f"{name}:{entry}" if name else entry


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes


def parse_entries(lines: Iterable[str], source: str) -> list[ApiKey]:
    keys = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _ENTRY.fullmatch(line)
        if match is None:  # the line is not echoed: it may be a key pasted in plain text
            raise ConfigError(f"{source}, entry {number}: expected '[name:]sha256:<64 lowercase hex digits>'")
        digest = match["digest"]
        keys.append(ApiKey(match["name"] or f"key-{digest[:8]}", bytes.fromhex(digest)))
    return keys


class KeyRing:
    """Checks presented keys against the configured digests in time independent of which matches."""

    def __init__(self, keys: list[ApiKey], admin_key: str | None) -> None:
        self.keys = keys
        self._admin = None
        if admin_key:  # the admin key may be configured in plain text or as a sha256: entry
            hashed = (
                parse_entries([admin_key], "admin_key")[0].digest if _ENTRY.fullmatch(admin_key) else None
            )
            self._admin = hashed or hashlib.sha256(admin_key.encode()).digest()

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyRing:
        keys = parse_entries(settings.api_keys, "api_keys")
        if settings.api_keys_file:
            try:
                text = Path(settings.api_keys_file).read_text()
            except OSError as exc:
                raise ConfigError(
                    f"cannot read api_keys_file {settings.api_keys_file}: {exc.strerror}"
                ) from None
            keys += parse_entries(text.splitlines(), settings.api_keys_file)
        return cls(keys, settings.admin_key)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def identify(self, presented: str) -> str | None:
        """The name of the key presented, ADMIN for the admin key, or None."""
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for key in self.keys:  # no early exit
            if hmac.compare_digest(digest, key.digest):
                found = key.name
        if self._admin is not None and hmac.compare_digest(digest, self._admin):
            found = ADMIN
        return found

    def require(self, presented: str | None, asker: str, hint: str = "") -> str:
        """The name of the key presented by `asker` ("request", "connection"), else an
        AuthenticationError saying whether it was missing or wrong (and `hint`)."""
        key = self.identify(presented) if presented else None
        if key is None:
            reason = "a wrong API key" if presented else "no API key"
            raise AuthenticationError(f"this {asker} has {reason}{hint}")
        return key

    def is_admin(self, presented: str) -> bool:
        return self._admin is not None and self.identify(presented) == ADMIN


@dataclass
class _Bucket:
    """Token bucket: `capacity` rows, refilled continuously over a minute."""

    capacity: float
    tokens: float
    updated: float = field(default_factory=time.monotonic)

    def take(self, n: int) -> float:
        """Take n tokens and return 0, or take none and return the seconds until n are there."""
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.capacity / 60)
        self.updated = now
        if self.tokens >= n:
            self.tokens -= n
            return 0.0
        return (n - self.tokens) * 60 / self.capacity


class Access:
    """The gateway's access state: the key ring and the counters behind the limits."""

    def __init__(self, keyring: KeyRing, limits: Limits) -> None:
        self.keyring = keyring
        self.limits = limits
        self.in_flight: dict[str, int] = {}
        self.streams = 0
        self.answer_bytes = 0  # reserved by dense answers being computed, encoded or read
        self._buckets: dict[str, _Bucket] = {}

    def enter(self, key: str) -> None:
        """Count a request of `key` in flight, or refuse it with a 429."""
        limit = self.limits.max_in_flight_per_key
        if limit and key != ADMIN and self.in_flight.get(key, 0) >= limit:
            raise RateLimitError(f"this API key already has {limit} requests in flight", retry_after=1)
        self.in_flight[key] = self.in_flight.get(key, 0) + 1

    def leave(self, key: str) -> None:
        self.in_flight[key] -= 1

    def take_rows(self, key: str | None, rows: int) -> None:
        """Charge dense rows to a key's per-minute budget, or refuse them with a 429."""
        capacity = self.limits.rows_per_minute_per_key
        if not capacity or key is None or key == ADMIN:
            return
        if rows > capacity:
            raise RateLimitError(
                f"{rows} rows exceed this API key's budget of {capacity} rows per minute; split the request",
                retry_after=60,
            )
        bucket = self._buckets.setdefault(key, _Bucket(capacity, capacity))
        wait = bucket.take(rows)
        if wait:
            raise RateLimitError(
                f"this API key's budget of {capacity} rows per minute is spent", retry_after=wait
            )

    def reserve_stream(self) -> None:
        if self.streams >= self.limits.max_streams:
            raise RateLimitError(
                f"the server already serves {self.limits.max_streams} streams", retry_after=1
            )
        self.streams += 1

    def release_stream(self) -> None:
        self.streams -= 1

    def reserve_answer_bytes(self, nbytes: int) -> None:
        """Reserve an answer's bytes before its work starts: a 400 for one answer larger than the
        whole budget (it could never be served), a 429 while others hold too much of it."""
        budget = self.limits.max_answer_bytes
        if nbytes > budget:
            raise InvalidRequestError(
                f"this answer would take about {nbytes} bytes, more than the server's {budget} for all "
                "answers; ask for fewer rows, a smaller dtype, base64 or MessagePack instead of JSON "
                "floats, or shared_memory",
                code="answer_too_large",
            )
        if self.answer_bytes + nbytes > budget:
            raise RateLimitError(
                f"the server holds {self.answer_bytes} bytes of answers that their clients have not "
                f"read yet; this one needs {nbytes} more of its {budget}",
                retry_after=1,
            )
        self.answer_bytes += nbytes

    def release_answer_bytes(self, nbytes: int) -> None:
        self.answer_bytes -= nbytes
