"""Property-based tests (hypothesis), beyond schemathesis' schema-level fuzzing.

1. Dense row encodings: float32 bytes and base64 are exact; float16 is numpy's own rounding and
   bfloat16 torch's (round to nearest even), for any float32 bit pattern; NaN stays NaN; the
   MessagePack, base64 and float response bodies carry exactly those values.
2. Request parsing: random documents (wrong types, missing and extra fields, huge, negative and
   non-integer token ids, non-finite numbers), malformed bodies (truncated, deeply nested, not
   UTF-8, random bytes) and wrong Content-Types always get a 2xx or a 4xx with OpenAI's error
   object: never a 5xx, never an exception; a non-finite number is a 400 naming its parameter.

Requests go in-process to the app as it is served (routes, error handlers, guard, metrics) on the
mock engine, so hundreds of examples take seconds. Examples are derandomized (a fixed seed per
test) and no example database is kept, so every run, CI's included, sends the same requests.
"""

from __future__ import annotations

import base64
import json
import math
import re
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from litestar import Litestar
from litestar.testing import TestClient

from gateway.app import ROUTE_HANDLERS, serving_app
from gateway.contract.document import build_openapi
from gateway.dense.delivery import in_body
from gateway.schemas.chat import ChatCompletionResponse
from gateway.schemas.completions import CompletionResponse
from gateway.schemas.logprobs import (
    DetokenizeResponse,
    NextTokenLogprobsBinaryMatrixResponse,
    NextTokenLogprobsBinaryResponse,
    NextTokenLogprobsRequest,
    NextTokenLogprobsResponse,
    NextTokenLogprobsUsage,
    TokenizeResponse,
)
from gateway.schemas.sglang import GenerateResponse
from gateway.settings import CacheSettings, Limits, ModelSettings, Settings
from logprob_gateway_client.encoding import decode_row, row_base64, row_bytes

# float16 rounds finite values past 65504 to inf, as it should; numpy warns when it does.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")


def fuzz(examples: int):
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- 1. encodings -----------------------------------------------------------------------------------

F32 = np.finfo(np.float32)
EXTREMES = np.array(
    [
        -np.inf,  # log(0): real rows contain it
        np.inf,
        0.0,
        -0.0,
        F32.max,  # rounds up to inf in bfloat16
        -F32.max,
        F32.tiny,
        F32.smallest_subnormal,
        -F32.smallest_subnormal,
        65504.0,  # float16's largest finite
        65520.0,  # float16's rounding boundary to inf
        -65520.0,
        2.0**-24,  # float16's smallest subnormal
        -1e-30,  # underflows to -0.0 in float16
        -103.97,  # a typical very unlikely token
    ],
    dtype=np.float32,
)
SIGNALLING_NAN = np.uint32(0x7F800001).view(np.float32)  # naive bfloat16 rounding makes it inf


def _from_bits(bits: np.ndarray) -> np.ndarray:
    return bits.view(np.float32)


# Any float32: arbitrary bit patterns (NaN payloads, subnormals), the extremes, log-prob-like values.
any_bits = hnp.arrays(np.uint32, st.integers(0, 200)).map(_from_bits)
with_extremes = hnp.arrays(
    np.float32,
    st.integers(0, 200),
    elements=st.one_of(
        st.sampled_from([*EXTREMES.tolist(), float(SIGNALLING_NAN)]),
        st.floats(min_value=-1e4, max_value=0.0, width=32),
    ),
)
float32_rows = st.one_of(any_bits, with_extremes)


