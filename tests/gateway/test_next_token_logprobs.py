"""POST /v1/next_token_logprobs against the real server: every row is the full next-token
distribution of the direct transformers forward pass, in every input form and encoding; concurrent
requests are merged into few engine calls with identical rows computed once; bad input is a 4xx."""

from __future__ import annotations

import asyncio
import base64

import httpx
import msgspec
import numpy as np
import pytest

from gateway.settings import ModelSettings
from tests.conftest import MODEL

pytestmark = pytest.mark.slow

VOCAB = 49152
CONTEXT = 8192
ENDPOINT = "/v1/next_token_logprobs"
MSGPACK = "application/msgpack"
TOL = 1e-4
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press into a system that could "
    "produce books faster than any scribe."
)
LENGTHS = (1, 7, 18, 30)  # deliberately different: the engine pads them into one batch


# --- helpers ------------------------------------------------------------------------------------


def prefixes(reference) -> list[list[int]]:
    ids = reference.tokenizer(TEXT, add_special_tokens=False).input_ids
    assert len(ids) >= max(LENGTHS)
    return [ids[:n] for n in LENGTHS]


def post(http: httpx.Client, body: dict, *, accept: str | None = None) -> httpx.Response:
    headers = {"Accept": accept} if accept else {}
    return http.post(ENDPOINT, json=body, headers=headers)


def ok_json(http: httpx.Client, **fields) -> dict:
    response = post(http, {"model": MODEL, **fields})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    return response.json()


def float_rows(body: dict) -> np.ndarray:
    """The "float" encoding: JSON numbers, -inf spelled null. Exactly the float32 values sent."""
    rows = [[-np.inf if v is None else v for v in d["logprobs"]] for d in body["data"]]
    return np.asarray(rows, dtype=np.float64).astype(np.float32)


def raw_rows(body: dict) -> list[bytes]:
    """The "base64" encoding's rows as raw bytes."""
    return [base64.b64decode(d["logprobs"], validate=True) for d in body["data"]]


def decode_f32(raw: bytes) -> np.ndarray:
    assert len(raw) == 4 * VOCAB
    return np.frombuffer(raw, dtype="<f4").astype(np.float32)


def decode_f16(raw: bytes) -> np.ndarray:
    assert len(raw) == 2 * VOCAB
    return np.frombuffer(raw, dtype="<f2")


def decode_bf16(raw: bytes) -> np.ndarray:
    """bfloat16 is the upper half of a float32: widen each little-endian uint16 and shift left 16."""
    assert len(raw) == 2 * VOCAB
    bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << np.uint32(16)
    return bits.view(np.float32)


def expected_row(reference, ids: list[int]) -> np.ndarray:
    return reference.logprobs(ids)[-1]


