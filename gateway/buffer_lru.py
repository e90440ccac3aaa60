"""An LRU of values that are views of shared buffers, bounded by entries and by memory.

Dense rows are views of the matrix they arrived or were computed in, never copies, so what an
entry costs is the buffer it keeps alive: a buffer counts once, in full, while any entry views
it, and least recently used entries go until both bounds hold. Used by the client's row cache and
the gateway's in-process output cache. Needs only the standard library and numpy.
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
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()  # key -> (value, id(owner))
        self._owners: dict[int, tuple[int, set[Hashable]]] = {}  # id(owner) -> (bytes, keys viewing it)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def isdisjoint(self, keys: Iterable[Hashable]) -> bool:
        return self._entries.keys().isdisjoint(keys)

    def get(self, key: Hashable) -> Any:
        found = self._entries.get(key)
        if found is None:
            return None
        self._entries.move_to_end(key)
        return found[0]

    def put(self, key: Hashable, value: Any, owner: object, nbytes: int) -> None:
        """`value` under `key`; it keeps `owner`, `nbytes` of memory, alive (owner may be value).
        Nothing is kept when the owner alone is over the byte bound."""
        self._put([key], [value], owner, nbytes)

    def put_rows(self, keys: Sequence[Hashable], matrix: np.ndarray) -> None:
        """Row i of `matrix` under keys[i], as views of it."""
        owner = anchor(matrix)
        self._put(keys, matrix, owner, owner.nbytes)

    def _put(self, keys: Sequence[Hashable], values: Any, owner: object, nbytes: int) -> None:
        # In bulk: an SMC step puts hundreds of rows of one matrix, on the caller's critical path.
        if self.max_items <= 0 or nbytes > self.max_bytes:
            return
        entries = self._entries
        for key in keys:
            if key in entries:
                self.pop(key)
        held = self._owners.get(id(owner))  # values keep owner alive: the id stays its own
        if held is None:
            held = self._owners[id(owner)] = (nbytes, set())
            self.nbytes += nbytes
        for key, value in zip(keys, values, strict=True):
            entries[key] = (value, id(owner))
        held[1].update(keys)
        while len(entries) > self.max_items or self.nbytes > self.max_bytes:
            self.pop(next(iter(entries)))

    def pop(self, key: Hashable) -> Any:
        found = self._entries.pop(key, None)
        if found is None:
            return None
        value, owner = found
        nbytes, keys = self._owners[owner]
        keys.discard(key)
        if not keys:
            del self._owners[owner]
            self.nbytes -= nbytes
        return value

    def drop_owner(self, owner: object) -> None:
        """Every entry put with `owner` (for `put_rows`, its `anchor`)."""
        held = self._owners.pop(id(owner), None)
        if held is not None:
            for key in held[1]:
                del self._entries[key]
            self.nbytes -= held[0]

    def clear(self) -> None:
        self._entries.clear()
        self._owners.clear()
        self.nbytes = 0


def anchor(array: np.ndarray) -> np.ndarray:
    """The array that views of `array` keep alive: numpy points a view's `base` at the first
    array up the chain that owns its memory or wraps a foreign buffer, never at a view between."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array
