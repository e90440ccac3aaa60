"""Packed rows and their keys (backends/rows.py), and placement (backends/placement.py): the engine
computes distinct rows only, from packed ids, and every asked row lands where the caller said."""

from __future__ import annotations

import numpy as np
import pytest

from backends.mock import MockEngine
from backends.placement import place_rows
from backends.rows import PackedRows
from logprob_gateway_client.wire import pack_ids

ROWS = [[1, 2, 3], [7], [1, 2, 3], [40000, 2], [7]]


class Tokenizer:
    eos_token_id = 0


def _engine(host_memory: bool = False) -> MockEngine:
    options = {"host_memory": True} if host_memory else {}
    return MockEngine(Tokenizer(), vocab_size=64, max_model_len=64, model_path="mock", options=options)


def test_rows_from_lists_and_from_wire_bytes_have_the_same_ids_keys_and_views():
    from_lists = PackedRows.of(ROWS)
    data = b"".join(pack_ids(row) for row in ROWS)
    from_bytes = PackedRows.from_bytes(data, [len(row) for row in ROWS])
    for rows in (from_lists, from_bytes):
        assert len(rows) == 5 and rows.lengths.tolist() == [3, 1, 3, 2, 1]
        assert rows.keys == [pack_ids(row) for row in ROWS]  # the wire's bytes, row by row
        assert rows.lists() == ROWS and [v.tolist() for v in rows.views()] == ROWS
        assert rows.views()[3].tolist() == [40000, 2]
    assert np.shares_memory(from_bytes.views()[1], from_bytes.ids)  # views, not copies
    taken = from_bytes.take([3, 0])
    assert taken.lists() == [[40000, 2], [1, 2, 3]] and taken.keys == [pack_ids(ROWS[3]), pack_ids(ROWS[0])]
    assert PackedRows.of([]).lists() == [] and PackedRows.of([]).views() == []


async def test_repeats_are_computed_once_and_every_asked_row_is_placed():
    engine = _engine()
    alone = {i: (await place_rows(engine, PackedRows.of([row]))).logprobs[0] for i, row in enumerate(ROWS)}
    engine.rows_computed = 0
    placed = await place_rows(engine, PackedRows.of(ROWS))
    assert engine.rows_computed == 3  # [1, 2, 3] and [7] once each
    for i in range(len(ROWS)):
        assert np.array_equal(placed.logprobs[i], alone[i])
    # The same row under two adapters is two rows.
    await engine.adapters.load("a", "somewhere")
    engine.rows_computed = 0
    mixed = await place_rows(engine, PackedRows.of([[7], [7]]), [None, "a"])
    assert engine.rows_computed == 2 and not np.array_equal(mixed.logprobs[0], mixed.logprobs[1])


@pytest.mark.parametrize("host_memory", [False, True], ids=["copied on the host", "written by the device"])
async def test_rows_land_in_every_array_of_out(host_memory):
    engine = _engine(host_memory)
    expected = (await place_rows(engine, PackedRows.of(ROWS))).logprobs
    first, second = np.zeros((5, 64), np.float32), np.zeros((5, 64), np.float32)
    placed = await place_rows(engine, PackedRows.of(ROWS), None, (first, second))
    assert placed.logprobs is first
    for array in (first, second):
        placed.wait_landed(array)
        assert np.array_equal(array, expected)
    if host_memory:  # the device's copies: one call, both arrays, repeats placed by it
        assert engine.writes == [2]
        assert engine.host_memory.calls.count(("wait_landed", second.ctypes.data)) == 1
