"""logprob_gateway_client.AsyncGatewayLM (genlm's AsyncLM interface) against the real server."""

from __future__ import annotations

import asyncio
import base64
import re
import sys

import httpx
import msgspec
import numpy as np
import pytest
import torch

from logprob_gateway_client import AsyncGatewayLM, GatewayClientError
from logprob_gateway_client.wire import pack_ids
from tests.conftest import MODEL

pytestmark = pytest.mark.slow
PREFIXES = ["The capital of France is", "Once upon a time", "def main():", "1, 2, 3,"]


@pytest.fixture()
def lm(gateway):
    client = AsyncGatewayLM(gateway.base_url, MODEL)
    yield client
    client.close()


def test_vocabulary_and_tokenizer_match_the_model(lm, reference):
    assert lm.vocab_size == len(lm.byte_vocab) == 49152
    ids = reference.tokenizer("héllo 🎉 world", add_special_tokens=False).input_ids
    assert b"".join(lm.byte_vocab[i] for i in ids) == "héllo 🎉 world".encode()
    assert lm.tokenizer("héllo 🎉 world", add_special_tokens=False).input_ids == ids
    assert lm.str_vocab[ids[0]] == reference.tokenizer.decode([ids[0]])
    assert lm.eos_token_ids == [2]


def test_concurrent_calls_share_one_request_and_match_forward_pass(lm, reference):
    rows = [reference.tokenizer(p).input_ids for p in PREFIXES]

    async def run():
        return await asyncio.gather(*(lm.next_token_logprobs(r) for r in rows))

    results = asyncio.run(run())
    assert lm.requests_sent == 1  # one HTTP request carried all rows
    for got, ids in zip(results, rows, strict=True):
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
        assert np.max(np.abs(got.numpy() - reference.logprobs(ids)[-1])) <= 1e-4


def test_sync_batch_cache_and_clear(lm, reference):
    rows = [reference.tokenizer(p).input_ids for p in PREFIXES]
    batch = lm.batch_next_token_logprobs_sync(rows)
    assert tuple(batch.shape) == (len(rows), 49152)
    sent = lm.requests_sent
    again = lm.next_token_logprobs_sync(rows[1])  # served from the client's cache
    assert lm.requests_sent == sent
    assert torch.equal(again, batch[1])
    lm.clear_cache()
    lm.next_token_logprobs_sync(rows[1])
    assert lm.requests_sent == sent + 1
    async_batch = asyncio.run(lm.batch_next_token_logprobs(rows))
    # rows computed in different batch compositions agree to float32 round-off, not bit for bit
    assert torch.max(torch.abs(async_batch - batch)) <= 1e-4


def test_numpy_and_torch_token_ids_are_the_lists_rows(lm, reference):
    ids = reference.tokenizer(PREFIXES[0]).input_ids
    expected = lm.next_token_logprobs_sync(ids)
    sent = lm.requests_sent
    for same in (np.array(ids), torch.tensor(ids), [np.int64(i) for i in ids], tuple(ids)):
        assert torch.equal(lm.next_token_logprobs_sync(same), expected)
    assert lm.requests_sent == sent  # one key whatever the ids came in: the client's cache
    lm.clear_cache()

    async def run():
        return await lm.batch_next_token_logprobs([np.array(ids[:-1]), [np.int32(i) for i in ids[:-2]]])

    shorter, shortest = asyncio.run(run())  # sent: numpy's ints are encoded as ints
    assert lm.requests_sent == sent + 1
    assert np.max(np.abs(shorter.numpy() - reference.logprobs(ids[:-1])[-1])) <= 1e-4
    assert np.max(np.abs(shortest.numpy() - reference.logprobs(ids[:-2])[-1])) <= 1e-4
    for _ in range(3):  # nothing is sent, nor a segment leased: the ids are packed first
        with pytest.raises(TypeError, match="token ids must be integers, not float32"):
            lm.batch_next_token_logprobs_sync([[np.float32(i)] for i in range(8)])  # 1.5 MB: a segment
    assert lm.requests_sent == sent + 1 and lm._segments.created == 0
    extended = lm.batch_next_token_logprobs_sync([ids + [i] for i in range(8)])
    assert lm.requests_sent == sent + 2 and lm.shared_memory_answers == 1 and lm._segments.created == 1
    assert np.max(np.abs(extended[5].numpy() - reference.logprobs(ids + [5])[-1])) <= 1e-4


