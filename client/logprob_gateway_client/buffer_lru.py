"""An LRU of values that are views of shared buffers, bounded by entries and by memory.

Dense rows are views of the matrix they arrived or were computed in, never copies, so what an
entry costs is the buffer it keeps alive: a buffer counts once, in full, while any entry views
it. Eviction goes by buffer too: the least recently used buffer goes whole, with its entries,
until both bounds hold (an entry alone would free nothing), and storing a matrix's rows is one
pass in C. Used by the client's row cache and the gateway's in-process output cache. Needs only
the standard library and numpy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import numpy as np


class BufferLRU:
    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.nbytes = 0  # bytes of the buffers that entries keep alive
        self._index: dict[Hashable, _Part] = {}  # key -> the part holding its value
        self._buffers: OrderedDict[int, _Buffer] = OrderedDict()  # id(owner) -> its parts, LRU first

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._index

    def isdisjoint(self, keys: Iterable[Hashable]) -> bool:
        return self._index.keys().isdisjoint(keys)

    def get(self, key: Hashable) -> Any:
        part = self._index.get(key)
        if part is None:
            return None
        self._buffers.move_to_end(part.owner)
        return part.values[part.rows[key]]

    def put(self, key: Hashable, value: Any, owner: object, nbytes: int) -> None:
        """`value` under `key`; it keeps `owner`, `nbytes` of memory, alive (owner may be value).
        Nothing is kept when the owner alone is over the byte bound."""
        self._put(_Part([value], {key: 0}, id(owner)), nbytes)

    def put_rows(self, keys: Sequence[Hashable], matrix: np.ndarray) -> None:
        """Row i of `matrix` under keys[i] (a view of it, made when asked for)."""
        owner = anchor(matrix)
        self._put(_Part(matrix, dict(zip(keys, range(len(matrix)), strict=True)), id(owner)), owner.nbytes)

    def _put(self, part: _Part, nbytes: int) -> None:
        # In bulk, in C where it can be: an SMC step puts hundreds of rows of one matrix, and drops
        # as many, on the caller's critical path.
        if self.max_items <= 0 or nbytes > self.max_bytes:
            return
        index = self._index
        if not index.keys().isdisjoint(part.rows):  # keys that move to this part
            for key in part.rows:
                self.pop(key)
        buffer = self._buffers.get(part.owner)  # values keep owner alive: the id stays its own
        if buffer is None:
            buffer = self._buffers[part.owner] = _Buffer(nbytes)
            self.nbytes += nbytes
        else:
            self._buffers.move_to_end(part.owner)
        buffer.parts.append(part)
        index.update(dict.fromkeys(part.rows, part))
        while len(index) > self.max_items or self.nbytes > self.max_bytes:
            oldest = next(iter(self._buffers))
            if oldest == part.owner:  # this part alone has too many rows: its last ones stay
                for key in list(part.rows)[: len(index) - self.max_items]:
                    self.pop(key)
                break
            self._drop(oldest)

    def pop(self, key: Hashable) -> Any:
        part = self._index.pop(key, None)
        if part is None:
            return None
        value = part.values[part.rows.pop(key)]
        if not part.rows:
            parts = self._buffers[part.owner].parts
            parts.remove(part)
            if not parts:
                self._drop(part.owner)
        return value

    def drop_owner(self, owner: object) -> None:
        """Every entry put with `owner` (for `put_rows`, its `anchor`)."""
        if id(owner) in self._buffers:
            self._drop(id(owner))

    def _drop(self, owner: int) -> None:
        buffer = self._buffers.pop(owner)
        self.nbytes -= buffer.nbytes
        index = self._index
        for part in buffer.parts:
            for key in part.rows:
                if index.get(key) is part:
                    del index[key]

    def clear(self) -> None:
        self._index.clear()
        self._buffers.clear()
        self.nbytes = 0


class _Part:
    """Values put together: `values[rows[key]]` (a matrix's rows, or one value)."""

    __slots__ = ("values", "rows", "owner")

    def __init__(self, values: Any, rows: dict[Hashable, int], owner: int) -> None:
        self.values, self.rows, self.owner = values, rows, owner


class _Buffer:
    """What one owner's memory holds: its size, and the parts that view it."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.parts: list[_Part] = []


def anchor(array: np.ndarray) -> np.ndarray:
    """The array that views of `array` keep alive: numpy points a view's `base` at the first
    array up the chain that owns its memory or wraps a foreign buffer, never at a view between."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array