def bits32(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


@fuzz(300)
@given(float32_rows)
def test_float32_bytes_and_base64_are_exact(values):
    raw = row_bytes(values, "float32")
    assert raw == values.astype("<f4").tobytes()  # little-endian, NaN payloads included
    assert np.array_equal(bits32(decode_row(raw, "float32")), bits32(values))
    assert np.array_equal(bits32(decode_row(row_base64(values, "float32"), "float32")), bits32(values))


@fuzz(300)
@given(float32_rows)
def test_float16_is_numpys_rounding(values):
    with np.errstate(over="ignore"):  # overflow to inf is the expected rounding
        expected = values.astype("<f2")
    raw = row_bytes(values, "float16")
    assert raw == expected.tobytes()
    decoded = decode_row(row_base64(values, "float16"), "float16")
    assert decoded.dtype == np.float32
    assert np.array_equal(bits32(decoded), bits32(expected.astype(np.float32)))


@fuzz(300)
@given(float32_rows)
def test_bfloat16_is_torchs_round_to_nearest_even(values):
    nan = np.isnan(values)
    bf16 = torch.from_numpy(values.copy()).to(torch.bfloat16)
    expected = bf16.view(torch.int16).numpy().view(np.uint16)
    raw = np.frombuffer(row_bytes(values, "bfloat16"), dtype="<u2")
    assert np.array_equal(raw[~nan], expected[~nan])
    assert np.all(raw[nan] == 0x7FC0)  # NaN stays a (quiet) NaN, never inf
    decoded = decode_row(row_base64(values, "bfloat16"), "bfloat16")
    assert np.array_equal(np.isnan(decoded), nan)
    assert np.array_equal(decoded[~nan], bf16.float().numpy()[~nan])


@fuzz(60)
@given(
    rows=hnp.arrays(
        np.float32,
        st.tuples(st.integers(0, 4), st.integers(1, 64)),
        elements=st.one_of(st.just(-np.inf), st.floats(min_value=-1e4, max_value=0.0, width=32)),
    ),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
)
def test_response_bodies_carry_exactly_the_encoded_rows(rows, dtype):
    vocab = rows.shape[1]
    usage = NextTokenLogprobsUsage(prompt_tokens=1, total_tokens=1)

    def encoded(encoding_format: str, binary: bool, layout: str = "rows") -> bytes:
        body = NextTokenLogprobsRequest(
            model="m", input=[1], encoding_format=encoding_format, dtype=dtype, layout=layout
        )
        return b"".join(in_body(rows, body, usage, binary))  # the parts, as sent one after another

    binary = msgspec.msgpack.decode(encoded("base64", True))
    assert binary["dtype"] == dtype and binary["vocab_size"] == vocab
    assert [r["logprobs"] for r in binary["data"]] == [row_bytes(r, dtype) for r in rows]
    assert all(type(r["logprobs"]) is bytes for r in binary["data"])  # MessagePack bin, not str

    text = json.loads(encoded("base64", False))
    assert [base64.b64decode(r["logprobs"]) for r in text["data"]] == [row_bytes(r, dtype) for r in rows]

    floats = json.loads(encoded("float", False))
    assert floats["dtype"] == "float32"
    expected = [[None if v == -math.inf else v for v in r.tolist()] for r in rows]
    assert [r["logprobs"] for r in floats["data"]] == expected  # float32 values exactly, -inf as null

    # layout: matrix. The MessagePack body, sent as a header and the array's own memory, is byte for
    # byte what msgspec writes for the whole document.
    matrix = b"".join(row_bytes(r, dtype) for r in rows)
    document = NextTokenLogprobsBinaryMatrixResponse(
        model="m", vocab_size=vocab, dtype=dtype, usage=usage, rows=len(rows), logprobs=matrix
    )
    assert encoded("float", True, "matrix") == msgspec.msgpack.encode(document)
    text = json.loads(encoded("base64", False, "matrix"))
    assert text["object"] == "next_token_logprobs.matrix" and text["rows"] == len(rows)
    assert base64.b64decode(text["logprobs"]) == matrix
    assert json.loads(encoded("float", False, "matrix"))["logprobs"] == expected


# -- the app, in-process on the mock engine ---------------------------------------------------------

MODEL = "mock"
VOCAB = 49152  # the mock uses the real tokenizer's vocabulary
CONTEXT = 64
LIMITS = Limits(max_n=2, max_prompts=2, max_rows=3, max_tokens=16, max_top_logprobs=5, max_stop=4)

COMPLETIONS, CHAT, DENSE = "/v1/completions", "/v1/chat/completions", "/v1/next_token_logprobs"
TOKENIZE, DETOKENIZE = "/v1/tokenize", "/v1/detokenize"
GENERATE = "/generate"
JSON_TYPES = ["application/json", "application/json; charset=utf-8"]
MSGPACK_TYPES = ["application/msgpack", "application/vnd.msgpack", "application/x-msgpack"]
OTHER_TYPES = ["text/plain", "application/octet-stream", "application/x-www-form-urlencoded", "", None]


@pytest.fixture(scope="module")
def gateway_app() -> Iterator[tuple[Litestar, TestClient]]:
    """The app as the server runs it (inside the guard and the metrics wrapper), started."""
    litestar_app, served = serving_app(
        Settings(
            models=[ModelSettings(name=MODEL, backend="mock", max_model_len=CONTEXT)],
            limits=LIMITS,
            cache=CacheSettings(memory_bytes=16 * 2**20),
        )
    )
    with TestClient(served) as client:
        deadline = time.monotonic() + 120
        while (health := client.get("/health")).status_code != 200:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.1)
        yield litestar_app, client


