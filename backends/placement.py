"""Dense rows asked of an engine: the one place where repeats are dropped and rows are placed.

Every caller of an engine's dense rows comes through `place_rows`. A row asked twice (resampled
particles) is computed once, and a row whose log-probabilities the caller has already (`known`:
an output cache's hits) not at all: the engine sees each (adapter, row) it must compute once, in
calls of at most `max_rows` rows. With `out` (arrays float32 [len(rows), vocab], numpy's `out=`),
every asked row is placed in every array of it: by the engine's device itself when the engine has
host memory (backends.engine.HostMemory: one copy from the device, repeats copied there) and
computes every row in one call, otherwise copied on a worker thread (megabytes: off the event
loop). An engine that merges concurrent calls into one pass drops the repeats among them by the
same rule, `distinct_positions`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from backends.engine import Engine, HostMemory
from backends.rows import PackedRows

# `out` of place_rows: arrays the rows land in, each float32 [asked rows, vocab].
Out = np.ndarray | tuple[np.ndarray, ...]
# Per asked row, its log-probabilities float32 [vocab] where the caller has them, else None.
Known = Sequence[np.ndarray | None]
# Wraps each engine call, given the call's distinct rows (the caller's counters and clocks).
Watch = Callable[[int], AbstractContextManager[object]]


def distinct_positions(
    keys: Sequence[bytes], adapters: Sequence[str | None]
) -> tuple[list[int], list[int] | None]:
    """Where each distinct (adapter, row) first comes, in order, and per row the index of its
    distinct row among those; None for the second when every row is distinct. Rows are told apart
    by their keys (backends/rows.py) as they are, in one index per adapter."""
    firsts: list[int] = []
    positions: list[int] = []
    if len(set(adapters)) <= 1:  # one request's rows: one index
        index: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            position = index.setdefault(key, len(firsts))
            if position == len(firsts):  # seen first here
                firsts.append(i)
            positions.append(position)
    else:
        indexes: dict[str | None, dict[bytes, int]] = {}
        for i, (key, adapter) in enumerate(zip(keys, adapters, strict=True)):
            position = indexes.setdefault(adapter, {}).setdefault(key, len(firsts))
            if position == len(firsts):
                firsts.append(i)
            positions.append(position)
    return firsts, None if len(firsts) == len(keys) else positions


@dataclass(frozen=True)
class DistinctRows:
    """What an engine computes of the asked rows: each (adapter, row) not known once."""

    rows: PackedRows  # the rows to compute, in the order first asked
    adapters: list[str | None]
    firsts: list[int] | None  # the asked row each computed row comes from; None: all, in order
    positions: list[int] | None  # asked row i is computed row positions[i] (-1: known); None: row i
    known: Known | None  # per asked row, its log-probabilities where the caller has them

    @classmethod
    def of(cls, rows: PackedRows, adapters: Sequence[str | None], known: Known | None) -> DistinctRows:
        if known is not None and all(row is None for row in known):
            known = None
        if known is None:
            firsts, positions = distinct_positions(rows.keys, adapters)
            if positions is None:
                return cls(rows, list(adapters), None, None, None)
            return cls(rows.take(firsts), [adapters[i] for i in firsts], firsts, positions, None)
        asked = [i for i, row in enumerate(known) if row is None]
        keys = rows.keys
        taken, repeats = distinct_positions([keys[i] for i in asked], [adapters[i] for i in asked])
        firsts = [asked[j] for j in taken]
        positions = [-1] * len(rows)
        for j, i in enumerate(asked):
            positions[i] = j if repeats is None else repeats[j]
        return cls(rows.take(firsts), [adapters[i] for i in firsts], firsts, positions, known)

    def calls(self, max_rows: int | None) -> list[tuple[PackedRows, list[str | None]]]:
        """The engine calls that compute them, at most `max_rows` rows each (None: one call); none
        when every asked row is known."""
        count = len(self.rows)
        if self.known is not None and not count:
            return []
        if max_rows is None or count <= max_rows:
            return [(self.rows, self.adapters)]
        return [
            (
                self.rows.take(range(start, min(start + max_rows, count))),
                self.adapters[start : start + max_rows],
            )
            for start in range(0, count, max_rows)
        ]

    def spread(self, computed: np.ndarray) -> np.ndarray:
        """The asked rows from the computed ones, none known: `computed` itself when none repeats."""
        return computed if self.positions is None else computed[self.positions]

    def place(self, computed: np.ndarray | None, arrays: Sequence[np.ndarray]) -> None:
        """Every asked row, computed or known, into every one of `arrays`, on the host. Megabytes:
        callers run it off the event loop."""
        if self.known is None:
            assert computed is not None
            copy_rows_into(computed, self.positions, arrays)
            return
        assert self.positions is not None
        asked = [i for i, position in enumerate(self.positions) if position >= 0]
        gathered = [self.positions[i] for i in asked]
        for array in arrays:
            if asked:
                assert computed is not None
                array[asked] = computed[gathered]
            for i, row in enumerate(self.known):
                if row is not None:
                    array[i] = row


@dataclass(frozen=True)
class Computed:
    """The rows the engine computed for a call, in host memory that nothing writes into any more:
    what an output cache may keep."""

    logprobs: np.ndarray  # float32 [rows, vocab]
    asked: list[int] | None  # the asked row each of them is; None: every asked row, in order
    landed: Callable[[], None] | None = None  # blocks until a device's copy into them has landed


@dataclass(frozen=True)
class Placed:
    logprobs: np.ndarray  # float32 [asked rows, vocab]: `out`'s first array, when given
    host_memory: HostMemory | None = None  # what wrote them from a device; None: on the host
    computed: Computed | None = None  # None: nothing computed, or only into memory the caller hands on

    def wait_landed(self, array: np.ndarray | None = None) -> None:
        """Block until the rows of `array` (default: `logprobs`), an array of `out`, have landed;
        at once for rows that were never on a device."""
        if self.host_memory is not None:
            self.host_memory.wait_landed(self.logprobs if array is None else array)

    async def landed(self) -> None:
        """Once the rows of `logprobs` have landed, the event loop never blocked: a worker thread
        waits out a device's copy."""
        if self.host_memory is not None:
            await asyncio.to_thread(self.host_memory.wait_landed, self.logprobs)


