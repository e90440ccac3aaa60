"""Dense rows from the device to host memory: the copies the transformers engine makes per call.

From a GPU, rows go into page-locked memory (pageable memory goes through a staging buffer at a
fraction of the speed), or straight into a caller's memory registered with the driver
(`cudaHostRegister`: a client's shared memory segment, as the gateway maps it, is ordinary
memory, and registering it makes a copy into it as fast as into page-locked memory). torch keeps
page-locked blocks for reuse; past a bound, the unused ones are given back. A greedy generation
step needs no row on the host at all: its token and alternatives are chosen on the device.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from backends.sampling import Pick

log = logging.getLogger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable: for every device's context, not only the current one


def _page_locked_like(logprobs: torch.Tensor) -> torch.Tensor:
    return torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True)


@dataclass(frozen=True)
class WrittenRows:
    """Where a dense call's rows go from the device: into every one of `arrays`, asked row i being
    the call's row positions[i] (None: in order)."""

    arrays: Sequence[np.ndarray]
    positions: Sequence[int] | None


def rows_to_host(logprobs: torch.Tensor) -> np.ndarray:
    """Rows of log-probabilities as numpy. From a GPU, one copy into page-locked memory (pageable
    memory goes through a staging buffer at a fraction of the speed); the array keeps that memory
    until it is dropped, then torch's host allocator reuses it."""
    if logprobs.device.type == "cpu":
        return logprobs.numpy()
    return _page_locked_like(logprobs).copy_(logprobs).numpy()


def greedy_picks(logprobs: torch.Tensor, alternatives: Sequence[int]) -> list[Pick]:
    """A Pick per row of `logprobs` (float32 [rows, vocab]) with the given number of best entries
    (at least one): one small copy to the host instead of the rows."""
    return picks_from_best(best_entries(logprobs, max(alternatives)).cpu().numpy(), alternatives)


def best_entries(logprobs: torch.Tensor, k: int) -> torch.Tensor:
    """float64 [rows, 1 + 2k] where the rows are: each row's most likely token (the first of equal
    maxima, as np.argmax), then its k best ids and their values (float64 holds every id exactly:
    one copy to the host for all three)."""
    tokens = logprobs.argmax(dim=-1, keepdim=True)
    if k == 1:  # many times faster than topk, on the CPU most of all
        values, ids = logprobs.gather(1, tokens), tokens
    else:
        values, ids = torch.topk(logprobs, k, dim=-1)
    return torch.cat([tokens.double(), ids.double(), values.double()], dim=1)


def picks_from_best(host: np.ndarray, alternatives: Sequence[int]) -> list[Pick]:
    """The Picks of best_entries' rows, row i with alternatives[i] of its best entries."""
    k = (host.shape[1] - 1) // 2
    # Converted once for all rows; each Pick holds views of these (a step's work per stream).
    chosen = host[:, 0].astype(np.int64)
    top_ids, top_vals = host[:, 1 : k + 1].astype(np.int64), host[:, k + 1 :]
    best = top_vals[:, 0].tolist()
    if k > 1:  # equal values in id order, as the host's top_k
        order = np.lexsort((top_ids, -top_vals), axis=-1)
        top_ids, top_vals = np.take_along_axis(top_ids, order, -1), np.take_along_axis(top_vals, order, -1)
    top_logprobs = top_vals.astype(np.float32)
    picks = []
    for i, (token, wanted) in enumerate(zip(chosen.tolist(), alternatives, strict=True)):
        ids = chosen[i : i + 1] if wanted == 1 else top_ids[i, :wanted]
        picks.append(Pick(token, best[i], ids, top_logprobs[i, :wanted]))
    return picks


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


