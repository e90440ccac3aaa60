"""Dense answers written straight into a client's memory, for clients on the gateway's own host.

A 256-row step of a 49152-token vocabulary is 50 MB of float32; through a loopback socket the
kernel copies it twice and the client faults fresh pages in, at every step. A client on the
same machine can instead name a segment of its own memory in the request (`shared_memory`): a
memfd (`memfd_create`) called `logprob-gateway-<32 hex digits>`, sealed against shrinking, whose
last 16 bytes hold a random key that the request carries too (`key`, in hex). The gateway opens it
through /proc/<pid>/fd/<fd>, checks the key, maps it once, and copies the `[rows, vocab]` matrix
there from `offset`, never into the key; the answer is a small document saying where it lies.

Whose memory is written: a name, pid and fd are no secret (they can be guessed, or read in a
process listing or a log), so the gateway writes only for a request holding the segment's key,
compared in constant time on every request, mappings it already holds included. The key lies in
the segment and in the request bodies of its client, nowhere else: whoever holds it could already
read that memory, so it is memory of the requester's own process (or of one it shares the segment
with) or of a process it may inspect, which it could write through /proc/<pid>/mem anyway. Until
the key matches, nothing about the segment is told: a wrong key, a segment that does not exist or
cannot be opened, one too small to hold a key or not sealed all get the matrix in the body, as a
client on another host does; only its owner hears (400) that its segment is too small or not
sealed. Not covered: a request body seen by someone else (a proxy logging bodies, a capture of
the loopback interface) gives the key away, and how long an answer takes may tell whether a named
descriptor exists; the key is compared in constant time, nothing before it is.

Why this is safe for the gateway: the shrink seal means the file can never become shorter than
the gateway's mapping (writing into a truncated mapping would kill the process with SIGBUS);
opening another process's descriptor needs the right to inspect it (the same user, or root);
and the file opened must be a memfd with the random name the request gave, so nothing else is
ever opened. A target the gateway cannot open (a client on another host or in another PID
namespace, another user's process) is not an error: the matrix is sent in the body, as without
the field, and the client stops asking. Linux only.

A request whose engine can write rows into host memory itself (backends.engine.HostMemory, a GPU
engine) names it as the `registrar`: the mapping is registered with it on first use, so that the
engine writes the rows there straight from the device. It is unregistered before it is unmapped,
and only once no view handed out for it is alive: a copy may still be writing through one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import mmap
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from backends.engine import HostMemory
from gateway.errors import InvalidRequestError
from logprob_gateway_client.schemas import SharedMemoryTarget
from logprob_gateway_client.shared_memory import KEY_BYTES


def _names_segment(path: str, name: str) -> bool:
    """Whether `path` (a /proc/.../fd/N link) is the memfd called `name`."""
    try:
        return os.readlink(path) == f"/memfd:{name} (deleted)"
    except OSError:  # no such process or descriptor here, or not ours to inspect
        return False


def _holds_key(tail: bytes, key: str) -> bool:
    """Whether `tail`, a segment's last bytes, is the key (hex) the request gave."""
    return len(tail) == KEY_BYTES and hmac.compare_digest(tail.hex().encode(), key.encode())


@dataclass(frozen=True)
class Destination:
    """Where an answer goes in a client's segment: `nbytes` of it from the request's offset."""

    view: np.ndarray  # uint8
    registered: bool  # the mapping is registered with the registrar the request named


SegmentId = tuple[int, int, str]  # (pid, fd, name)


def _address(segment: mmap.mmap) -> int:
    view = np.frombuffer(segment, dtype=np.uint8, count=1)
    try:
        return view.ctypes.data
    finally:
        del view  # the export would keep the mapping from closing


