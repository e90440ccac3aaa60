"""The client's cache of dense rows, by (model, token ids).

Rows are views of the response matrix they arrived in, never copies, so what a row costs is the
matrix it keeps alive: the byte budget counts a matrix in full while any of its rows is cached,
and least recently used rows go until both the row and the byte budgets hold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import numpy as np


class _Matrix:
    __slots__ = ("nbytes", "live")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.live = 0  # cached rows viewing it


class RowCache:
    def __init__(self, max_rows: int, max_bytes: int) -> None:
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.nbytes = 0  # bytes of the matrices that cached rows keep alive
        self._rows: OrderedDict[Hashable, tuple[np.ndarray, _Matrix]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._rows

    def get(self, key: Hashable) -> np.ndarray | None:
        found = self._rows.get(key)
        if found is None:
            return None
        self._rows.move_to_end(key)
        return found[0]

    def put_many(self, keys: Sequence[Hashable], matrix: np.ndarray) -> None:
        """Row i of `matrix` under keys[i] (views of it)."""
        if self.max_rows <= 0 or matrix.nbytes > self.max_bytes:
            return
        block = _Matrix(matrix.nbytes)
        for key, row in zip(keys, matrix, strict=True):
            self._drop(key)
            self._rows[key] = (row, block)
            if block.live == 0:
                self.nbytes += block.nbytes
            block.live += 1
        while self._rows and (len(self._rows) > self.max_rows or self.nbytes > self.max_bytes):
            self._drop(next(iter(self._rows)))

    def clear(self) -> None:
        self._rows.clear()
        self.nbytes = 0

    def _drop(self, key: Hashable) -> None:
        found = self._rows.pop(key, None)
        if found is None:
            return
        block = found[1]
        block.live -= 1
        if block.live == 0:
            self.nbytes -= block.nbytes