def test_sample_is_seeded_and_stops_before_eos(lm, reference):
    prompt = reference.tokenizer("The capital of France is").input_ids

    async def run(seed):
        return await lm.sample(
            prompt, max_tokens=5, eos_token_ids=lm.eos_token_ids, temperature=1.0, seed=seed
        )

    first, second = asyncio.run(run(3)), asyncio.run(run(3))
    assert first == second and 0 < len(first) <= 5
    greedy_like = asyncio.run(lm.sample(prompt, max_tokens=3, eos_token_ids=[], temperature=1e-4, seed=0))
    assert greedy_like == reference.greedy(prompt, 3)


def test_bfloat16_transport_within_precision(gateway, reference):
    with AsyncGatewayLM(gateway.base_url, MODEL, dtype="bfloat16", cache_size=0) as lm:
        ids = reference.tokenizer(PREFIXES[0]).input_ids
        got = lm.next_token_logprobs_sync(ids).numpy()
    want = reference.logprobs(ids)[-1]
    assert np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-3)) <= 2**-8


def test_errors_carry_the_server_message(gateway, lm):
    with pytest.raises(GatewayClientError) as missing:
        AsyncGatewayLM(gateway.base_url, "no-such-model")
    assert missing.value.status == 404 and "no-such-model" in missing.value.message
    with pytest.raises(GatewayClientError) as bad:
        lm.next_token_logprobs_sync([49152])
    assert bad.value.status == 400 and "outside the vocabulary" in bad.value.message