@pytest.fixture(scope="module")
def app(gateway_app) -> TestClient:
    return gateway_app[1]


@pytest.fixture(scope="module")
def mock_engine(gateway_app):
    return gateway_app[0].state.registry.models[MODEL].engine


def post(app: TestClient, path: str, body: bytes, content_type: str | None, accept: str | None = None):
    headers = {} if content_type is None else {"content-type": content_type}
    if accept is not None:
        headers["accept"] = accept
    return app.post(path, content=body, headers=headers)


def assert_openai_error(response) -> dict:
    """A 4xx whose body is exactly {"error": {"message", "type", "param", "code"}}; returns `error`."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"] != "internal_error"
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    return error


RESPONSE_TYPES = {
    COMPLETIONS: CompletionResponse,
    CHAT: ChatCompletionResponse,
    TOKENIZE: TokenizeResponse,
    DETOKENIZE: DetokenizeResponse,
}


def assert_well_formed_success(path: str, response) -> None:
    """A 2xx body decodes as the endpoint's documented response; a stream ends with [DONE] and
    carries no error event (an error after the 200 would be a 5xx in disguise)."""
    assert response.status_code == 200, response.text[:500]
    content_type = response.headers["content-type"]
    if content_type.startswith("text/event-stream"):
        events = re.findall(rb"^data: (.*)$", response.content, flags=re.M)
        assert events and events[-1] == b"[DONE]", response.content[-300:]
        for event in events[:-1]:
            chunk = json.loads(event)
            assert "error" not in chunk, chunk
            if path == GENERATE:
                msgspec.json.decode(event, type=GenerateResponse)
            else:
                assert chunk["object"] in ("text_completion", "chat.completion.chunk"), chunk
    elif path == GENERATE:
        msgspec.json.decode(response.content, type=GenerateResponse | list[GenerateResponse])
    elif path == DENSE and content_type.startswith("application/msgpack"):
        msgspec.msgpack.decode(response.content, type=NextTokenLogprobsBinaryResponse)
    elif path == DENSE:
        msgspec.json.decode(response.content, type=NextTokenLogprobsResponse)
    else:
        msgspec.json.decode(response.content, type=RESPONSE_TYPES[path])


def assert_handled(path: str, response) -> None:
    if response.status_code < 300:
        assert_well_formed_success(path, response)
    else:
        assert_openai_error(response)


# -- 2. random documents ----------------------------------------------------------------------------

TEXT = st.text(max_size=12)  # any code point but surrogates: NUL, RTL marks, astral planes...
WORDS = st.text(min_size=1, max_size=12)
TINY = [5e-324, 1e-310, 2.2250738585072014e-308, 1e-300]  # subnormal and tiny normal doubles
IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
VALID_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "developer", "assistant"])},
    optional={
        "content": st.one_of(
            TEXT,
            st.none(),
            st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2),
        ),
        "name": TEXT,
    },
)
VALID_PROMPT = st.one_of(
    WORDS, st.lists(WORDS, min_size=1, max_size=2), IDS, st.lists(IDS, min_size=1, max_size=2)
)
VALID_SAMPLING = {
    "max_tokens": st.integers(0, LIMITS.max_tokens),
    "temperature": st.one_of(st.floats(0.0, 2.0), st.sampled_from(TINY)),
    "top_p": st.floats(0.0, 1.0, exclude_min=True),
    "n": st.integers(1, LIMITS.max_n),
    "stop": st.one_of(st.none(), WORDS, st.lists(WORDS, max_size=LIMITS.max_stop)),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100.0, 100.0), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "user": TEXT,
}
# Per endpoint: required fields, optional fields; every value valid (a few combinations are not).
VALID = {
    COMPLETIONS: (
        {"model": st.just(MODEL), "prompt": VALID_PROMPT},
        {**VALID_SAMPLING, "echo": st.booleans(), "logprobs": st.integers(0, LIMITS.max_top_logprobs)},
    ),
    CHAT: (
        {"model": st.just(MODEL), "messages": st.lists(VALID_MESSAGE, min_size=1, max_size=3)},
        {
            **VALID_SAMPLING,
            "max_completion_tokens": st.integers(0, LIMITS.max_tokens),
            "logprobs": st.booleans(),
            "top_logprobs": st.integers(0, LIMITS.max_top_logprobs),
        },
    ),
    DENSE: (
        {
            "model": st.just(MODEL),
            "input": st.one_of(WORDS, IDS, st.lists(IDS, min_size=1, max_size=LIMITS.max_rows)),
        },
        {
            "encoding_format": st.sampled_from(["float", "base64"]),
            "dtype": st.sampled_from(["float32", "float16", "bfloat16"]),
            "add_special_tokens": st.booleans(),
        },
    ),
    TOKENIZE: (
        {"model": st.just(MODEL)},
        {
            "prompt": TEXT,
            "messages": st.lists(VALID_MESSAGE, max_size=2),
            "add_special_tokens": st.booleans(),
            "add_generation_prompt": st.booleans(),
            "return_token_strs": st.booleans(),
        },
    ),
    DETOKENIZE: ({"model": st.just(MODEL), "tokens": st.lists(st.integers(0, VOCAB - 1), max_size=6)}, {}),
    GENERATE: (
        {"text": st.one_of(WORDS, st.lists(WORDS, min_size=1, max_size=2))},
        {
            "model": st.just(MODEL),
            "input_ids": st.one_of(IDS, st.lists(IDS, min_size=1, max_size=2)),
            "sampling_params": st.fixed_dictionaries(
                {},
                optional={
                    "max_new_tokens": st.integers(0, LIMITS.max_tokens),
                    "temperature": st.one_of(st.floats(0.0, 2.0), st.sampled_from(TINY)),
                    "top_p": st.floats(0.0, 1.0, exclude_min=True),
                    "top_k": st.sampled_from([-1, 1, VOCAB]),
                    "stop": st.one_of(WORDS, st.lists(WORDS, max_size=LIMITS.max_stop)),
                    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
                    "n": st.integers(1, LIMITS.max_n),
                    "no_stop_trim": st.booleans(),
                    "sampling_seed": st.integers(-(2**63), 2**63 - 1),
                },
            ),
            "return_logprob": st.booleans(),
            "logprob_start_len": st.integers(-1, 1),
            "top_logprobs_num": st.integers(0, LIMITS.max_top_logprobs),
            "return_text_in_logprobs": st.booleans(),
            "token_ids_logprob": st.lists(st.integers(0, VOCAB - 1), max_size=3),
            "stream": st.booleans(),
            "rid": WORDS,
        },
    ),
}

# Invalid values of the kinds clients send: numbers out of range or not finite, ids out of the
# vocabulary, past int64/uint64 or not integers, unknown models, roles and enum values.
BIG_INTS = [-1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**40, -(2**63) - 1]
INTS = st.one_of(st.integers(-3, 60000), st.sampled_from(BIG_INTS))
BAD_IDS = st.lists(st.one_of(st.integers(0, VOCAB - 1), INTS, st.floats(-1, 2)), max_size=6)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, st.floats(), TEXT)
JUNK = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
NUMBER = st.one_of(st.floats(), st.floats(-150, 150), st.integers(-3, 3))
BAD_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["tool", "wizard", "", "USER"])},
    optional={"content": st.lists(st.fixed_dictionaries({"type": st.just("image_url"), "text": TEXT}))},
)
BAD_VALUES = {
    "model": st.sampled_from(["no-such-model", f"{MODEL}:no-such-lora", "", f"{MODEL}:", ":"]),
    "prompt": st.one_of(st.just(""), st.just([]), st.just([[]]), BAD_IDS, st.lists(BAD_IDS, max_size=3)),
    "input": st.one_of(st.just(""), st.just([]), BAD_IDS, st.lists(BAD_IDS, max_size=LIMITS.max_rows + 2)),
    "tokens": BAD_IDS,
    "messages": st.one_of(st.just([]), st.lists(BAD_MESSAGE, min_size=1, max_size=2)),
    "stop": st.one_of(st.just(""), st.lists(TEXT, max_size=LIMITS.max_stop + 2)),
    "logit_bias": st.dictionaries(
        st.one_of(st.sampled_from([str(VOCAB), "-1", "1.5", "x", "\u00b2", "9" * 30]), TEXT),
        NUMBER,
        max_size=3,
    ),
    "encoding_format": st.sampled_from(["hex", "FLOAT", ""]),
    "dtype": st.sampled_from(["int8", "float64", "bf16"]),
    "best_of": st.integers(-1, 3),
    "suffix": TEXT,
    "text": st.one_of(st.just(""), st.just([]), st.lists(TEXT, max_size=LIMITS.max_prompts + 2)),
    "input_ids": st.one_of(st.just([]), BAD_IDS, st.lists(BAD_IDS, max_size=3)),
    "sampling_params": st.one_of(
        st.dictionaries(
            st.sampled_from(["top_k", "min_p", "regex", "ignore_eos", "max_new_tokens", "n", "x"]),
            JUNK,
            max_size=3,
        ),
        st.lists(st.dictionaries(st.sampled_from(["n", "max_new_tokens"]), INTS, max_size=2), max_size=3),
    ),
    "logprob_start_len": INTS,
    "token_ids_logprob": st.one_of(BAD_IDS, st.lists(BAD_IDS, max_size=3)),
    "rid": st.one_of(st.lists(st.just("r"), min_size=2, max_size=2), TEXT),
}


def any_value(field: str, valid: st.SearchStrategy) -> st.SearchStrategy:
    bad = BAD_VALUES.get(
        field, NUMBER if "temperature" in field or "penalty" in field or field == "top_p" else INTS
    )
    return st.one_of(valid, bad, JUNK)


@st.composite
def documents(draw) -> tuple[str, object]:
    """An endpoint and a body for it: half the time a valid one, else one whose fields may hold
    invalid values of the right kind or anything at all, then up to three mutations (a field
    dropped or replaced, an unknown field added); rarely, not an object at all."""
    path = draw(st.sampled_from(sorted(VALID)))
    required, optional = VALID[path]
    if draw(st.booleans()):
        return path, draw(st.fixed_dictionaries(required, optional=optional))
    optional = {**optional, "best_of": st.just(1), "suffix": st.just("")} if path == COMPLETIONS else optional
    doc = draw(
        st.fixed_dictionaries(
            {k: any_value(k, v) for k, v in required.items()},
            optional={k: any_value(k, v) for k, v in optional.items()},
        )
    )
    fields = sorted({*required, *optional})
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["drop", "replace", "extra"]))
        if action == "drop":
            doc.pop(draw(st.sampled_from(fields)), None)
        elif action == "replace":
            doc[draw(st.sampled_from(fields))] = draw(JUNK)
        else:
            doc[draw(TEXT)] = draw(JUNK)
    if draw(st.sampled_from(["object"] * 19 + ["anything"])) == "anything":
        return path, draw(JUNK)
    return path, doc


def encode_json(doc: object, overflow: bool) -> bytes:
    """JSON text; non-finite floats become NaN/Infinity literals, or 1e999 (out of float range)."""
    text = json.dumps(doc, allow_nan=True)
    if overflow:
        text = re.sub(r"(?<![\w\"])(-?)Infinity", r"\g<1>1e999", text).replace("NaN", "1e999")
    return text.encode()


@fuzz(1200)
@given(documents(), st.sampled_from(["json", "json-1e999", "msgpack"]), st.data())
def test_random_documents_get_a_2xx_or_an_openai_error(app, document, encoding, data):
    path, doc = document
    if encoding == "msgpack":
        try:
            body = msgspec.msgpack.encode(doc)
        except OverflowError:  # an integer MessagePack cannot carry: send it as JSON instead
            encoding, body = "json", encode_json(doc, overflow=False)
        content_type = data.draw(st.sampled_from(MSGPACK_TYPES))
    else:
        body = encode_json(doc, overflow=encoding == "json-1e999")
        content_type = data.draw(st.sampled_from([*JSON_TYPES, "text/plain", None]))
    assert_handled(path, post(app, path, body, content_type))


# -- 3. numbers: non-finite or out of range is a 400 naming the field ----------------------------------

FLOAT_FIELDS = {  # field -> the valid range, bounds inclusive unless noted
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),  # 0 itself is refused
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "logit_bias": (-100.0, 100.0),  # the value of {"5": value}
}
INT_FIELDS = ["max_tokens", "n", "seed", "logprobs"]


def base_request(path: str) -> dict:
    if path == CHAT:
        return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 1}


def with_field(path: str, field: str, value) -> dict:
    return {**base_request(path), field: {"5": value} if field == "logit_bias" else value}


def in_range(field: str, value: float) -> bool:
    low, high = FLOAT_FIELDS[field]
    return math.isfinite(value) and low <= value <= high and not (field == "top_p" and value == 0.0)


def json_number(value: float) -> str:
    """JSON text for any float: non-finite values as 1e999 / -1e999, which overflow a double."""
    if math.isnan(value) or value == math.inf:
        return "1e999"
    return "-1e999" if value == -math.inf else repr(value)


@fuzz(250)
@given(
    path=st.sampled_from([COMPLETIONS, CHAT]),
    field=st.sampled_from(sorted(FLOAT_FIELDS)),
    value=st.one_of(
        st.floats(),
        st.floats(-150.0, 150.0),
        st.sampled_from([math.nan, math.inf, -math.inf, 2.0, 0.0, -0.0, -100.0, *TINY]),
    ),
    binary=st.booleans(),
)
def test_float_fields_accept_their_range_and_name_themselves_otherwise(app, path, field, value, binary):
    if binary:
        body, content_type = msgspec.msgpack.encode(with_field(path, field, value)), "application/msgpack"
    else:
        text = json.dumps(with_field(path, field, "@@"))
        body, content_type = text.replace('"@@"', json_number(value)).encode(), "application/json"
    response = post(app, path, body, content_type)
    if in_range(field, value):
        assert_well_formed_success(path, response)
    else:
        error = assert_openai_error(response)
        assert response.status_code == 400
        assert error["param"] == field, error


NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("field", [*FLOAT_FIELDS, *INT_FIELDS])
@pytest.mark.parametrize("value", list(NON_FINITE), ids=list(NON_FINITE))
def test_non_finite_numbers_are_a_400_naming_the_field(app, path, field, value):
    """MessagePack carries NaN and ±inf as doubles; JSON's only way to spell one is an overflowing
    literal (NaN/Infinity are not JSON: those bodies are refused as malformed, param null)."""
    if path == CHAT and field == "logprobs":
        field = "top_logprobs"
    number = NON_FINITE[value]
    binary = msgspec.msgpack.encode(with_field(path, field, number))
    error = assert_openai_error(post(app, path, binary, "application/msgpack"))
    assert error["param"] == field, error
    overflowing = json.dumps(with_field(path, field, "@@")).replace('"@@"', json_number(number))
    error = assert_openai_error(post(app, path, overflowing.encode(), "application/json"))
    assert error["param"] == field, error
    literal = json.dumps(with_field(path, field, "@@")).replace(
        '"@@"', "NaN" if value == "nan" else value.replace("inf", "Infinity")
    )
    error = assert_openai_error(post(app, path, literal.encode(), "application/json"))
    assert "not valid JSON" in error["message"] and error["param"] is None


# -- 4. malformed bodies --------------------------------------------------------------------------

MSGPACK_KEY = {
    COMPLETIONS: "prompt",
    CHAT: "messages",
    DENSE: "input",
    TOKENIZE: "prompt",
    DETOKENIZE: "tokens",
    GENERATE: "text",
}


def msgpack_str(raw: bytes) -> bytes:
    """A MessagePack str header followed by `raw`, whatever its bytes (str 8 holds up to 255)."""
    return (bytes([0xA0 | len(raw)]) if len(raw) < 32 else bytes([0xD9, len(raw)])) + raw


@st.composite
def malformed(draw) -> tuple[str, bytes, str | None]:
    """A body no endpoint can accept, and the Content-Type it is sent with."""
    path = draw(st.sampled_from(sorted(VALID)))
    key = MSGPACK_KEY[path]
    binary = draw(st.booleans())
    content_type = draw(st.sampled_from(MSGPACK_TYPES if binary else JSON_TYPES))
    kind = draw(st.sampled_from(["truncated", "nested", "utf8", "wrong-format"]))
    if kind == "truncated":
        value = st.lists(VALID_MESSAGE, max_size=2) if key == "messages" else st.one_of(TEXT, st.lists(TEXT))
        doc = {"model": MODEL, key: draw(value | st.lists(st.integers(-1, VOCAB), max_size=8))}
        whole = msgspec.msgpack.encode(doc) if binary else json.dumps(doc).encode()
        body = whole[: draw(st.integers(0, len(whole) - 1))]
    elif kind == "nested":
        depth = draw(st.integers(2, 20000))  # [] alone is a valid token list
        # [1.0, <nested>]: the typed decode refuses it, and the body is decoded again (1.0 as 1)
        after_float = draw(st.booleans())
        head = msgspec.msgpack.encode({"model": MODEL})
        if binary:  # a 2-entry map: model, then `key` holding `depth` nested one-element arrays
            value = b"\x91" * depth + b"\x90"
            if after_float:
                value = b"\x92" + msgspec.msgpack.encode(1.0) + value
            body = b"\x82" + head[1:] + msgpack_str(key.encode()) + value
        else:
            nested = "[" * depth + "]" * depth
            value = f"[1.0, {nested}]" if after_float else nested
            body = f'{{"model": "{MODEL}", "{key}": {value}}}'.encode()
    elif kind == "utf8":  # the model name, or the endpoint's main field, as bytes that are not UTF-8
        raw = draw(st.binary(min_size=1, max_size=40).filter(lambda b: not _is_utf8(b)))
        target = draw(st.sampled_from(["model", key]))
        if binary:
            value = msgpack_str(raw)
            other = msgpack_str(MODEL.encode()) if target == key else msgpack_str(b"x")
            first, second = ("model", key) if target == "model" else (key, "model")
            body = b"\x82" + msgpack_str(first.encode()) + value + msgpack_str(second.encode()) + other
        else:
            escaped = raw.replace(b"\\", b"\\\\").replace(b'"', b'\\"')
            other = f'"{key}": "x"' if target == "model" else f'"model": "{MODEL}"'
            body = b'{"' + target.encode() + b'": "' + escaped + b'", ' + other.encode() + b"}"
    else:  # a valid body in the other format than its Content-Type says
        doc = {"model": MODEL, key: "Hi" if key != "messages" else [{"role": "user", "content": "Hi"}]}
        body = json.dumps(doc).encode() if binary else msgspec.msgpack.encode(doc)
    return path, body, content_type


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@fuzz(300)
@given(malformed())
def test_malformed_bodies_are_a_400(app, case):
    path, body, content_type = case
    response = post(app, path, body, content_type)
    assert response.status_code == 400, (response.status_code, response.text[:300])
    assert_openai_error(response)


@fuzz(150)
@given(
    path=st.sampled_from(sorted(VALID)),
    body=st.binary(max_size=200),
    content_type=st.sampled_from([*JSON_TYPES, *MSGPACK_TYPES, *OTHER_TYPES]),
)
def test_random_bytes_get_an_openai_error(app, path, body, content_type):
    assert_openai_error(post(app, path, body, content_type))


# -- 5. dense rows end to end: every encoding and Accept header carries the engine's exact rows -------

ACCEPTS = [
    None,
    "*/*",
    "application/json",
    "application/msgpack",
    "application/x-msgpack",
    "application/json;q=0.5, application/msgpack",
    "application/msgpack;q=0.1, application/json;q=0.9",
    "application/msgpack;q=0",
    "application/msgpack;q=nan",
    "application/msgpack;q=inf, */*;q=1",
    "application/msgpack;q=abc",
    "text/html",
    ";;,,;q=",
]


@fuzz(40)
@given(
    prefixes=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), min_size=1, max_size=3),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    accept=st.sampled_from(ACCEPTS),
    binary_request=st.booleans(),
)
def test_dense_rows_arrive_exactly_as_the_engine_computed_them(
    app, mock_engine, prefixes, dtype, accept, binary_request
):
    doc = {"model": MODEL, "input": prefixes, "encoding_format": "base64", "dtype": dtype}
    if binary_request:
        body, content_type = msgspec.msgpack.encode(doc), "application/msgpack"
    else:
        body, content_type = json.dumps(doc).encode(), "application/json"
    response = post(app, DENSE, body, content_type, accept)
    assert response.status_code == 200, response.text[:300]
    expected = [row_bytes(mock_engine.logits(p), dtype) for p in prefixes]
    if response.headers["content-type"].startswith("application/msgpack"):
        rows = [
            r.logprobs
            for r in msgspec.msgpack.decode(response.content, type=NextTokenLogprobsBinaryResponse).data
        ]
    else:
        assert response.headers["content-type"].startswith("application/json")
        decoded = msgspec.json.decode(response.content, type=NextTokenLogprobsResponse)
        rows = [base64.b64decode(r.logprobs) for r in decoded.data]  # type: ignore[arg-type]
    assert rows == expected


# -- 6. integers written as floats ------------------------------------------------------------------


def ints_as_floats(value: object) -> object:
    """`value` with every int (bools aside) that a double holds exactly written as a float."""
    if isinstance(value, dict):
        return {k: ints_as_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [ints_as_floats(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) <= 2**53:
        return float(value)
    return value


@st.composite
def valid_documents(draw) -> tuple[str, dict]:
    path = draw(st.sampled_from(sorted(VALID)))
    required, optional = VALID[path]
    return path, draw(st.fixed_dictionaries(required, optional=optional))


def comparable(path: str, response) -> object:
    """What two answers to the same request share: ids, timestamps and cache hits aside."""
    if response.status_code != 200 or path in (COMPLETIONS, CHAT, GENERATE):
        return response.status_code
    if path == DENSE:
        return [row["logprobs"] for row in response.json()["data"]]
    return response.json()


@fuzz(200)
@given(valid_documents(), st.booleans())
def test_integral_floats_decode_as_their_integers(app, document, binary):
    """JSON Schema counts 1.0 as an integer, and the OpenAPI document's types are JSON Schema: a
    request with its integers written as floats gets the integers' answer, in either format."""
    path, doc = document
    floats = ints_as_floats(doc)
    encode, content_type = (
        (msgspec.msgpack.encode, "application/msgpack") if binary else (json.dumps, "application/json")
    )
    with_ints = post(app, path, msgspec.json.encode(doc), "application/json")
    with_floats = post(app, path, encode(floats), content_type)
    assert comparable(path, with_floats) == comparable(path, with_ints), with_floats.text[:300]


