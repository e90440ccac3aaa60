"""logprob_gateway_client.buffer_lru.BufferLRU: entries are views, and the budget counts the buffers they keep alive."""

from __future__ import annotations

import numpy as np

from logprob_gateway_client.buffer_lru import BufferLRU


def matrix(rows: int, seed: int, width: int = 250) -> np.ndarray:  # 1000 bytes a row
    return np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)


def test_rows_are_views_and_a_matrix_counts_until_its_last_row_goes():
    cache = BufferLRU(max_items=100, max_bytes=10_000)
    first = matrix(4, 0)
    cache.put_rows(["a", "b", "c", "d"], first)
    assert np.shares_memory(cache.get("b"), first) and np.array_equal(cache.get("b"), first[1])
    assert cache.nbytes == 4000
    second = matrix(4, 1)
    cache.put_rows(["a", "b", "c", "x"], second)  # three rows move to the second matrix
    assert np.array_equal(cache.get("a"), second[0]) and "d" in cache
    assert cache.nbytes == 8000  # "d" alone keeps the whole first matrix alive
    cache.put_rows(["p", "q"], matrix(2, 2))  # 10000 bytes: still fits
    assert cache.nbytes == 10_000 and "d" in cache
    cache.put_rows(["r"], matrix(1, 3))  # over budget: "d", least recently used, goes first
    assert "d" not in cache and cache.nbytes == 7000
    assert len(cache) == 7


def test_row_budget_least_recently_used_matrix_first_and_oversized_matrices_skipped():
    cache = BufferLRU(max_items=4, max_bytes=1 << 20)
    cache.put_rows(["a", "b"], matrix(2, 0))
    cache.put_rows(["c"], matrix(1, 1))
    cache.get("a")  # used: the matrix of "c" is now the oldest
    cache.put_rows(["d", "e"], matrix(2, 2))  # five rows: one matrix goes, whole
    assert {k for k in "abcde" if k in cache} == {"a", "b", "d", "e"} and cache.nbytes == 4000
    cache.put_rows(list("vwxyz"), five := matrix(5, 3))  # more rows than the budget: its last ones stay
    assert [k for k in "abcdevwxyz" if k in cache] == list("wxyz")
    assert np.array_equal(cache.get("w"), five[1]) and cache.nbytes == five.nbytes
    cache.clear()
    cache.put_rows(["a", "b"], matrix(2, 4))
    cache.put_rows(["big"], matrix(1, 2, width=300_000))  # 1.2 MB > max_bytes: not cached at all
    assert "big" not in cache and len(cache) == 2
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0
    off = BufferLRU(max_items=0, max_bytes=1 << 20)
    off.put_rows(["a"], matrix(1, 0))
    assert off.get("a") is None


def test_dropping_an_owner_removes_exactly_its_rows():
    cache = BufferLRU(max_items=100, max_bytes=100_000)
    first, second = matrix(3, 0), matrix(2, 1)
    cache.put_rows(["a", "b", "c"], first)
    cache.put_rows(["c", "d"], second)  # "c" moves to the second matrix
    assert not cache.isdisjoint(["x", "a"]) and cache.isdisjoint(["x", "y"])
    cache.drop_owner(first)
    assert {k for k in "abcd" if k in cache} == {"c", "d"} and cache.nbytes == second.nbytes
    assert np.array_equal(cache.get("c"), second[0])
    cache.drop_owner(first)  # nothing left of it: no change
    cache.drop_owner(second)
    assert len(cache) == 0 and cache.nbytes == 0