def test_a_batch_is_one_request_of_its_distinct_rows_read_without_copies(lm, reference):
    rows = [reference.tokenizer(p).input_ids for p in PREFIXES]
    particles = [rows[0], rows[1], rows[0], rows[2], rows[1]]  # resampled: duplicates

    async def run():
        return await lm.batch_next_token_logprobs(particles), await lm.batch_next_token_logprobs(
            [rows[3], rows[3] + [11]]
        )

    with_duplicates, distinct = asyncio.run(run())
    # one request per batch, read off the socket by the socket transport, not by httpx's own
    assert lm.requests_sent == 2 and lm._transport is not None and lm._transport.reads_sockets
    assert tuple(with_duplicates.shape) == (5, 49152)
    assert torch.equal(with_duplicates[0], with_duplicates[2]) and torch.equal(
        with_duplicates[1], with_duplicates[4]
    )
    for got, ids in zip(with_duplicates, particles, strict=True):
        assert np.max(np.abs(got.numpy() - reference.logprobs(ids)[-1])) <= 1e-4
    # distinct rows: the answer's own buffer, shared with the client's cache, no copy anywhere
    assert np.shares_memory(distinct.numpy(), lm._cache.get((MODEL, pack_ids(rows[3]))))
    assert np.max(np.abs(distinct[1].numpy() - reference.logprobs(rows[3] + [11])[-1])) <= 1e-4
    assert lm.server_timing is not None and "rows;dur=" in lm.server_timing


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_matrix_layout_carries_the_rows_layouts_numbers(gateway, reference, encoding_format):
    rows = [reference.tokenizer(p).input_ids for p in PREFIXES[:3]]

    def post(layout: str, binary: bool) -> dict:
        body = {"model": MODEL, "input": rows, "encoding_format": encoding_format, "layout": layout}
        response = httpx.post(
            gateway.base_url + "/v1/next_token_logprobs",
            json=body,
            headers={"Accept": "application/msgpack"} if binary else {},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        return msgspec.msgpack.decode(response.content) if binary else response.json()

    def floats(values: list) -> np.ndarray:
        return np.array([[-np.inf if v is None else v for v in row] for row in values], dtype=np.float32)

    by_rows = post("rows", binary=True)
    expected = np.stack([np.frombuffer(r["logprobs"], dtype="<f4") for r in by_rows["data"]])
    binary = post("matrix", binary=True)
    assert binary["object"] == "next_token_logprobs.matrix" and binary["rows"] == 3
    assert np.frombuffer(binary["logprobs"], dtype="<f4").reshape(3, -1).tobytes() == expected.tobytes()
    text = post("matrix", binary=False)
    if encoding_format == "base64":
        got = np.frombuffer(base64.b64decode(text["logprobs"]), dtype="<f4").reshape(3, -1)
    else:
        got = floats(text["logprobs"])
    assert got.tobytes() == expected.tobytes()  # the same numbers, bit for bit
    for row, ids in zip(expected, rows, strict=True):
        assert np.max(np.abs(row - reference.logprobs(ids)[-1])) <= 1e-4


def test_a_sync_batch_keeps_the_cached_rows_it_asked_for(gateway, reference):
    """A batch mixing cached and new rows, with a cache too small for both: storing the new rows
    evicts the cached one, which the answer still carries."""
    rows = [reference.tokenizer(p).input_ids for p in PREFIXES[:2]]
    with AsyncGatewayLM(gateway.base_url, MODEL, cache_size=1) as lm:
        first = lm.next_token_logprobs_sync(rows[0])
        batch = lm.batch_next_token_logprobs_sync([rows[0], rows[1]])
        assert lm.requests_sent == 2 and torch.equal(batch[0], first)
        assert np.max(np.abs(batch[1].numpy() - reference.logprobs(rows[1])[-1])) <= 1e-4


def test_sync_calls_keep_the_answers_server_timing(lm, reference):
    assert lm.server_timing is None
    lm.batch_next_token_logprobs_sync([reference.tokenizer(p).input_ids for p in PREFIXES[:2]])
    assert lm.server_timing is not None and "rows;dur=" in lm.server_timing
    lm.server_timing = None
    lm.next_token_logprobs_sync(reference.tokenizer("A sync call of its own").input_ids)
    assert lm.server_timing is not None and "rows;dur=" in lm.server_timing


def test_the_tokenizer_without_transformers_says_which_extra_to_install(lm, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ModuleNotFoundError, match=re.escape('pip install "logprob-gateway-client[genlm]"')):
        _ = lm.tokenizer


@pytest.fixture()
def unavailable_replica():
    """A server whose every answer is the gateway's 503 (a replica loading or draining)."""
    import http.server
    import threading

    class Unavailable(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = b'{"error": {"message": "draining", "type": "service_unavailable", "param": null, "code": null}}'
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("replica", ["unavailable", "gone"])
def test_a_placed_client_whose_replica_is_unavailable_or_gone_goes_back_through_the_router(
    gateway, reference, unavailable_replica, replica
):
    """Behind a router, a client asks the replica the router chose; one that answers 503 or
    cannot be reached sends the call back through the router (here the gateway itself, whose
    `/generate` serves dense rows as a router forwards them), sync and async alike."""
    from bench.launcher import free_port

    gone = f"http://127.0.0.1:{free_port()}"
    lm = AsyncGatewayLM(gateway.base_url, MODEL)
    try:
        rows = [reference.tokenizer(p).input_ids for p in PREFIXES[:2]]
        for call in ("async", "sync"):
            lm._route_through_router()
            lm.replica_url = unavailable_replica if replica == "unavailable" else gone
            lm.clear_cache()
            if call == "async":
                found = asyncio.run(lm.batch_next_token_logprobs(rows))
            else:
                found = lm.batch_next_token_logprobs_sync(rows)
            assert lm.routed and lm.replica_url is None  # the gateway names no replica
            for row, ids in zip(np.asarray(found), rows, strict=True):
                assert np.max(np.abs(row - reference.logprobs(ids)[-1])) <= 1e-4
    finally:
        lm.close()
