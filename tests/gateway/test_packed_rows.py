"""The packed input of POST /v1/next_token_logprobs (`{"ids": little-endian int32 bytes,
"lengths": [...]}`, what AsyncGatewayLM sends), against the real server: its rows are the direct
forward pass's and the list form's, in JSON (base64) and in MessagePack; the output cache finds a
row whichever form asked for it first; every malformed packing is a 400 in the API's error format."""

from __future__ import annotations

import base64
import random

import msgspec
import numpy as np
import pytest

from tests.conftest import MODEL

pytestmark = pytest.mark.slow

VOCAB = 49152
ENDPOINT = "/v1/next_token_logprobs"
MSGPACK = "application/msgpack"


def pack(rows: list[list[int]]) -> dict:
    return {
        "ids": np.concatenate([np.asarray(r, "<i4") for r in rows]).tobytes(),
        "lengths": list(map(len, rows)),
    }


def as_json(packed: dict) -> dict:
    return {**packed, "ids": base64.b64encode(packed["ids"]).decode()}


def matrix_json(http, input_: object) -> tuple[np.ndarray, int]:
    """The float32 matrix of a JSON request (base64 answer), and its cache hits."""
    body = {"model": MODEL, "input": input_, "encoding_format": "base64", "layout": "matrix"}
    response = http.post(ENDPOINT, json=body)
    assert response.status_code == 200, response.text
    document = response.json()
    matrix = np.frombuffer(base64.b64decode(document["logprobs"]), "<f4").reshape(document["rows"], VOCAB)
    return matrix, document["usage"]["cache_hits"]


def matrix_msgpack(http, input_: object) -> tuple[np.ndarray, int]:
    body = {"model": MODEL, "input": input_, "layout": "matrix"}
    response = http.post(
        ENDPOINT,
        content=msgspec.msgpack.encode(body),
        headers={"Content-Type": MSGPACK, "Accept": MSGPACK},
    )
    assert response.status_code == 200, response.text
    document = msgspec.msgpack.decode(response.content)
    return np.frombuffer(document["logprobs"], "<f4").reshape(document["rows"], VOCAB), document["usage"][
        "cache_hits"
    ]


def fresh_rows(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """Rows no other test asks for: the output cache holds none of them."""
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def test_packed_rows_are_the_forward_pass_in_json_and_msgpack(http, reference):
    rows = fresh_rows(1, (1, 5, 17, 3))
    in_json, hits = matrix_json(http, as_json(pack(rows)))
    assert hits == 0
    for ids, row in zip(rows, in_json, strict=True):
        assert np.max(np.abs(row - reference.logprobs(ids)[-1])) <= 1e-4
    in_msgpack, hits = matrix_msgpack(http, pack(rows))
    assert hits == len(rows)  # the same rows, whatever the body's format
    assert in_msgpack.tobytes() == in_json.tobytes()
    # repeats and an order of its own: each row where it was asked
    again, _ = matrix_msgpack(http, pack([rows[2], rows[0], rows[2]]))
    assert again.tobytes() == in_json[[2, 0, 2]].tobytes()


@pytest.mark.parametrize("first", ["lists", "packed"])
def test_the_cache_finds_a_row_whichever_form_asked_first(http, first):
    rows = fresh_rows(2 if first == "lists" else 3, (4, 9))
    forms = {"lists": rows, "packed": pack(rows)}
    then = "packed" if first == "lists" else "lists"
    computed, hits = matrix_msgpack(http, forms[first])
    assert hits == 0
    cached, hits = matrix_msgpack(http, forms[then])
    assert hits == len(rows)
    assert cached.tobytes() == computed.tobytes()


def _bad(packed: dict) -> dict:
    return {"model": MODEL, "input": packed}


BAD = {
    "bytes that split an id": (_bad({"ids": b"\x01\x00\x00", "lengths": [1]}), "3 bytes"),
    "lengths asking for more ids": (_bad({**pack([[1, 2, 3]]), "lengths": [2, 2]}), "lengths ask for 4"),
    "lengths asking for fewer ids": (_bad({**pack([[1, 2, 3]]), "lengths": [2]}), "lengths ask for 2"),
    "no rows": (_bad({"ids": b"", "lengths": []}), "at least one row"),
    "an empty row": (_bad({**pack([[1]]), "lengths": [0, 1]}), "lengths"),
    "a negative id": (_bad(pack([[5], [3, -1]])), "token id -1 in row 1"),
    "an id past the vocabulary": (_bad(pack([[VOCAB, 1]])), f"token id {VOCAB} in row 0"),
    "more rows than max_rows": (_bad(pack([[1]] * 1025)), "at most 1024"),
    "an unknown field": (_bad({**pack([[1]]), "offsets": [0]}), "offsets"),
    "lengths that are no integers": (_bad({**pack([[1]]), "lengths": ["1"]}), "lengths"),
    "a length past int32": (_bad({**pack([[1]]), "lengths": [1, 2**63]}), "lengths"),
    "lengths whose sum passes int32": (_bad({**pack([[1]]), "lengths": [2**31 - 1] * 3}), "lengths ask for"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_packing_is_a_400_naming_what_is_wrong(http, case):
    body, says = BAD[case]
    response = http.post(ENDPOINT, content=msgspec.msgpack.encode(body), headers={"Content-Type": MSGPACK})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert says in error["message"], error["message"]


@pytest.mark.hostile
def test_a_length_past_any_integer_in_json_is_a_400(http):
    body = (
        b'{"model": "%s", "input": {"ids": "+AEAAL8NAAA=", "lengths": [1, 18446744073709551616]}}'
        % MODEL.encode()
    )
    response = http.post(ENDPOINT, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert "lengths" in response.json()["error"]["message"]


def test_ids_that_are_not_base64_in_json_are_a_400(http):
    response = http.post(ENDPOINT, json=_bad({"ids": "not base64!", "lengths": [1]}))
    assert response.status_code == 400, response.text
    assert "input" in response.json()["error"]["message"]


def test_a_packed_row_longer_than_the_context_is_a_400(http):
    context = http.get(f"/v1/models/{MODEL}").json()["max_model_len"]
    response = http.post(
        ENDPOINT,
        content=msgspec.msgpack.encode(_bad(pack([[1] * (context + 1)]))),
        headers={"Content-Type": MSGPACK},
    )
    assert response.status_code == 400, response.text
    assert "maximum context length" in response.json()["error"]["message"]
