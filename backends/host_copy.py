"""Dense rows from the device to host memory: the copies the transformers engine makes per call.

From a GPU, rows go into page-locked memory (pageable memory goes through a staging buffer at a
fraction of the speed), or straight into a caller's memory registered with the driver
(gateway/host_memory.py). torch keeps page-locked blocks for reuse; past a bound, the unused ones
are given back.
"""

from __future__ import annotations

import numpy as np
import torch

from backends.base import RowsTarget


def _page_locked_like(rows: torch.Tensor) -> torch.Tensor:
    return torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)


def rows_to_host(rows: torch.Tensor) -> np.ndarray:
    """Rows as numpy. From a GPU, one copy into page-locked memory (pageable memory goes through a
    staging buffer at a fraction of the speed); the array
    keeps that memory until it is dropped, then torch's host allocator reuses it."""
    if rows.device.type == "cpu":
        return rows.numpy()
    return _page_locked_like(rows).copy_(rows).numpy()


def write_target(rows: torch.Tensor, target: RowsTarget) -> np.ndarray:
    """Rows from the GPU straight into the caller's registered memory (one copy, where going
    through page-locked memory and on into the target took two), and into
    page-locked memory of the engine's own, for the output cache, while the answer leaves (unless
    the target needs no copy kept)."""
    stream = torch.cuda.current_stream(rows.device)
    torch.from_numpy(target.rows).copy_(rows, non_blocking=True)
    written = torch.cuda.Event()
    written.record(stream)
    if not target.keep:
        written.synchronize()
        target.written = True
        return target.rows
    own = _page_locked_like(rows).copy_(rows, non_blocking=True)
    landed = torch.cuda.Event()
    landed.record(stream)
    written.synchronize()
    target.written, target.landing = True, landed
    return own.numpy()


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
