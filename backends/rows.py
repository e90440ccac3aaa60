"""Token-id rows packed as the wire brings them, and each row's key, made once where rows enter.

A dense request's rows are every row's ids one after another as little-endian int32 and where
each row ends. A row's key is its ids' bytes (`row_key`): a bytes object hashes once, keeps its
hash, and compares in C, so de-duplication (one index per adapter, backends/placement.py), an
engine's pass, its prefix trie and decode lane all use it as it is, and the output cache makes
its own address of it once per request (its scope, then the key). The row a row extends by one
token has the same bytes less the last id's (`parent_key`), and a growing row's key grows with it
(`GrowingRow`). Engines compute from the packed ids (`views`); one whose library takes lists asks
for them (`lists`) once, where it calls the library.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

INT32 = np.dtype("<i4")


def row_key(ids: np.ndarray | Sequence[int]) -> bytes:
    """The key of the row `ids` (int32, or a list of ids): its ids as little-endian int32 bytes."""
    return np.asarray(ids, dtype=INT32).tobytes()


def parent_key(key: bytes) -> bytes:
    """The key of the row that the row keyed `key` extends by one token."""
    return key[: -INT32.itemsize]


def key_length(key: bytes) -> int:
    """How many ids the row keyed `key` has."""
    return len(key) // INT32.itemsize


class GrowingRow:
    """A generation's ids so far as int32, grown in place, and their key, grown with them by the
    new id's bytes: every step hands its engine a view of the ids and the key without converting
    the whole sequence again."""

    __slots__ = ("_ids", "_length", "key")

    def __init__(self, ids: Sequence[int]) -> None:
        self._ids = np.empty(max(2 * len(ids), 16), dtype=INT32)
        self._ids[: len(ids)] = ids
        self._length = len(ids)
        self.key = row_key(self._ids[: self._length])

    def append(self, token: int) -> None:
        if self._length == len(self._ids):  # earlier views keep the old array
            grown = np.empty(2 * len(self._ids), dtype=INT32)
            grown[: self._length] = self._ids
            self._ids = grown
        self._ids[self._length] = token
        self._length += 1
        self.key += int(token).to_bytes(INT32.itemsize, "little", signed=True)

    def view(self) -> np.ndarray:
        """The ids so far; later appends leave it as it is."""
        return self._ids[: self._length]


class PackedRows:
    __slots__ = ("_data", "_keys", "ends", "ids")

    def __init__(self, ids: np.ndarray, ends: np.ndarray, data: bytes | None = None) -> None:
        self.ids = ids  # int32 [total]: every row's ids, one row after another
        self.ends = ends  # int64 [rows]: where each row ends in `ids`
        self._data = data  # `ids` as bytes, when they came as bytes: keys are slices of it
        self._keys: list[bytes] | None = None

    @classmethod
    def of(cls, rows: Sequence[Sequence[int]]) -> PackedRows:
        """Rows of known-good ids (each within int32)."""
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        ids = np.fromiter((i for row in rows for i in row), dtype=INT32, count=int(lengths.sum()))
        return cls(ids, np.cumsum(lengths))

    @classmethod
    def from_bytes(cls, data: bytes, lengths: Sequence[int]) -> PackedRows:
        """Rows packed as the wire's `{ids, lengths}` (the caller checked the sizes agree)."""
        return cls(np.frombuffer(data, dtype=INT32), np.cumsum(np.asarray(lengths, dtype=np.int64)), data)

    def __len__(self) -> int:
        return len(self.ends)

    @property
    def starts(self) -> np.ndarray:
        starts = np.empty_like(self.ends)
        starts[:1] = 0
        starts[1:] = self.ends[:-1]
        return starts

    @property
    def lengths(self) -> np.ndarray:
        return self.ends - self.starts

    @property
    def keys(self) -> list[bytes]:
        """Row i's key (`row_key` of its ids): slices of the packed bytes."""
        if self._keys is None:
            data = self._data if self._data is not None else row_key(self.ids)
            self._keys = [
                data[4 * s : 4 * e] for s, e in zip(self.starts.tolist(), self.ends.tolist(), strict=True)
            ]
        return self._keys

    def views(self) -> list[np.ndarray]:
        """Each row as a view of `ids`: no copy, for the thread that reads them."""
        return np.split(self.ids, self.ends[:-1]) if len(self) else []

    def lists(self) -> list[list[int]]:
        """Each row's ids as a list, for a library that takes lists."""
        values = self.ids.tolist()
        return [values[s:e] for s, e in zip(self.starts.tolist(), self.ends.tolist(), strict=True)]

    @classmethod
    def from_keys(cls, keys: list[bytes]) -> PackedRows:
        """The rows whose keys are `keys`, in that order."""
        rows = cls(
            np.frombuffer(b"".join(keys), dtype=INT32),
            np.cumsum(np.fromiter(map(key_length, keys), dtype=np.int64, count=len(keys))),
        )
        rows._keys = keys
        return rows

    def take(self, positions: Sequence[int]) -> PackedRows:
        """The rows at `positions`, in that order."""
        keys = self.keys
        return PackedRows.from_keys([keys[i] for i in positions])
