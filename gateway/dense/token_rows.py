"""A dense request's rows, checked, in the two forms the way down needs.

Engines take token-id lists. Keys (the output cache's, the batcher's merging of identical rows)
are made of each row's ids as little-endian int32 bytes: a bytes object hashes once, keeps its
hash, and compares in C, where a key class of Python would be called into at every dict and set
operation, several times per row per call. A request in the packed form (`{"ids", "lengths"}`)
brings those bytes itself, checked in one numpy pass; one in lists pays a pass over its ids to
pack them.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import numpy as np

from gateway.errors import InvalidRequestError
from logprob_gateway_client.wire import pack_ids

_INT32 = np.dtype("<i4")


class TokenRows:
    __slots__ = ("ids", "packed")

    def __init__(self, ids: list[Sequence[int]], packed: list[bytes]) -> None:
        self.ids = ids  # row i's token ids, for the engine
        self.packed = packed  # row i's ids as little-endian int32 bytes, for keys

    @classmethod
    def of(cls, rows: Sequence[Sequence[int]]) -> TokenRows:
        """Rows of known-good ids (each below 2**31), as they are."""
        return cls(list(rows), [pack_ids(row) for row in rows])

    @classmethod
    def unpack(cls, ids: bytes, lengths: Sequence[int], vocab_size: int, param: str) -> TokenRows:
        """The packed form: row i is the next lengths[i] int32 ids of `ids`; each id is checked
        against the vocabulary here (the first row at fault is named)."""
        if len(ids) % _INT32.itemsize or len(ids) // _INT32.itemsize != sum(lengths):
            raise InvalidRequestError(
                f"{param}.ids holds {len(ids)} bytes; lengths ask for {sum(lengths)} int32 ids "
                f"({4 * sum(lengths)} bytes)",
                param=param,
            )
        flat = np.frombuffer(ids, dtype=_INT32)
        if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
            bad = int(np.flatnonzero((flat < 0) | (flat >= vocab_size))[0])
            row = int(np.searchsorted(np.fromiter(accumulate(lengths), dtype=np.int64), bad, side="right"))
            raise InvalidRequestError(
                f"token id {int(flat[bad])} in row {row} of {param} is outside the vocabulary [0, {vocab_size})",
                param=param,
            )
        values = flat.tolist()
        rows, packed, start = [], [], 0
        for length in lengths:
            end = start + length
            rows.append(values[start:end])
            packed.append(ids[4 * start : 4 * end])
            start = end
        return cls(rows, packed)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, positions: list[int]) -> TokenRows:
        return TokenRows([self.ids[i] for i in positions], [self.packed[i] for i in positions])
