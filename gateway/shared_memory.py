"""Dense answers written straight into a client's memory, for clients on the gateway's own host.

A 256-row step of a 49152-token vocabulary is 50 MB of float32; through a loopback socket the
kernel copies it twice and the client faults fresh pages in, 10-20 ms a step. A client on the
same machine can instead name a segment of its own memory in the request (`shared_memory`): a
memfd (`memfd_create`) called `logprob-gateway-<32 hex digits>`, sealed against shrinking. The
gateway opens it through /proc/<pid>/fd/<fd>, maps it once, and copies the `[rows, vocab]` matrix
there; the answer is a small document saying where it lies.

Why this is safe for the gateway: the shrink seal means the file can never become shorter than
the gateway's mapping (writing into a truncated mapping would kill the process with SIGBUS);
opening another process's descriptor needs the right to inspect it (the same user, or root);
and the file opened must be a memfd with the random name the request gave, so only a segment its
client created for this is ever written. A target the gateway cannot open (a client on another
host or in another PID namespace, another user's process) is not an error: the matrix is sent in
the body, as without the field, and the client stops asking. Linux only.

With a `pinner` (a GPU engine's driver, gateway/host_memory.py) a mapping is registered for
direct copies from the device when it is made, so an engine can write the rows there itself
(`pinned`). It is unregistered before it is unmapped, and only once no view handed out for it is
alive: a copy may still be writing through one.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import weakref
from collections import OrderedDict
from typing import Protocol

import numpy as np

from gateway.errors import InvalidRequestError
from gateway.schemas.logprobs import SharedMemoryTarget


def _names_segment(path: str, name: str) -> bool:
    """Whether `path` (a /proc/.../fd/N link) is the memfd called `name`."""
    try:
        return os.readlink(path) == f"/memfd:{name} (deleted)"
    except OSError:  # no such process or descriptor here, or not ours to inspect
        return False


class Pinner(Protocol):
    def register(self, address: int, size: int) -> bool: ...

    def unregister(self, address: int) -> None: ...


Key = tuple[int, int, str]  # (pid, fd, name)


def _address(segment: mmap.mmap) -> int:
    view = np.frombuffer(segment, dtype=np.uint8, count=1)
    try:
        return view.ctypes.data
    finally:
        del view  # the export would keep the mapping from closing


class SharedMemoryWriter:
    """Maps clients' segments on first use and keeps the most recent mappings, bounded in count
    and bytes; a mapping whose client closed the segment is dropped when another is mapped."""

    def __init__(
        self, max_segments: int = 64, max_bytes: int = 8 << 30, pinner: Pinner | None = None
    ) -> None:
        self.max_segments = max_segments
        self.max_bytes = max_bytes
        self.pinner = pinner
        self._segments: OrderedDict[Key, mmap.mmap] = OrderedDict()
        self._bytes = 0
        self._pinned: dict[Key, int] = {}  # registered mappings: their address
        self._views: dict[Key, list[weakref.ref[np.ndarray]]] = {}  # handed out, of pinned mappings
        self._retiring: list[tuple[mmap.mmap, int, list[weakref.ref[np.ndarray]]]] = []

    def pinned(self, target: SharedMemoryTarget) -> bool:
        """Whether the segment's mapping is registered for copies straight from a GPU."""
        return (target.pid, target.fd, target.name) in self._pinned

    def target(self, target: SharedMemoryTarget, nbytes: int) -> np.ndarray | None:
        """`nbytes` of the client's segment at its offset, as a uint8 array to copy the matrix
        into; None when the segment is not visible from here. A segment that is visible but
        cannot hold the matrix, or is not sealed against shrinking, is the client's error (400)."""
        key = (target.pid, target.fd, target.name)
        if self._retiring:
            self._retire()
        segment = self._segments.get(key)
        if segment is None:
            segment = self._map(target)
            if segment is None:
                return None
        else:
            self._segments.move_to_end(key)
        if target.offset + nbytes > len(segment):
            raise InvalidRequestError(
                f"the shared memory segment has {len(segment)} bytes; the answer needs {nbytes} "
                f"from offset {target.offset}",
                param="shared_memory",
            )
        view = np.frombuffer(segment, dtype=np.uint8, count=nbytes, offset=target.offset)
        if key in self._pinned:
            views = self._views[key]
            views[:] = [ref for ref in views if ref() is not None]
            views.append(weakref.ref(view))
        return view

    def _map(self, target: SharedMemoryTarget) -> mmap.mmap | None:
        path = f"/proc/{target.pid}/fd/{target.fd}"
        if not _names_segment(path, target.name):  # checked first, so nothing else is ever opened
            return None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:  # gone meanwhile, or not ours to open
            return None
        try:
            if not _names_segment(f"/proc/self/fd/{fd}", target.name):  # replaced between the two looks
                return None
            if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                raise InvalidRequestError(
                    "the shared memory segment must be sealed against shrinking (F_SEAL_SHRINK)",
                    param="shared_memory",
                )
            size = os.fstat(fd).st_size
            if size == 0:
                raise InvalidRequestError("the shared memory segment is empty", param="shared_memory")
            segment = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            return None
        finally:
            os.close(fd)  # the mapping keeps the file
        self._drop_closed()  # retires what it forgets; `target` retired the rest just before
        key = (target.pid, target.fd, target.name)
        self._segments[key] = segment
        self._bytes += len(segment)
        self._pin(key, segment)
        # The oldest go first, never the one just mapped: this request writes into it.
        while len(self._segments) > 1 and (
            len(self._segments) > self.max_segments or self._bytes > self.max_bytes
        ):
            self._forget(next(iter(self._segments)))
        return segment

    def _drop_closed(self) -> None:
        """Mappings of segments their client closed (or exited) would keep that memory alive."""
        for key in list(self._segments):
            pid, fd, name = key
            if not _names_segment(f"/proc/{pid}/fd/{fd}", name):
                self._forget(key)

    def _pin(self, key: Key, segment: mmap.mmap) -> None:
        if self.pinner is None:
            return
        address = _address(segment)
        if self.pinner.register(address, len(segment)):
            self._pinned[key] = address
            self._views[key] = []

    def _forget(self, key: Key) -> None:
        segment = self._segments.pop(key)
        self._bytes -= len(segment)
        address = self._pinned.pop(key, None)
        if address is not None:  # unregistered, then unmapped, once no copy can be writing
            self._retiring.append((segment, address, self._views.pop(key)))
            self._retire()
            return
        # A copy still writing through it holds a buffer export: then it closes when that ends.
        with contextlib.suppress(BufferError):
            segment.close()

    def _retire(self) -> None:
        assert self.pinner is not None or not self._retiring
        for retiring in list(self._retiring):
            segment, address, views = retiring
            if any(ref() is not None for ref in views):
                continue
            self.pinner.unregister(address)  # type: ignore[union-attr]
            with contextlib.suppress(BufferError):
                segment.close()
            self._retiring.remove(retiring)

    def close(self) -> None:
        while self._segments:
            self._forget(next(iter(self._segments)))
