"""gateway/body_decode.py: a body decoded by a worker process is the request, or the error, that
decoding it in the serving process gives; a dense request's id rows come back packed."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from gateway.body_decode import BodyDecoder, decode_body
from gateway.errors import InvalidRequestError, RateLimitError
from gateway.schemas.completions import CompletionRequest
from gateway.schemas.logprobs import NextTokenLogprobsRequest, PackedTokenIds

ROWS = [[1, 2, 3], [49151, 7], [5]]


def _in_worker(*bodies: tuple[bytes, bool, type]) -> list:
    """Each body's decode through a worker (every body is over its 1-byte threshold)."""

    async def run() -> list:
        decoder = BodyDecoder(worker_bytes=1)
        results = []
        try:
            for body, binary, body_type in bodies:
                try:
                    results.append(await decoder.decode(body, binary, body_type))
                except Exception as exc:
                    results.append(exc)
        finally:
            await decoder.aclose()
        return results

    return asyncio.run(run())


def test_dense_rows_come_back_packed_and_other_requests_as_decoded():
    segment = {"pid": 7, "fd": 3, "name": "logprob-gateway-" + "a" * 32, "key": "b" * 32, "offset": 64}
    dense = msgspec.json.encode(
        {
            "model": "m",
            "input": ROWS,
            "encoding_format": "base64",
            "layout": "matrix",
            "shared_memory": segment,
        }
    )
    one_row = msgspec.msgpack.encode({"model": "m", "input": ROWS[0]})
    text = msgspec.json.encode({"model": "m", "input": ["a", "b"]})
    # a negative seed is wrapped by the struct's own __post_init__: decoded once, as in process
    completion = msgspec.json.encode({"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 2.0, "seed": -1})
    rows, row, strings, prompt = _in_worker(
        (dense, False, NextTokenLogprobsRequest),
        (one_row, True, NextTokenLogprobsRequest),
        (text, False, NextTokenLogprobsRequest),
        (completion, False, CompletionRequest),
    )
    assert isinstance(rows.input, PackedTokenIds) and rows.encoding_format == "base64"
    assert rows.input.lengths == [3, 2, 1]
    assert np.frombuffer(rows.input.ids, "<i4").tolist() == [i for r in ROWS for i in r]
    in_process = decode_body(dense, False, NextTokenLogprobsRequest)
    assert (rows.layout, rows.shared_memory) == (in_process.layout, in_process.shared_memory)
    assert row.input.lengths == [3]
    assert strings == decode_body(text, False, NextTokenLogprobsRequest)
    assert prompt == decode_body(completion, False, CompletionRequest) and prompt.max_tokens == 2


def test_rows_that_cannot_be_packed_stay_lists_for_the_routes_own_errors():
    empty_row = msgspec.json.encode({"model": "m", "input": [[1], []]})
    beyond_int32 = msgspec.json.encode({"model": "m", "input": [[2**40]]})
    got = _in_worker(
        (empty_row, False, NextTokenLogprobsRequest), (beyond_int32, False, NextTokenLogprobsRequest)
    )
    assert [g.input for g in got] == [[[1], []], [[2**40]]]


@pytest.mark.parametrize(
    "body",
    [
        b'{"input": [[1, 2]], "model": 5}',  # the last field wrong
        b'{"model": "m", "input": [[1.5]]}',  # a float that is not an integer
        b'{"model": "m", "input": [[1, 2]',  # cut short
        b'{"model": "m", "input": "\xff"}',  # not UTF-8
    ],
    ids=["wrong-field", "fraction", "cut-short", "not-utf8"],
)
def test_errors_are_those_of_a_decode_in_process(body):
    with pytest.raises((msgspec.DecodeError, InvalidRequestError)) as expected:
        decode_body(body, False, NextTokenLogprobsRequest)
    (got,) = _in_worker((body, False, NextTokenLogprobsRequest))
    assert type(got) is type(expected.value) and str(got) == str(expected.value)


def test_a_worker_that_dies_is_a_400_and_replaced():
    async def run() -> tuple[Exception, object]:
        decoder = BodyDecoder(worker_bytes=1)
        try:
            await decoder.decode(b'{"model": "m", "input": [[1]]}', False, NextTokenLogprobsRequest)
            decoder._free[0].kill()  # as the kernel's OOM killer would
            await decoder._free[0].process.wait()
            try:
                await decoder.decode(b'{"model": "m", "input": [[2]]}', False, NextTokenLogprobsRequest)
            except InvalidRequestError as exc:
                died = exc
            return died, await decoder.decode(
                b'{"model": "m", "input": [[3]]}', False, NextTokenLogprobsRequest
            )
        finally:
            await decoder.aclose()

    died, request = asyncio.run(run())
    assert "could not be decoded" in str(died)
    assert np.frombuffer(request.input.ids, "<i4").tolist() == [3]


def test_a_cancelled_decode_kills_its_worker_and_the_next_body_gets_a_fresh_one():
    big = b'{"model": "m", "input": [' + b",".join([b"[1,2,3,4,5,6,7,8]"] * 2_000_000) + b"]}"

    async def run() -> tuple[int, object]:
        decoder = BodyDecoder(worker_bytes=1)
        try:
            task = asyncio.create_task(decoder.decode(big, False, NextTokenLogprobsRequest))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            ended = len(decoder._free)
            return ended, await decoder.decode(
                b'{"model": "m", "input": [[4]]}', False, NextTokenLogprobsRequest
            )
        finally:
            await decoder.aclose()

    idle_workers, request = asyncio.run(run())
    assert idle_workers == 0  # the cancelled job's worker was killed, not kept with its answer unread
    assert request.input.lengths == [1]


def test_bodies_beyond_the_workers_and_their_queue_are_a_429_at_once():
    body = b'{"model": "m", "input": [' + b",".join([b"[1,2,3,4,5,6,7,8]"] * 300_000) + b"]}"

    async def run() -> list:
        decoder = BodyDecoder(worker_bytes=1, workers=1, max_waiting=1)
        try:
            jobs = [
                asyncio.create_task(decoder.decode(body, False, NextTokenLogprobsRequest)) for _ in range(3)
            ]
            return await asyncio.gather(*jobs, return_exceptions=True)
        finally:
            await decoder.aclose()

    decoded, waited, refused = asyncio.run(run())
    assert decoded.input.lengths == waited.input.lengths == [8] * 300_000
    assert isinstance(refused, RateLimitError) and refused.retry_after == 1


@pytest.mark.hostile
def test_a_dense_body_of_too_many_inputs_is_refused_before_its_rows_are_packed():
    body = b'{"model": "m", "input": [' + b",".join([b"[1,2,3,4,5,6,7,8]"] * 300_000) + b"]}"

    async def run() -> None:
        decoder = BodyDecoder(worker_bytes=1)
        try:
            with pytest.raises(
                InvalidRequestError, match="at most 1024 inputs per request in input"
            ) as refused:
                await decoder.decode(body, False, NextTokenLogprobsRequest, max_rows=1024)
            assert refused.value.param == "input"
            packed = await decoder.decode(body, False, NextTokenLogprobsRequest, max_rows=300_000)
            assert packed.input.lengths == [8] * 300_000
        finally:
            await decoder.aclose()

    asyncio.run(run())


@pytest.mark.hostile
def test_one_client_sending_body_after_body_delays_another_by_one_body_at_most():
    """One worker, four waiting places: "mallory" sends five large bodies at once, "alice" one
    just after. Mallory may hold two waiting places (the rest are 429s); alice's body is decoded
    as soon as mallory's first is done, ahead of mallory's waiting ones."""
    body = b'{"model": "m", "input": [' + b",".join([b"[1,2,3,4,5,6,7,8]"] * 200_000) + b"]}"

    async def run() -> tuple[list, list[str]]:
        decoder = BodyDecoder(worker_bytes=1, workers=1, max_waiting=4)
        finished: list[str] = []

        async def send(client: str) -> object:
            decoded = await decoder.decode(body, False, NextTokenLogprobsRequest, client=client)
            finished.append(client)
            return decoded

        try:
            mallory = [asyncio.create_task(send("mallory")) for _ in range(5)]
            await asyncio.sleep(0)
            alice = asyncio.create_task(send("alice"))
            results = await asyncio.gather(*mallory, alice, return_exceptions=True)
            return results, finished
        finally:
            await decoder.aclose()

    results, finished = asyncio.run(run())
    refused = [r for r in results[:5] if isinstance(r, RateLimitError)]
    assert len(refused) == 2 and "2 of them this client's" in str(refused[0])
    assert not isinstance(results[5], Exception)
    assert finished == ["mallory", "alice", "mallory", "mallory"]
