"""Dense rows from the device to host memory: the copies the transformers engine makes per call.

From a GPU, rows go into page-locked memory (pageable memory goes through a staging buffer at a
fraction of the speed), or straight into a caller's memory registered with the driver
(`cudaHostRegister`: a client's shared memory segment, as the gateway maps it, is ordinary
memory, and registering it makes a copy into it as fast as into page-locked memory). torch keeps
page-locked blocks for reuse; past a bound, the unused ones are given back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import numpy as np
import torch

from backends.base import HostWrites, WrittenRows, already_landed

log = logging.getLogger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable: for every device's context, not only the current one


def _page_locked_like(rows: torch.Tensor) -> torch.Tensor:
    return torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)


def rows_to_host(rows: torch.Tensor) -> np.ndarray:
    """Rows as numpy. From a GPU, one copy into page-locked memory (pageable memory goes through a
    staging buffer at a fraction of the speed); the array
    keeps that memory until it is dropped, then torch's host allocator reuses it."""
    if rows.device.type == "cpu":
        return rows.numpy()
    return _page_locked_like(rows).copy_(rows).numpy()


def register_host_memory(address: int, size: int) -> bool:
    error = torch.cuda.cudart().cudaHostRegister(address, size, _PORTABLE)
    if int(error) != 0:
        log.warning("cannot register %d bytes of host memory with CUDA: %s", size, error)
        return False
    return True


def unregister_host_memory(address: int) -> None:
    error = torch.cuda.cudart().cudaHostUnregister(address)
    if int(error) != 0:
        log.warning("cannot unregister host memory from CUDA: %s", error)


async def _until(event: torch.cuda.Event) -> None:
    # By the caller's next engine call the copy has long landed: a thread that waits for it would
    # only cost wake-ups, so the event is asked first.
    if not event.query():
        await asyncio.to_thread(event.synchronize)


def write_rows_into(
    rows: torch.Tensor, into: np.ndarray, keep: bool, positions: Sequence[int] | None = None
) -> WrittenRows:
    """Rows from the GPU straight into the caller's registered memory `into` (row positions[i]
    into into[i], gathered on the device, when given); with `keep`, `rows` also into page-locked
    memory of the engine's own, which lands while the answer leaves."""
    stream = torch.cuda.current_stream(rows.device)
    answer = rows if positions is None else rows[torch.tensor(positions, device=rows.device)]
    torch.from_numpy(into).copy_(answer, non_blocking=True)
    written = torch.cuda.Event()
    written.record(stream)
    if not keep:
        written.synchronize()
        return WrittenRows(into, already_landed)
    own = _page_locked_like(rows).copy_(rows, non_blocking=True)
    landed = torch.cuda.Event()
    landed.record(stream)
    written.synchronize()
    return WrittenRows(own.numpy(), lambda: _until(landed))


class CudaHostWrites(HostWrites):
    """Host memory registered with the CUDA driver, and an engine's rows copied into it from the
    GPU by `write` (on the engine's worker thread, as every model call: write_rows_into)."""

    def __init__(
        self,
        write: Callable[
            [Sequence[Sequence[int]], Sequence[str | None], np.ndarray, bool, Sequence[int] | None],
            Awaitable[WrittenRows],
        ],
    ) -> None:
        self._write = write

    def register(self, address: int, size: int) -> bool:
        return register_host_memory(address, size)

    def unregister(self, address: int) -> None:
        unregister_host_memory(address)

    async def write_rows(
        self,
        rows: Sequence[Sequence[int]],
        adapters: Sequence[str | None],
        into: np.ndarray,
        keep: bool,
        positions: Sequence[int] | None = None,
    ) -> WrittenRows:
        return await self._write(rows, adapters, into, keep, positions)


# Looked up once (the check runs after every dense call): empty_host_cache is public from torch
# 2.13, private before; a torch with neither the statistics nor the release never releases.
_host_memory_stats = getattr(torch.cuda, "host_memory_stats", dict)
_release_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(
    torch._C, "_host_emptyCache", None
)


def release_pinned_memory(limit: int) -> bool:
    """Gives the page-locked blocks that no array uses back when torch holds more than `limit`."""
    if _release_host_cache is None or _host_memory_stats().get("allocated_bytes.current", 0) <= limit:
        return False
    _release_host_cache()
    return True
