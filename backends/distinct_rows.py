"""Dense rows that repeat (resampled particles), computed once each, and rows landing in `out`.

Every engine's `next_token_logprobs` goes through `DistinctRows`: the distinct (adapter, row)
pairs are what it computes, `positions` where each asked row is among them. An engine without
a device of its own to copy on computes and copies with `computed_rows`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from backends.engine import Out


@dataclass(frozen=True)
class DistinctRows:
    rows: list[Sequence[int]]
    adapters: list[str | None]
    positions: list[int] | None  # asked row i is rows[positions[i]]; None: all distinct, in order

    @classmethod
    def of(cls, rows: Sequence[Sequence[int]], adapters: Sequence[str | None] | None) -> DistinctRows:
        pairs = list(zip(adapters or [None] * len(rows), map(tuple, rows), strict=True))
        index: dict[tuple[str | None, tuple[int, ...]], int] = {}
        positions = [index.setdefault(pair, len(index)) for pair in pairs]
        if len(index) == len(pairs):
            return cls(list(rows), [a for a, _ in pairs], None)
        return cls([row for _, row in index], [a for a, _ in index], positions)

    def spread(self, computed: np.ndarray) -> np.ndarray:
        """The asked rows from the distinct ones: `computed` itself when none repeats."""
        return computed if self.positions is None else computed[self.positions]


def outputs(out: Out) -> tuple[np.ndarray, ...]:
    return out if isinstance(out, tuple) else (out,)


def write_out(distinct: DistinctRows, computed: np.ndarray, out: Out | None) -> np.ndarray:
    """The asked rows from the distinct `computed` ones: into every array of `out` (returning its
    first), or as a new array (or `computed` itself) without it."""
    if out is None:
        return distinct.spread(computed)
    arrays = outputs(out)
    for array in arrays:
        if distinct.positions is None:
            array[...] = computed
        else:
            np.take(computed, distinct.positions, axis=0, out=array)
    return arrays[0]


async def computed_rows(
    compute: Callable[[list[Sequence[int]], list[str | None]], Awaitable[np.ndarray]],
    rows: Sequence[Sequence[int]],
    adapters: Sequence[str | None] | None,
    out: Out | None,
) -> np.ndarray:
    """`Engine.next_token_logprobs` for an engine that computes the distinct rows with `compute`
    (float32 [len(rows), vocab]) and copies them on the host (megabytes: off the event loop)."""
    distinct = DistinctRows.of(rows, adapters)
    computed = await compute(distinct.rows, distinct.adapters)
    if out is None:
        return distinct.spread(computed)
    return await asyncio.to_thread(write_out, distinct, computed, out)