class SharedMemoryWriter:
    """Maps clients' segments on first use and keeps the most recent mappings, bounded in count
    and bytes; a mapping whose client closed the segment is dropped when another is mapped."""

    def __init__(self, max_segments: int = 64, max_bytes: int = 8 << 30) -> None:
        self.max_segments = max_segments
        self.max_bytes = max_bytes
        self._segments: OrderedDict[SegmentId, mmap.mmap] = OrderedDict()
        self._bytes = 0
        self._registered: dict[SegmentId, tuple[int, HostMemory]] = {}  # address, registrar
        self._views: dict[SegmentId, list[weakref.ref[np.ndarray]]] = {}  # handed out, of registered ones
        self._retiring: list[tuple[mmap.mmap, int, HostMemory, list[weakref.ref[np.ndarray]]]] = []

    def target(
        self, target: SharedMemoryTarget, nbytes: int, registrar: HostMemory | None = None
    ) -> Destination | None:
        """`nbytes` of the client's segment at its offset, to copy the matrix into (registered
        with `registrar` if given and it can); None when the segment is not visible from here or
        the request does not hold its key. A segment whose key matched but that cannot hold the
        matrix before the key, or is not sealed against shrinking, is the client's error (400)."""
        segment_id = (target.pid, target.fd, target.name)
        if self._retiring:
            self._retire()
        segment = self._segments.get(segment_id)
        if segment is None:
            segment = self._map(target)
            if segment is None:
                return None
        elif not _holds_key(segment[-KEY_BYTES:], target.key):  # another may name a segment in use
            return None
        else:
            self._segments.move_to_end(segment_id)
        room = len(segment) - KEY_BYTES
        if target.offset + nbytes > room:
            raise InvalidRequestError(
                f"the shared memory segment has {room} bytes before its key; the answer needs {nbytes} "
                f"from offset {target.offset}",
                param="shared_memory",
            )
        if registrar is not None and segment_id not in self._registered:
            self._register(segment_id, segment, registrar)
        view = np.frombuffer(segment, dtype=np.uint8, count=nbytes, offset=target.offset)
        registered = segment_id in self._registered
        if registered:
            views = self._views[segment_id]
            views[:] = [ref for ref in views if ref() is not None]
            views.append(weakref.ref(view))
        return Destination(view, registered and self._registered[segment_id][1] is registrar)

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
            size = os.fstat(fd).st_size
            if size < KEY_BYTES or not _holds_key(os.pread(fd, KEY_BYTES, size - KEY_BYTES), target.key):
                return None  # not proven to be the requester's: nothing about it may be told
            if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                raise InvalidRequestError(
                    "the shared memory segment must be sealed against shrinking (F_SEAL_SHRINK)",
                    param="shared_memory",
                )
            if os.fstat(fd).st_size < size:  # shrunk before it was sealed: a mapping of `size` would fault
                return None
            segment = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            return None
        finally:
            os.close(fd)  # the mapping keeps the file
        self._drop_closed()  # retires what it forgets; `target` retired the rest just before
        segment_id = (target.pid, target.fd, target.name)
        self._segments[segment_id] = segment
        self._bytes += len(segment)
        # The oldest go first, never the one just mapped: this request writes into it.
        while len(self._segments) > 1 and (
            len(self._segments) > self.max_segments or self._bytes > self.max_bytes
        ):
            self._forget(next(iter(self._segments)))
        return segment

    def _drop_closed(self) -> None:
        """Mappings of segments their client closed (or exited) would keep that memory alive."""
        for segment_id in list(self._segments):
            pid, fd, name = segment_id
            if not _names_segment(f"/proc/{pid}/fd/{fd}", name):
                self._forget(segment_id)

    def _register(self, segment_id: SegmentId, segment: mmap.mmap, registrar: HostMemory) -> None:
        address = _address(segment)
        if registrar.register(address, len(segment)):
            self._registered[segment_id] = (address, registrar)
            self._views[segment_id] = []

    def _forget(self, segment_id: SegmentId) -> None:
        segment = self._segments.pop(segment_id)
        self._bytes -= len(segment)
        registration = self._registered.pop(segment_id, None)
        if registration is not None:  # unregistered, then unmapped, once no copy can be writing
            self._retiring.append((segment, *registration, self._views.pop(segment_id)))
            self._retire()
            return
        # A copy still writing through it holds a buffer export: then it closes when that ends.
        with contextlib.suppress(BufferError):
            segment.close()

    def _retire(self) -> None:
        for retiring in list(self._retiring):
            segment, address, registrar, views = retiring
            if any(ref() is not None for ref in views):
                continue
            registrar.unregister(address)
            with contextlib.suppress(BufferError):
                segment.close()
            self._retiring.remove(retiring)

    def close(self) -> None:
        while self._segments:
            self._forget(next(iter(self._segments)))
