"""The bytes of a dense answer: rows or one matrix, as JSON or MessagePack, or written into the
client's shared memory with a small document saying where.

Bodies are lists of buffers sent one after the other (gateway.http.PartsResponse): a MessagePack
matrix goes out as a header and the rows' own memory, never joined.
"""

from __future__ import annotations

import base64

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
from logprob_gateway_client.encoding import matrix_view, msgpack_bin_header, row_base64, row_views

Parts = list[bytes | memoryview]


def in_shared_memory(
    rows: np.ndarray,
    body: NextTokenLogprobsRequest,
    usage: NextTokenLogprobsUsage,
    binary: bool,
    destination: np.ndarray,
    written: bool,
) -> Parts:
    """The matrix copied into the client's segment (`destination`, uint8), unless the engine wrote
    it there itself; the body says where it lies."""
    if not written:
        copy_into(destination, np.frombuffer(matrix_view(rows, body.dtype), dtype=np.uint8))
    assert body.shared_memory is not None
    document = NextTokenLogprobsSharedMemoryResponse(
        model=body.model,
        vocab_size=rows.shape[1],
        rows=len(rows),
        dtype=body.dtype,
        usage=usage,
        offset=body.shared_memory.offset,
        nbytes=len(destination),
    )
    return [msgspec.msgpack.encode(document) if binary else msgspec.json.encode(document)]


def in_body(
    rows: np.ndarray, body: NextTokenLogprobsRequest, usage: NextTokenLogprobsUsage, binary: bool
) -> Parts:
    """The answer with its rows in the body, in the layout, encoding and dtype asked for."""
    if body.layout == "matrix":
        return _matrix(rows, body, usage, binary)
    vocab_size = rows.shape[1]
    if binary:
        data = [
            NextTokenLogprobsBinaryRow(index=i, logprobs=view)  # type: ignore[arg-type]
            for i, view in enumerate(row_views(rows, body.dtype))
        ]
        document = NextTokenLogprobsBinaryResponse(
            model=body.model, vocab_size=vocab_size, dtype=body.dtype, data=data, usage=usage
        )
        return [msgspec.msgpack.encode(document)]
    if body.encoding_format == "base64":
        rows_out = [
            NextTokenLogprobsRow(index=i, logprobs=row_base64(r, body.dtype)) for i, r in enumerate(rows)
        ]
    else:
        # JSON has no -inf: it is sent as null (msgspec writes non-finite floats as null).
        rows_out = [NextTokenLogprobsRow(index=i, logprobs=r.tolist()) for i, r in enumerate(rows)]
    response = NextTokenLogprobsResponse(
        model=body.model,
        vocab_size=vocab_size,
        dtype=body.dtype if body.encoding_format == "base64" else "float32",
        data=rows_out,
        usage=usage,
    )
    return [msgspec.json.encode(response)]


def _matrix(
    rows: np.ndarray, body: NextTokenLogprobsRequest, usage: NextTokenLogprobsUsage, binary: bool
) -> Parts:
    fields = dict(model=body.model, vocab_size=rows.shape[1], rows=len(rows), usage=usage)
    if binary:
        # The document with an empty matrix ends with the empty `bin` (0xc4 0x00), as the matrix is
        # its last field: swap that for the real header, and the array's memory follows unjoined.
        empty = msgspec.msgpack.encode(
            NextTokenLogprobsBinaryMatrixResponse(**fields, dtype=body.dtype, logprobs=memoryview(b""))
        )
        matrix = matrix_view(rows, body.dtype)
        return [empty[:-2] + msgpack_bin_header(len(matrix)), matrix]
    if body.encoding_format == "base64":
        document = NextTokenLogprobsMatrixResponse(
            **fields, dtype=body.dtype, logprobs=base64.b64encode(matrix_view(rows, body.dtype)).decode()
        )
    else:
        document = NextTokenLogprobsMatrixResponse(**fields, dtype="float32", logprobs=rows.tolist())
    return [msgspec.json.encode(document)]