def outputs(out: Out) -> tuple[np.ndarray, ...]:
    return out if isinstance(out, tuple) else (out,)


def _unwatched(rows: int) -> AbstractContextManager[object]:
    return nullcontext()


async def place_rows(
    engine: Engine,
    rows: PackedRows,
    adapters: Sequence[str | None] | None = None,
    out: Out | None = None,
    known: Known | None = None,
    *,
    keep: bool = False,
    max_rows: int | None = None,
    watch: Watch = _unwatched,
) -> Placed:
    """The log-probabilities after each of `rows` (row i under `adapters[i]`; None: the base
    model), each distinct row not `known` computed once; in every array of `out` when given.
    `keep`: where the device writes into `out`, it also writes into page-locked rows of the
    engine's own (`Placed.computed`, for a cache to keep)."""
    distinct = DistinctRows.of(rows, [None] * len(rows) if adapters is None else adapters, known)
    calls = distinct.calls(max_rows)
    host_memory = engine.host_memory
    if out is not None and host_memory is not None and distinct.known is None and len(calls) == 1:
        arrays = outputs(out)
        own = host_memory.empty(len(rows)) if keep else None
        with watch(len(distinct.rows)):
            await host_memory.write_rows(
                distinct.rows,
                distinct.adapters,
                arrays if own is None else (*arrays, own),
                distinct.positions,
            )
        kept = None if own is None else Computed(own, None, partial(host_memory.wait_landed, own))
        return Placed(arrays[0], host_memory, kept)
    parts = []
    for call_rows, call_adapters in calls:
        with watch(len(call_rows)):
            parts.append(await engine.next_token_logprobs(call_rows, call_adapters))
    computed = None if not parts else parts[0] if len(parts) == 1 else await _off_loop(np.concatenate, parts)
    kept = None if computed is None else Computed(computed, distinct.firsts)
    if out is None and distinct.known is None:
        assert computed is not None
        return Placed(await _off_loop(distinct.spread, computed), computed=kept)
    if out is None:
        assert known is not None
        width = computed.shape[1] if computed is not None else next(r for r in known if r is not None).size
        out = np.empty((len(rows), width), dtype=np.float32)
    arrays = outputs(out)
    await asyncio.to_thread(distinct.place, computed, arrays)
    return Placed(arrays[0], computed=kept)


INLINE_COPY_BYTES = 4 * 2**20  # copies smaller than this cost less than a thread's hand-off


async def _off_loop(copy: Callable[[Any], np.ndarray], rows: Any) -> np.ndarray:
    """`copy(rows)`, on a worker thread where `rows` hold megabytes, so the event loop never
    stalls on a copy of a large answer."""
    size = sum(part.nbytes for part in rows) if isinstance(rows, list) else rows.nbytes
    return copy(rows) if size < INLINE_COPY_BYTES else await asyncio.to_thread(copy, rows)


def copy_rows_into(
    logprobs: np.ndarray, positions: Sequence[int] | None, arrays: Sequence[np.ndarray]
) -> None:
    """logprobs[positions] (all its rows, in order, for None) into every one of `arrays`, on the
    host. Megabytes: callers run it off the event loop."""
    for array in arrays:
        if positions is None:
            array[...] = logprobs
        else:
            np.take(logprobs, positions, axis=0, out=array)
