"""Dense rows asked of an engine: repeats computed once, and the rows placed where they go.

Every caller of an engine's dense rows comes through `place_rows`. Rows that repeat (resampled
particles) are computed once: the engine sees distinct (adapter, row) pairs only. With `out`
(arrays float32 [len(rows), vocab], numpy's `out=`), the rows are placed in every array of it:
by the engine's device itself when the engine has host memory (backends.engine.HostMemory: one
copy from the device, repeats copied there), otherwise copied on a worker thread (megabytes: off
the event loop). The caller reads `Placed.rows`, after `wait_landed()` when it was written from
a device.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from backends.engine import Engine, HostMemory
from backends.rows import PackedRows, first_positions

# `out` of place_rows: arrays the rows land in, each float32 [asked rows, vocab].
Out = np.ndarray | tuple[np.ndarray, ...]


@dataclass(frozen=True)
class DistinctRows:
    rows: PackedRows
    adapters: list[str | None]
    positions: list[int] | None  # asked row i is rows[positions[i]]; None: all distinct, in order

    @classmethod
    def of(cls, rows: PackedRows, adapters: Sequence[str | None]) -> DistinctRows:
        if len(set(adapters)) == 1:
            keys: list = rows.keys
        else:
            keys = list(zip(adapters, rows.keys, strict=True))
        firsts, positions = first_positions(keys)
        if positions is None:
            return cls(rows, list(adapters), None)
        return cls(rows.take(firsts), [adapters[i] for i in firsts], positions)

    def spread(self, computed: np.ndarray) -> np.ndarray:
        """The asked rows from the distinct ones: `computed` itself when none repeats."""
        return computed if self.positions is None else computed[self.positions]


@dataclass(frozen=True)
class Placed:
    rows: np.ndarray  # float32 [asked rows, vocab]: `out`'s first array, when given
    host_memory: HostMemory | None = None  # what wrote them from a device; None: on the host

    def wait_landed(self, array: np.ndarray | None = None) -> None:
        """Block until the rows of `array` (default: `rows`), an array of `out`, have landed; at
        once for rows that were never on a device."""
        if self.host_memory is not None:
            self.host_memory.wait_landed(self.rows if array is None else array)


def outputs(out: Out) -> tuple[np.ndarray, ...]:
    return out if isinstance(out, tuple) else (out,)


async def place_rows(
    engine: Engine, rows: PackedRows, adapters: Sequence[str | None] | None = None, out: Out | None = None
) -> Placed:
    """The log-probabilities after each of `rows` (row i under `adapters[i]`; None: the base
    model), each distinct row computed once; in every array of `out` when given."""
    names = list(adapters) if adapters is not None else [None] * len(rows)
    distinct = DistinctRows.of(rows, names)
    host_memory = engine.host_memory
    if out is not None and host_memory is not None:
        arrays = outputs(out)
        await host_memory.write_rows(distinct.rows, distinct.adapters, arrays, distinct.positions)
        return Placed(arrays[0], host_memory)
    computed = await engine.next_token_logprobs(distinct.rows, distinct.adapters)
    if out is None:
        return Placed(distinct.spread(computed))
    arrays = outputs(out)
    await asyncio.to_thread(copy_rows_into, computed, distinct.positions, arrays)
    return Placed(arrays[0])


def copy_rows_into(rows: np.ndarray, positions: Sequence[int] | None, arrays: Sequence[np.ndarray]) -> None:
    """rows[positions] (all of `rows`, in order, for None) into every one of `arrays`, on the
    host. Megabytes: callers run it off the event loop."""
    for array in arrays:
        if positions is None:
            array[...] = rows
        else:
            np.take(rows, positions, axis=0, out=array)
