"""Large array copies on several threads: one thread's memcpy reaches a fraction of what the
memory can do (docs/performance.md). numpy releases
the interpreter lock while it copies, so the pieces run in parallel; the calling thread copies
the last piece itself rather than wait idle."""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_PIECE = 4 << 20  # bytes: below this a piece is not worth a thread
_THREADS = min(16, os.cpu_count() or 1)  # pieces at most: the helpers and the calling thread


@functools.cache
def _copiers() -> ThreadPoolExecutor:
    """Started by the first large copy, not by importing this module."""
    return ThreadPoolExecutor(max_workers=max(_THREADS - 1, 1), thread_name_prefix="copy")


def copy_into(destination: np.ndarray, source: np.ndarray) -> None:
    """destination[...] = source, for arrays of one shape, in pieces along the first axis."""
    pieces = min(_THREADS, len(source), source.nbytes // _PIECE)
    if pieces <= 1:
        np.copyto(destination, source)
        return
    bounds = np.linspace(0, len(source), pieces + 1, dtype=np.int64).tolist()
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    helpers = [_copiers().submit(np.copyto, destination[a:b], source[a:b]) for a, b in spans[:-1]]
    a, b = spans[-1]
    np.copyto(destination[a:b], source[a:b])
    for helper in helpers:
        helper.result()
