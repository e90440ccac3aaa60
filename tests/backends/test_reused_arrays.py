"""The engine's page-locked rows for the output cache are reused (backends/transformers/host_copy.py
ReusedArrays), never while anything still views them: here over plain numpy memory, the same
logic CudaHostMemory runs over torch's page-locked memory."""

from __future__ import annotations

import gc

import numpy as np

from backends.rows import PackedRows
from backends.transformers.host_copy import ReusedArrays
from gateway.dense.row_cache import MemoryRowCache


class Allocations:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self, rows: int) -> np.ndarray:
        self.count += 1
        return np.zeros((rows, 8), dtype=np.float32)


def test_an_array_comes_back_once_nothing_views_it():
    allocate = Allocations()
    arrays = ReusedArrays(allocate, 1 << 20)
    first = arrays.empty(4)
    address = first.ctypes.data
    row = first[2]  # a view keeps the memory in use
    del first
    gc.collect()
    second = arrays.empty(4)
    assert second.ctypes.data != address and allocate.count == 2
    del row
    gc.collect()
    third = arrays.empty(4)
    assert third.ctypes.data == address and allocate.count == 2  # reused, not allocated
    assert third.shape == (4, 8) and third.dtype == np.float32 and third.flags.writeable
    assert arrays.empty(3).shape == (3, 8) and allocate.count == 3  # another size: its own memory
    del second, third


async def test_rows_the_output_cache_keeps_are_not_handed_out_again():
    allocate = Allocations()
    arrays = ReusedArrays(allocate, 1 << 20)
    cache = MemoryRowCache(2 * 4 * 8 * 4)  # room for two 4-row matrices
    stored = {}
    for step in range(6):
        rows = arrays.empty(4)
        rows[...] = step
        keys = cache.keys("m", None, PackedRows.of([[step, i] for i in range(4)]))
        await cache.store_rows(keys, rows)
        stored[step] = keys
        del rows
        gc.collect()
        for kept, keys in stored.items():  # every matrix the cache still has holds its own rows
            found = await cache.lookup(keys, 8)
            assert all(row is None for row in found) or all((row == kept).all() for row in found)
    assert allocate.count <= 3  # the evicted matrices' memory came back


def test_dropped_arrays_past_the_bound_go_back_to_the_allocator():
    allocate = Allocations()
    arrays = ReusedArrays(allocate, 4 * 8 * 4)  # one 4-row array may wait
    held = [arrays.empty(4), arrays.empty(4)]
    del held
    gc.collect()
    arrays.empty(4), arrays.empty(4)
    assert allocate.count == 3
