"""Memory of the client's process that a gateway on the same host writes dense answers into.

The gateway's side, and why it is safe, is the server's gateway/dense/shared_memory.py. Here: every large answer
gets a segment of its own (a memfd named `logprob-gateway-<random>`, sealed so its size never
changes, mapped read-write, its last 16 bytes a random key that every request naming it carries:
the gateway writes only for requests holding it), and the matrix handed to the caller is a view of
it, so the 50 MB of a 256-row step are written once, by the gateway, and read in place. A segment
is used again once nothing views its last answer any more.

Segments are few and used again on purpose: shared memory gets no huge pages, so the first
write and the first read of each fresh page fault one 4 KiB page at a time, where a mapped page
used again costs nothing (docs/performance.md). So the pool grows to `max_bytes` (and
always to two segments: the answer being read and the next), and past that the oldest answer's
rows leave the client's row cache (`evict`) so its segment can take the next answer; only when
the caller itself still holds every answer does the next one come in the body.

Linux only (memfd). Needs only the standard library and numpy.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count

import numpy as np

from logprob_gateway_client.encoding import ITEMSIZE, Dtype, decode_row

MIN_BYTES = 1 << 20  # smaller answers come in the body: a segment per row would cost more than it saves
_GRAIN = 1 << 20  # segment sizes are rounded up to this, so steps of similar size share segments
KEY_BYTES = 16  # a segment's last bytes: its key, which proves to the gateway a request is its owner's


def memfd_supported() -> bool:
    return sys.platform == "linux" and hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")


@dataclass(eq=False)
class Segment:
    name: str
    fd: int
    size: int
    mapping: mmap.mmap
    key: bytes
    busy: bool = True  # leased, or an answer in it is still viewed
    leased: int = 0  # lease order: the oldest answer is recycled first
    answer: Callable[[], object] = field(
        default=lambda: None
    )  # weakly, the array all views of the answer keep alive

    @property
    def room(self) -> int:
        """The bytes an answer may take: all but the key."""
        return self.size - KEY_BYTES

    def target(self) -> dict[str, object]:
        """The request's `shared_memory` field."""
        return {"pid": os.getpid(), "fd": self.fd, "name": self.name, "key": self.key.hex(), "offset": 0}


class SharedSegments:
    def __init__(
        self,
        max_bytes: int = 64 << 20,
        max_segments: int = 64,
        evict: Callable[[object], None] = lambda answer: None,
    ) -> None:
        self.max_bytes = max_bytes
        self.max_segments = max_segments
        self.evict = evict  # drops the client's own references to an answer (its cached rows)
        self.created = 0  # segments made so far, for diagnostics and tests
        self._largest = 0  # the largest answer leased so far: new segments take at least that
        self._segments: list[Segment] = []
        self._leases = count()
        self._pid = os.getpid()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self._segments)

    def lease(self, nbytes: int) -> Segment | None:
        """A segment for an answer of `nbytes`, held until `release` or until the matrix read from
        it is no longer viewed; None: let this answer come in the body."""
        if nbytes < MIN_BYTES:
            return None
        with self._lock:
            if os.getpid() != self._pid:  # a forked child: these segments are its parent's
                for inherited in self._segments:
                    os.close(inherited.fd)  # the child's copy; its mapping stays for any views
                self._segments, self._pid = [], os.getpid()
            segment = self._idle(nbytes) or self._grow(nbytes) or self._recycle(nbytes)
            if segment is not None:
                segment.busy, segment.leased, segment.answer = True, next(self._leases), lambda: None
            return segment

    def _idle(self, nbytes: int) -> Segment | None:
        fits = [s for s in self._segments if not s.busy and s.room >= nbytes]
        return min(fits, key=lambda s: s.size) if fits else None

    def _grow(self, nbytes: int) -> Segment | None:
        # As large as the largest answer yet: steps vary in size (SMC's resampling repeats rows,
        # which are sent once), and a segment that holds any of them is never closed and made
        # again, nor mapped and registered again by the gateway.
        self._largest = max(self._largest, nbytes)
        size = -(-(self._largest + KEY_BYTES) // _GRAIN) * _GRAIN
        for idle in sorted((s for s in self._segments if not s.busy), key=lambda s: s.size):
            if self._room_for(size):
                break
            self._close(idle)  # too small for this answer, and in the way
        if not self._room_for(size):
            return None
        segment = _create(size)
        self._segments.append(segment)
        self.created += 1
        return segment

    def _room_for(self, size: int) -> bool:
        if len(self._segments) >= self.max_segments:
            return False
        return len(self._segments) < 2 or self.nbytes + size <= self.max_bytes

    def _recycle(self, nbytes: int) -> Segment | None:
        """The oldest answers whose only holder is the client's cache give up their segments: one
        that fits takes the answer, smaller ones are closed to make room for one that does."""
        for segment in sorted((s for s in self._segments if s.busy), key=lambda s: s.leased):
            answer = segment.answer()
            if answer is None:  # a request in flight
                continue
            self.evict(answer)
            del answer
            if segment.busy:  # the caller still holds rows of it
                continue
            if segment.room >= nbytes:
                return segment
            self._close(segment)
            grown = self._grow(nbytes)
            if grown is not None:
                return grown
        return None

    def release(self, segment: Segment) -> None:
        """The request failed, or its answer came in the body."""
        segment.busy = False

    def matrix(self, segment: Segment, rows: int, vocab_size: int, dtype: Dtype) -> np.ndarray:
        """The answer the gateway wrote at the segment's start, as float32 [rows, vocab_size]: a
        view of the segment for float32 (it stays leased until nothing views it), else widened
        into a new array."""
        values = rows * vocab_size
        if dtype != "float32":
            raw = np.frombuffer(segment.mapping, dtype=np.uint8, count=values * ITEMSIZE[dtype])
            try:
                return decode_row(memoryview(raw), dtype).reshape(rows, vocab_size)
            finally:
                del raw
                self.release(segment)
        flat = np.frombuffer(segment.mapping, dtype="<f4", count=values)
        # Every view of the answer has `flat` as its base and keeps it alive: it dies with the last.
        weakref.finalize(flat, self.release, segment)
        segment.answer = weakref.ref(flat)
        return flat.reshape(rows, vocab_size)

    def retire(self, segment: Segment) -> None:
        """Never lease this segment again: a request that failed may still be written into it."""
        with self._lock:
            if segment in self._segments:
                self._close(segment)

    def drop_idle(self) -> None:
        """Give back the memory of the segments nothing views."""
        with self._lock:
            for segment in [s for s in self._segments if not s.busy]:
                self._close(segment)

    def close(self) -> None:
        with self._lock:
            for segment in list(self._segments):
                self._close(segment)

    def _close(self, segment: Segment) -> None:
        self._segments.remove(segment)
        os.close(segment.fd)
        # Still viewed (the caller keeps rows): the mapping closes when the last view goes.
        with contextlib.suppress(BufferError):
            segment.mapping.close()


def _create(size: int) -> Segment:
    name = f"logprob-gateway-{secrets.token_hex(16)}"
    key = secrets.token_bytes(KEY_BYTES)
    fd = os.memfd_create(name, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        # The gateway maps it only if it can never shrink; nothing may change its size afterwards.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        mapping[size - KEY_BYTES :] = key
    except BaseException:
        os.close(fd)
        raise
    return Segment(name, fd, size, mapping, key)
