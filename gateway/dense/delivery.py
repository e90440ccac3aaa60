"""The bytes of a dense answer: rows or one matrix, as JSON or MessagePack, or written into the
client's shared memory with a small document saying where.

Bodies are lists of buffers sent one after the other (gateway.responses.PartsResponse): a MessagePack
matrix goes out as a header and the rows' own memory, never joined; a JSON answer as its document
around its rows, each encoded alone, so no Python list of every float exists at once.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable

import msgspec
import numpy as np

from gateway.dense.parallel_copy import copy_into
from gateway.schemas.logprobs import (
    NextTokenLogprobsBinaryMatrixResponse,
    NextTokenLogprobsBinaryResponse,
    NextTokenLogprobsBinaryRow,
    NextTokenLogprobsMatrixResponse,
    NextTokenLogprobsRequest,
    NextTokenLogprobsResponse,
    NextTokenLogprobsRow,
    NextTokenLogprobsSharedMemoryResponse,
    NextTokenLogprobsUsage,
)
from logprob_gateway_client.encoding import (
    ITEMSIZE,
    matrix_view,
    msgpack_bin_header,
    row_base64,
    row_views,
)

Parts = list[bytes | memoryview]

JSON_FLOAT_BYTES = 25  # "-1.2345678901234567e-05," : msgspec's longest float and its comma
ROW_OVERHEAD_BYTES = 64  # a row's object, index and separators


def answer_nbytes(
    count: int, vocab_size: int, body: NextTokenLogprobsRequest, binary: bool, shared: bool
) -> int:
    """An upper bound of the bytes the server holds for an answer of `count` rows: the float32 rows,
    and (unless they go into the client's shared memory) the body with any copy made to encode it."""
    values = count * vocab_size
    if shared:
        return values * ITEMSIZE["float32"]
    itemsize = ITEMSIZE[body.dtype]
    if binary:
        wire = 2 * itemsize  # rows converted to `dtype`, then the document
    elif body.encoding_format == "base64":
        wire = itemsize + math.ceil(itemsize * 4 / 3)
    else:
        wire = JSON_FLOAT_BYTES
    return values * (ITEMSIZE["float32"] + wire) + count * ROW_OVERHEAD_BYTES + 4096


def in_shared_memory(
    logprobs: np.ndarray,
    body: NextTokenLogprobsRequest,
    usage: NextTokenLogprobsUsage,
    binary: bool,
    destination: np.ndarray,
    written: bool,
) -> Parts:
    """The matrix copied into the client's segment (`destination`, uint8), unless the engine wrote
    it there itself; the body says where it lies."""
    if not written:
        copy_into(destination, np.frombuffer(matrix_view(logprobs, body.dtype), dtype=np.uint8))
    assert body.shared_memory is not None
    document = NextTokenLogprobsSharedMemoryResponse(
        model=body.model,
        vocab_size=logprobs.shape[1],
        rows=len(logprobs),
        dtype=body.dtype,
        usage=usage,
        offset=body.shared_memory.offset,
        nbytes=len(destination),
    )
    return [msgspec.msgpack.encode(document) if binary else msgspec.json.encode(document)]


def in_body(
    logprobs: np.ndarray, body: NextTokenLogprobsRequest, usage: NextTokenLogprobsUsage, binary: bool
) -> Parts:
    """The answer with its rows (`logprobs`, float32 [rows, vocab]) in the body, in the layout,
    encoding and dtype asked for."""
    if body.layout == "matrix":
        return _matrix(logprobs, body, usage, binary)
    vocab_size = logprobs.shape[1]
    if binary:
        data = [
            NextTokenLogprobsBinaryRow(index=i, logprobs=view)  # type: ignore[arg-type]
            for i, view in enumerate(row_views(logprobs, body.dtype))
        ]
        document = NextTokenLogprobsBinaryResponse(
            model=body.model, vocab_size=vocab_size, dtype=body.dtype, data=data, usage=usage
        )
        return [msgspec.msgpack.encode(document)]
    dtype = body.dtype if body.encoding_format == "base64" else "float32"
    response = NextTokenLogprobsResponse(
        model=body.model, vocab_size=vocab_size, dtype=dtype, data=[], usage=usage
    )
    # JSON has no -inf: it is sent as null (msgspec writes non-finite floats as null).
    items = (
        NextTokenLogprobsRow(
            index=i, logprobs=row_base64(r, body.dtype) if body.encoding_format == "base64" else r.tolist()
        )
        for i, r in enumerate(logprobs)
    )
    return _filled(msgspec.json.encode(response), b'"data":[]', items)


def _around(document: bytes, empty: bytes) -> tuple[bytes, bytes]:
    """The document before and after the inside of its one `empty` field ('"data":[]'), to send
    with the field's items in between."""
    at = document.index(empty) + len(empty) - 1
    return document[:at], document[at:]


def _filled(document: bytes, empty: bytes, items: Iterable[object]) -> Parts:
    """The document with its one empty array field `empty` holding `items`, each encoded alone."""
    head, tail = _around(document, empty)
    parts: Parts = [head]
    for i, item in enumerate(items):
        encoded = msgspec.json.encode(item)
        parts.append(b"," + encoded if i else encoded)
    parts.append(tail)
    return parts


def _matrix(
    logprobs: np.ndarray, body: NextTokenLogprobsRequest, usage: NextTokenLogprobsUsage, binary: bool
) -> Parts:
    fields = dict(model=body.model, vocab_size=logprobs.shape[1], rows=len(logprobs), usage=usage)
    if binary:
        # The document with an empty matrix ends with the empty `bin` (0xc4 0x00), as the matrix is
        # its last field: swap that for the real header, and the array's memory follows unjoined.
        empty = msgspec.msgpack.encode(
            NextTokenLogprobsBinaryMatrixResponse(**fields, dtype=body.dtype, logprobs=memoryview(b""))
        )
        matrix = matrix_view(logprobs, body.dtype)
        return [empty[:-2] + msgpack_bin_header(len(matrix)), matrix]
    if body.encoding_format == "base64":
        document = NextTokenLogprobsMatrixResponse(**fields, dtype=body.dtype, logprobs="")
        head, tail = _around(msgspec.json.encode(document), b'"logprobs":""')
        return [head, base64.b64encode(matrix_view(logprobs, body.dtype)), tail]
    document = NextTokenLogprobsMatrixResponse(**fields, dtype="float32", logprobs=[])
    return _filled(msgspec.json.encode(document), b'"logprobs":[]', (r.tolist() for r in logprobs))