# -- 7. methods a path does not serve ---------------------------------------------------------------

UNDOCUMENTED_METHODS = [
    (path.replace("{model}", MODEL), method, {m.upper() for m in operations} | {"OPTIONS"})
    for path, operations in sorted(build_openapi(ROUTE_HANDLERS)["paths"].items())
    for method in ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "TRACE"]
    if method.lower() not in operations
]


@pytest.mark.parametrize(
    ("path", "method", "allow"), UNDOCUMENTED_METHODS, ids=[f"{m} {p}" for p, m, _ in UNDOCUMENTED_METHODS]
)
def test_a_method_the_path_does_not_serve_is_a_405_with_allow(app, path, method, allow):
    """RFC 9110: a 405 says in `Allow` what the path serves (OPTIONS: answered by the framework)."""
    response = app.request(method, path)
    assert response.status_code == 405, response.text[:300]
    assert {m.strip() for m in response.headers["allow"].split(",")} == allow
    if method != "HEAD":  # a HEAD answer has no body
        assert_openai_error(response)


# -- afterwards ---------------------------------------------------------------------------------------


def test_nothing_above_got_a_5xx_or_is_still_in_flight(app):
    """The server's own count (runs last, in file order): no 5xx, and the scrape is the only request
    in flight."""
    text = app.get("/metrics").text
    counted = [line for line in text.splitlines() if line.startswith("logprob_gateway_requests_total{")]
    assert len(counted) > 10, text[:2000]
    # /health answers 503 while the model loads, by design
    assert not [line for line in counted if 'status="5' in line and 'route="/health"' not in line], counted
    assert re.search(r"^logprob_gateway_requests_in_flight 1\.0$", text, flags=re.M), text[:2000]