def assert_row_matches(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == (VOCAB,)
    assert np.isfinite(got).all()
    diff = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
    assert diff <= TOL, f"max abs diff {diff}"
    total = float(np.exp(got.astype(np.float64)).sum())
    assert abs(total - 1.0) <= TOL, total


def assert_error(response: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["code"] == code, error
    return error


# --- rows ---------------------------------------------------------------------------------------


def test_rows_of_different_lengths_equal_the_reference(http, reference):
    rows = prefixes(reference)
    body = ok_json(http, input=rows)
    assert body["object"] == "list"
    assert body["model"] == MODEL
    assert body["vocab_size"] == VOCAB
    assert body["dtype"] == "float32"
    assert [d["index"] for d in body["data"]] == list(range(len(rows)))
    assert all(d["object"] == "next_token_logprobs" for d in body["data"])
    assert body["usage"]["prompt_tokens"] == sum(LENGTHS)
    assert body["usage"]["total_tokens"] == sum(LENGTHS)
    got = float_rows(body)
    assert got.shape == (len(rows), VOCAB)
    for ids, row in zip(rows, got, strict=True):
        assert_row_matches(row, expected_row(reference, ids))
    # the rows are really different distributions (none was repeated in another's place)
    for i in range(len(got)):
        for j in range(i):
            assert float(np.abs(got[i] - got[j]).max()) > 1e-2


def test_single_token_list(http, reference):
    ids = prefixes(reference)[2]
    body = ok_json(http, input=ids)
    assert len(body["data"]) == 1 and body["data"][0]["index"] == 0
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert_row_matches(float_rows(body)[0], expected_row(reference, ids))


def test_string_and_strings_equal_their_token_ids(http, reference):
    texts = ["The capital of France is", "Once upon a time, héllo wörld 🎉", "1, 2, 3,"]
    ids = [reference.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    by_ids = ok_json(http, input=ids)
    id_rows = float_rows(by_ids)

    single = ok_json(http, input=texts[0])
    assert len(single["data"]) == 1
    assert single["usage"]["prompt_tokens"] == len(ids[0])
    np.testing.assert_array_equal(float_rows(single)[0], id_rows[0])

    several = ok_json(http, input=texts)
    assert [d["index"] for d in several["data"]] == [0, 1, 2]
    assert several["usage"]["prompt_tokens"] == sum(map(len, ids)) == by_ids["usage"]["prompt_tokens"]
    np.testing.assert_array_equal(float_rows(several), id_rows)
    for row_ids, row in zip(ids, id_rows, strict=True):
        assert_row_matches(row, expected_row(reference, row_ids))

    # add_special_tokens: the string is tokenized the way the tokenizer does with special tokens
    special_ids = [reference.tokenizer(t, add_special_tokens=True).input_ids for t in texts]
    with_special = ok_json(http, input=texts, add_special_tokens=True)
    assert with_special["usage"]["prompt_tokens"] == sum(map(len, special_ids))
    np.testing.assert_array_equal(float_rows(with_special), float_rows(ok_json(http, input=special_ids)))


# --- encodings ----------------------------------------------------------------------------------


def test_base64_float32_is_bit_identical_to_float(http, reference):
    rows = prefixes(reference)
    floats = float_rows(ok_json(http, input=rows))
    body = ok_json(http, input=rows, encoding_format="base64", dtype="float32")
    assert body["dtype"] == "float32" and body["vocab_size"] == VOCAB
    assert [d["index"] for d in body["data"]] == list(range(len(rows)))
    decoded = np.stack([decode_f32(r) for r in raw_rows(body)])
    assert decoded.view(np.uint32).tolist() == floats.view(np.uint32).tolist()


def test_base64_float16(http, reference):
    rows = prefixes(reference)
    floats = float_rows(ok_json(http, input=rows))
    body = ok_json(http, input=rows, encoding_format="base64", dtype="float16")
    assert body["dtype"] == "float16"
    for raw, want in zip(raw_rows(body), floats, strict=True):
        got = decode_f16(raw)
        # exactly numpy's round-to-nearest-even float32 -> float16 conversion
        assert got.view(np.uint16).tolist() == want.astype(np.float16).view(np.uint16).tolist()
        finite = np.isfinite(got)
        assert finite.all()  # SmolLM2's log-probabilities lie far inside float16's range
        rel = np.abs(got.astype(np.float64) - want) / np.maximum(np.abs(want.astype(np.float64)), 1e-3)
        assert float(rel.max()) <= 1e-2


def test_base64_bfloat16(http, reference):
    rows = prefixes(reference)
    floats = float_rows(ok_json(http, input=rows))
    body = ok_json(http, input=rows, encoding_format="base64", dtype="bfloat16")
    assert body["dtype"] == "bfloat16"
    for raw, want in zip(raw_rows(body), floats, strict=True):
        got = decode_bf16(raw)
        assert np.isfinite(got).all()
        want64, got64 = want.astype(np.float64), got.astype(np.float64)
        rel = np.abs(got64 - want64) / np.abs(want64)
        assert float(rel.max()) <= 2**-8
        # and it is the nearest bfloat16: one of the two bfloat16 values around the float32
        truncated = (want.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
        away = ((want.view(np.uint32) & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32)
        away = away.astype(np.float64)
        assert np.all((got64 == truncated) | (got64 == away))
        nearest = np.minimum(np.abs(truncated - want64), np.abs(away - want64))
        assert np.all(np.abs(got64 - want64) == nearest)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_msgpack_response_and_request(http, reference, dtype):
    rows = prefixes(reference)
    b64 = raw_rows(ok_json(http, input=rows, encoding_format="base64", dtype=dtype))

    response = post(http, {"model": MODEL, "input": rows, "dtype": dtype}, accept=MSGPACK)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith(MSGPACK)
    body = msgspec.msgpack.decode(response.content)
    assert body["object"] == "list" and body["model"] == MODEL
    assert body["vocab_size"] == VOCAB and body["dtype"] == dtype
    assert body["usage"]["prompt_tokens"] == sum(LENGTHS)
    assert [d["index"] for d in body["data"]] == list(range(len(rows)))
    assert all(isinstance(d["logprobs"], bytes) for d in body["data"])
    assert [d["logprobs"] for d in body["data"]] == b64

    # the request body itself in MessagePack
    packed = http.post(
        ENDPOINT,
        content=msgspec.msgpack.encode({"model": MODEL, "input": rows, "dtype": dtype}),
        headers={"Content-Type": MSGPACK, "Accept": MSGPACK},
    )
    assert packed.status_code == 200, packed.text
    assert packed.headers["content-type"].startswith(MSGPACK)
    again = msgspec.msgpack.decode(packed.content)
    assert [d["logprobs"] for d in again["data"]] == b64
    assert again["dtype"] == dtype and again["usage"]["prompt_tokens"] == sum(LENGTHS)

    # a MessagePack request with a JSON answer
    mixed = http.post(
        ENDPOINT,
        content=msgspec.msgpack.encode(
            {"model": MODEL, "input": rows, "encoding_format": "base64", "dtype": dtype}
        ),
        headers={"Content-Type": MSGPACK},
    )
    assert mixed.status_code == 200, mixed.text
    assert mixed.headers["content-type"].startswith("application/json")
    assert raw_rows(mixed.json()) == b64

    if dtype == "float32":
        for raw, ids in zip(b64, rows, strict=True):
            assert_row_matches(decode_f32(raw), expected_row(reference, ids))


def test_response_sizes(http, reference):
    rows = prefixes(reference)
    sizes: dict[str, dict[int, int]] = {}
    for n in (1, len(rows)):
        body = {"model": MODEL, "input": rows[:n]}
        variants = {
            "json float": post(http, body),
            "json base64 float32": post(http, {**body, "encoding_format": "base64"}),
            "json base64 float16": post(http, {**body, "encoding_format": "base64", "dtype": "float16"}),
            "json base64 bfloat16": post(http, {**body, "encoding_format": "base64", "dtype": "bfloat16"}),
            "msgpack float32": post(http, body, accept=MSGPACK),
            "msgpack float16": post(http, {**body, "dtype": "float16"}, accept=MSGPACK),
            "msgpack bfloat16": post(http, {**body, "dtype": "bfloat16"}, accept=MSGPACK),
        }
        for name, response in variants.items():
            assert response.status_code == 200, (name, response.text)
            sizes.setdefault(name, {})[n] = len(response.content)
    print("\nnext_token_logprobs response sizes (bytes), vocab", VOCAB)
    for name, by_rows in sizes.items():
        per_row = by_rows[len(rows)] / len(rows)
        print(
            f"  {name:22s} 1 row: {by_rows[1]:>9d}   {len(rows)} rows: {by_rows[len(rows)]:>9d}  ({per_row:.0f}/row)"
        )
    for n in (1, len(rows)):
        assert sizes["json float"][n] > sizes["json base64 float32"][n] > sizes["msgpack float32"][n]
        assert sizes["json base64 float16"][n] > sizes["msgpack float16"][n]
        assert sizes["json base64 bfloat16"][n] > sizes["msgpack bfloat16"][n]
        for dtype, width in (("float32", 4), ("float16", 2), ("bfloat16", 2)):
            overhead = sizes[f"msgpack {dtype}"][n] - n * width * VOCAB
            assert 0 < overhead < 200 * n, (dtype, n, overhead)
            # base64 is 4/3 of the raw bytes, plus the JSON around it
            b64 = sizes[f"json base64 {dtype}"][n] - n * 4 * ((width * VOCAB + 2) // 3)
            assert 0 < b64 < 300 * n, (dtype, n, b64)
    assert sizes["msgpack float32"][1] - 4 * VOCAB < 200


# --- batching across concurrent requests --------------------------------------------------------


def test_concurrent_requests_share_engine_passes_and_are_deduplicated(http, gateway, reference):
    n = 64
    distinct = [
        reference.tokenizer(
            f"Concurrent batching check, request number {i}:", add_special_tokens=False
        ).input_ids
        for i in range(n)
    ]
    assert len({tuple(r) for r in distinct}) == n
    shared = [
        reference.tokenizer(
            "A prefix that every concurrent request shares", add_special_tokens=False
        ).input_ids,
        reference.tokenizer(
            "Another shared prefix, somewhat longer than the first one", add_special_tokens=False
        ).input_ids,
    ]
    inputs = [[distinct[i], *shared] for i in range(n)]

    def stats() -> dict:
        response = http.get(f"/v1/models/{MODEL}/stats")
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["model"] == MODEL
        return body

    async def fire() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=300, limits=limits) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        ENDPOINT,
                        json={"model": MODEL, "input": rows},
                        headers={"Accept": MSGPACK},
                    )
                    for rows in inputs
                )
            )

    before = stats()
    responses = asyncio.run(fire())
    after = stats()

    bodies = []
    for response in responses:
        assert response.status_code == 200, response.text
        bodies.append(msgspec.msgpack.decode(response.content))
    submitted = sum(3 - b["usage"]["cache_hits"] for b in bodies)  # rows that reached the engine
    delta = {k: after[k] - before[k] for k in ("requests", "rows", "engine_rows", "engine_calls")}
    passes = {k: after["engine_passes"][k] - before["engine_passes"][k] for k in ("passes", "rows")}
    largest = after["engine_passes"]["largest"]
    print(f"\n64 concurrent requests: stats delta {delta}, engine passes {passes}, largest pass {largest}")
    assert delta["requests"] == n == delta["engine_calls"]  # a call each: the engine merges them
    assert delta["rows"] == delta["engine_rows"] == submitted
    assert submitted >= n  # each distinct row was new to the cache
    assert after["largest_call"] <= ModelSettings().max_batch_rows
    # the engine's scheduler merged them into few passes, identical rows of a pass computed once
    assert passes["passes"] <= 16
    assert passes["rows"] < delta["rows"]
    assert n <= passes["rows"] <= n + len(shared) * passes["passes"]
    assert largest >= 2

    # each request got its own rows: equal to a separate sequential request and to the reference
    shared_want = [expected_row(reference, ids) for ids in shared]
    for i, body in enumerate(bodies):
        got = [decode_f32(d["logprobs"]) for d in body["data"]]
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        alone = raw_rows(ok_json(http, input=[distinct[i]], encoding_format="base64"))[0]
        assert float(np.abs(got[0] - decode_f32(alone)).max()) <= TOL
        if i % 8 == 0:
            assert_row_matches(got[0], expected_row(reference, distinct[i]))
        for row, want in zip(got[1:], shared_want, strict=True):
            assert_row_matches(row, want)
    # all requests saw the same shared rows
    first = bodies[0]["data"]
    for body in bodies[1:]:
        for k in (1, 2):
            assert (
                float(
                    np.abs(decode_f32(body["data"][k]["logprobs"]) - decode_f32(first[k]["logprobs"])).max()
                )
                <= TOL
            )


# --- errors -------------------------------------------------------------------------------------

ERRORS = {
    "empty-input-list": ([], "input", None),
    "empty-token-list-among-rows": ([[1, 2], []], "input", None),
    "only-an-empty-token-list": ([[]], "input", None),
    "id-equal-to-vocab": ([1, VOCAB], "input", None),
    "id-equal-to-vocab-in-rows": ([[1], [VOCAB]], "input", None),
    "negative-id": ([-1], "input[0]", None),
    "negative-id-in-rows": ([[5], [3, -1]], "input[1][1]", None),
    "empty-string": ("", "input", None),
    "empty-string-in-list": (["hello", ""], "input", None),
    "mixed-str-int": (["hello", 1], "input", None),
    "mixed-int-list": ([1, [2]], "input", None),
    "too-many-rows": ([[1]] * 1025, "input", None),
    "row-longer-than-context": ([[1] * (CONTEXT + 1)], "input", "context_length_exceeded"),
    "single-list-longer-than-context": ([1] * (CONTEXT + 1), "input", "context_length_exceeded"),
}


@pytest.mark.parametrize("case", list(ERRORS), ids=list(ERRORS))
def test_bad_input_is_a_400(http, case):
    value, param, code = ERRORS[case]
    assert_error(post(http, {"model": MODEL, "input": value}), 400, param, code)


def test_other_errors_and_health_after_them(http):
    error = assert_error(
        post(http, {"model": "no-such-model", "input": [1]}), 404, "model", "model_not_found"
    )
    assert "no-such-model" in error["message"]
    assert_error(post(http, {"model": MODEL, "input": [1], "encoding_format": "hex"}), 400, "encoding_format")
    assert_error(post(http, {"model": MODEL, "input": [1], "dtype": "float64"}), 400, "dtype")
    assert_error(post(http, {"model": MODEL, "input": [1], "dtype": "int8"}, accept=MSGPACK), 400, "dtype")
    assert_error(post(http, {"input": [1]}), 400, None)  # no model
    assert_error(post(http, {"model": MODEL}), 400, None)  # no input
    bad_msgpack = http.post(ENDPOINT, content=b"\xc1\xc1", headers={"Content-Type": MSGPACK})
    assert_error(bad_msgpack, 400, None)
    # exactly max_rows rows is fine
    ok = post(http, {"model": MODEL, "input": [[1]] * 1024, "encoding_format": "base64", "dtype": "bfloat16"})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["data"]) == 1024
    assert ok.json()["usage"]["prompt_tokens"] == 1024
    health = http.get("/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok"


@pytest.mark.parametrize(
    ("accept", "msgpack"),
    [
        ("application/msgpack", True),
        ("application/vnd.msgpack", True),
        ("application/json, application/msgpack;q=0.1", False),
        ("application/msgpack, application/json;q=0.5", True),
        ("application/msgpack;q=0", False),
        ("*/*", False),
    ],
)
def test_accept_header_negotiation(http, accept, msgpack):
    response = http.post(
        "/v1/next_token_logprobs", json={"model": MODEL, "input": [[504]]}, headers={"Accept": accept}
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith(
        "application/msgpack" if msgpack else "application/json"
    )
