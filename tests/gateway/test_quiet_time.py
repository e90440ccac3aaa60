"""The output cache stores a response's rows while the next engine call computes (the clients
that asked then wait), not while a client on this host computes on its answer."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
from litestar.testing import TestClient

from backends.rows import PackedRows
from tests.conftest import mock_app_client


@pytest.fixture()
def app_and_client():
    with mock_app_client() as app_and_client:
        yield app_and_client


def ask(client: TestClient, rows: list[list[int]]) -> dict:
    response = client.post(
        "/v1/next_token_logprobs",
        content=msgspec.msgpack.encode({"model": "mock", "input": rows, "layout": "matrix"}),
        headers={"content-type": "application/msgpack", "accept": "application/msgpack"},
    )
    assert response.status_code == 200, response.text
    return msgspec.msgpack.decode(response.content)


def stored(litestar_app, rows: list[list[int]]) -> int:
    cache = litestar_app.state.dense.cache
    served = litestar_app.state.registry.models["mock"]
    keys = cache.keys(served.fingerprint, None, PackedRows.of(rows))
    return sum(cache._items.get(key) is not None for key in keys)


def test_rows_are_stored_once_the_next_engine_call_begins(app_and_client):
    litestar_app, client = app_and_client
    litestar_app.state.dense.quiet.timeout_s = 60  # only an engine call (or a lookup) releases
    engine = litestar_app.state.registry.models["mock"].engine
    first = [[1, 2, 3], [4, 5]]
    answer = ask(client, first)
    time.sleep(0.2)
    assert stored(litestar_app, first) == 0  # the client may be sampling: nothing stored yet
    ask(client, [[6, 7]])  # an engine call: the first rows are stored while it computes
    deadline = time.monotonic() + 10
    while stored(litestar_app, first) < len(first):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    calls = engine.calls
    again = ask(client, first)
    assert again["usage"]["cache_hits"] == len(first) and engine.calls == calls
    assert again["logprobs"] == answer["logprobs"]  # the same bytes
    rows = np.frombuffer(answer["logprobs"], "<f4").reshape(len(first), -1)
    assert np.array_equal(rows, np.stack([engine.logits(r) for r in first]))


def test_a_lookup_of_rows_still_waiting_to_be_stored_finds_them(app_and_client):
    litestar_app, client = app_and_client
    litestar_app.state.dense.quiet.timeout_s = 60
    engine = litestar_app.state.registry.models["mock"].engine
    rows = [[9, 10], [11]]
    answer = ask(client, rows)
    calls = engine.calls
    started = time.monotonic()
    again = ask(client, rows)  # its lookup releases the store and waits for it
    assert time.monotonic() - started < 30
    assert again["usage"]["cache_hits"] == len(rows) and engine.calls == calls
    assert again["logprobs"] == answer["logprobs"]
