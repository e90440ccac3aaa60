"""What the client puts on and reads off the wire: token ids as requests carry them, dense
responses as arrays, error answers as exceptions.

Needs only msgspec, numpy and httpx.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import Any

import httpx
import msgspec
import numpy as np

from logprob_gateway_client.encoding import ITEMSIZE, Dtype, decode_row
from logprob_gateway_client.schemas import (
    SHARED_MEMORY_ANSWER,
    DenseAnswer,
    NextTokenLogprobsBinaryMatrixResponse,
    NextTokenLogprobsSharedMemoryResponse,
)

_ENCODER = msgspec.msgpack.Encoder()

RowKey = tuple[str, bytes]  # (model, the row's packed ids): hashes and compares in C


def encode_request(body: dict[str, Any]) -> bytes:
    return _ENCODER.encode(body)


def pack_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes: the gateway's packed rows, and this client's row
    keys. Lists and tuples of ints (or of numpy's, or 0-d tensors) as they are; numpy arrays and
    torch tensors through `tolist()`."""
    if not isinstance(token_ids, list | tuple) and hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()
    try:
        packed = array.array("i", token_ids)
    except OverflowError:
        raise ValueError("token ids must be below 2**31") from None
    except TypeError:
        wrong = next((v for v in token_ids if not hasattr(v, "__index__")), token_ids)
        raise TypeError(f"token ids must be integers, not {type(wrong).__name__}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def packed_rows(rows: Sequence[bytes]) -> dict[str, Any]:
    """A request's `input` in the packed form, from rows made by `pack_ids`."""
    return {"ids": b"".join(rows), "lengths": [len(row) >> 2 for row in rows]}


class GatewayClientError(RuntimeError):
    """The gateway answered with an error; `status` and the server's message are kept."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def error_from(status: int, content: bytes | bytearray | memoryview) -> GatewayClientError:
    try:
        message = msgspec.json.decode(content)["error"]["message"]
    except Exception:
        message = bytes(content).decode("utf-8", errors="replace")
    return GatewayClientError(status, message)


def raise_for_error(response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise error_from(response.status_code, response.content)


class _BinaryRow(msgspec.Struct):
    index: int
    logprobs: memoryview  # a view into the response body


class _BinaryRows(msgspec.Struct):
    vocab_size: int
    data: list[_BinaryRow]


class _AnswerKind(msgspec.Struct):
    """Which form a matrix answer takes: its `object` field alone (other fields are skipped, the
    matrix without a copy). The answer types are not tagged structs, whose JSON Schema would
    differ, so msgspec cannot pick between them by itself."""

    object: str = ""


_KIND_DECODER = msgspec.msgpack.Decoder(_AnswerKind)
_MATRIX_DECODER = msgspec.msgpack.Decoder(NextTokenLogprobsBinaryMatrixResponse)
_SHARED_MEMORY_DECODER = msgspec.msgpack.Decoder(NextTokenLogprobsSharedMemoryResponse)
_ROWS_DECODER = msgspec.msgpack.Decoder(_BinaryRows)


def decode_msgpack_rows(content: bytes | bytearray, count: int, dtype: Dtype) -> np.ndarray:
    """A MessagePack `layout: rows` response as float32 [count, vocab], one copy per row."""
    document = _ROWS_DECODER.decode(content)
    out = np.empty((count, document.vocab_size), dtype=np.float32)
    for row in document.data:
        out[row.index] = decode_row(row.logprobs, dtype)
    return out


def decode_dense_answer(content: bytes | bytearray | memoryview, count: int) -> DenseAnswer:
    """The gateway's answer as its own type; a matrix in the body stays a view of `content`."""
    shared = _KIND_DECODER.decode(content).object == SHARED_MEMORY_ANSWER
    document: DenseAnswer = (_SHARED_MEMORY_DECODER if shared else _MATRIX_DECODER).decode(content)
    if document.rows != count:
        raise ValueError(f"a {document.rows}-row answer for {count} rows")
    return document


def body_matrix(document: NextTokenLogprobsBinaryMatrixResponse, count: int) -> np.ndarray:
    """The matrix in an answer's body as float32 [count, vocab]: for float32, a view of the body
    (no copy); float16/bfloat16 are widened once."""
    if len(document.logprobs) != count * document.vocab_size * ITEMSIZE.get(document.dtype, 0):
        raise ValueError(f"a {count}-row matrix of {len(document.logprobs)} bytes")
    matrix = decode_row(document.logprobs, document.dtype).reshape(count, document.vocab_size)
    return matrix if matrix.flags.writeable else matrix.copy()  # a view of immutable bytes: copied


def decode_msgpack_matrix(content: bytes | bytearray | memoryview, count: int) -> np.ndarray:
    """A MessagePack `layout: matrix` response with the matrix in its body, as float32 [count, vocab]."""
    document = decode_dense_answer(content, count)
    if not isinstance(document, NextTokenLogprobsBinaryMatrixResponse):
        raise ValueError("a shared memory answer to a request that named no segment")
    return body_matrix(document, count)


async def read_into_buffer(response: httpx.Response) -> bytes | bytearray | memoryview:
    """An httpx response body in one buffer of its announced length. A body that comes as one
    chunk of that length (socket_transport's) is returned as it is; one in many chunks (httpx's own
    transport) is gathered into a buffer as they come, as joining them afterwards would copy tens
    of megabytes once more."""
    length = response.headers.get("content-length")
    if length is None or "content-encoding" in response.headers:
        return await response.aread()
    size = int(length)
    whole: bytes | memoryview = b""
    view: memoryview | None = None
    filled = 0
    async for chunk in response.aiter_raw():
        if filled == 0 and len(chunk) == size:
            whole = chunk
        else:
            if filled + len(chunk) > size:
                raise httpx.RemoteProtocolError(f"a response longer than its announced {size} bytes")
            if view is None:
                view = memoryview(bytearray(size))
            view[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    if filled != size:
        raise httpx.ReadError(f"the response ended after {filled} of {size} bytes")
    return whole if view is None else view