def write_rows_into(
    logprobs: torch.Tensor,
    arrays: Sequence[np.ndarray],
    positions: Sequence[int] | None,
    host_memory: CudaHostMemory | None = None,
) -> None:
    """Rows from the GPU into each of `arrays` (row positions[i] into array[i], gathered on the
    device, when given). Returns once they have landed; with `host_memory`, once they are queued:
    its `wait_landed(array)` waits for each, the first array's rows landing before the later
    arrays' (an answer does not wait for the copies kept for later).
    An array in registered or page-locked memory takes one copy; into pageable memory the
    driver stages it (correct, slower)."""
    answer = logprobs if positions is None else logprobs[torch.tensor(positions, device=logprobs.device)]
    stream = torch.cuda.current_stream(logprobs.device)
    first, *later = arrays
    torch.from_numpy(first).copy_(answer, non_blocking=True)
    landings = [(first, _recorded(stream))] if host_memory is not None else []
    for array in later:  # queued behind the first copy
        torch.from_numpy(array).copy_(answer, non_blocking=True)
    if host_memory is None:
        stream.synchronize()
        return
    if later:
        all_landed = _recorded(stream)
        landings += [(array, all_landed) for array in later]
    host_memory.landing(landings)


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """An event that happens once the work queued on `stream` so far has."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


class ReusedArrays:
    """Arrays from `allocate(rows)`, each taken back once nothing views it any more and handed out
    again for as many rows: the output cache keeps each call's page-locked rows until it evicts
    them, about one matrix per call in steady state, and a reused one spares torch's pinned
    allocation (tens of µs a call, milliseconds for a new block). At most `max_bytes` wait here
    unused; past that, a dropped array goes back to torch."""

    def __init__(self, allocate: Callable[[int], np.ndarray], max_bytes: int) -> None:
        self._allocate = allocate
        self.max_bytes = max_bytes
        self._free: dict[int, list[np.ndarray]] = {}  # rows -> arrays nothing views
        self._free_bytes = 0
        self._lock = threading.Lock()  # arrays die on whichever thread drops them last

    def empty(self, rows: int) -> np.ndarray:
        with self._lock:
            free = self._free.get(rows)
            buffer = free.pop() if free else None
            if buffer is not None:
                self._free_bytes -= buffer.nbytes
        if buffer is None:
            buffer = self._allocate(rows)
        # An array over `buffer`'s memory whose base is no array: numpy points every view of it at
        # it (not at `buffer`), so it lives exactly as long as the caller's views do.
        flat = np.frombuffer(buffer.data, dtype=buffer.dtype)
        weakref.finalize(flat, self._put, buffer)
        return flat.reshape(buffer.shape)

    def _put(self, buffer: np.ndarray) -> None:
        with self._lock:
            if self._free_bytes + buffer.nbytes <= self.max_bytes:
                self._free.setdefault(len(buffer), []).append(buffer)
                self._free_bytes += buffer.nbytes


class CudaHostMemory:
    """Host memory registered with the CUDA driver, and page-locked rows of the engine's own."""

    def __init__(self, vocab_size: int, max_reused_bytes: int = 128 << 20) -> None:
        self.vocab_size = vocab_size
        self._arrays = ReusedArrays(self._page_locked, max_reused_bytes)
        # Copies still under way, by the address of the array they land in, with that array: a
        # view kept alive keeps its memory registered and mapped (a client's segment) or out of
        # reuse (page-locked rows) until the copy has landed, also for a caller that never waits
        # (a request cancelled during its engine call).
        self._landing: dict[int, tuple[torch.cuda.Event, np.ndarray]] = {}
        self._lock = threading.Lock()  # the engine's thread records, the cache's threads wait

    def register(self, address: int, size: int) -> bool:
        return register_host_memory(address, size)

    def unregister(self, address: int) -> None:
        unregister_host_memory(address)

    def empty(self, rows: int) -> np.ndarray:
        return self._arrays.empty(rows)

    def _page_locked(self, rows: int) -> np.ndarray:
        return torch.empty((rows, self.vocab_size), dtype=torch.float32, pin_memory=True).numpy()

    def landing(self, landings: Sequence[tuple[np.ndarray, torch.cuda.Event]]) -> None:
        """Each array is written once its event has happened."""
        with self._lock:
            # Copies nobody waited for let go of their arrays once landed: this stays small.
            for address in [a for a, (event, _) in self._landing.items() if event.query()]:
                del self._landing[address]
            for array, landed in landings:
                self._landing[array.ctypes.data] = (landed, array)

    def wait_landed(self, array: np.ndarray) -> None:
        with self._lock:
            landing = self._landing.pop(array.ctypes.data, None)
        if landing is not None:
            landing[0].synchronize()


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
