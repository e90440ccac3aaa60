"""A hashable (scope, token ids) pair that computes its hash once.

A row key passes through several dicts and sets per request (merging, cache lookups, pending
stores, storing, evicting), and hashing a tuple is a pass over all of its ids: hundreds per row,
hundreds of rows per SMC step. Used by the client's row cache and the gateway's in-process output
cache. Needs only the standard library.
"""

from __future__ import annotations

from collections.abc import Hashable


class RowKey:
    __slots__ = ("scope", "ids", "_hash")

    def __init__(self, scope: Hashable, ids: tuple[int, ...]) -> None:
        self.scope = scope  # what else the row depends on: a model name, a fingerprint and adapter
        self.ids = ids
        self._hash = hash((scope, ids))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RowKey)
            and self._hash == other._hash
            and self.ids == other.ids
            and self.scope == other.scope
        )

    def __repr__(self) -> str:
        return f"RowKey({self.scope!r}, {self.ids!r})"
