"""POST /v1/next_token_logprobs: the full next-token distribution for batches of prefixes."""

from __future__ import annotations

import asyncio
import base64
import time

import msgspec
import numpy as np
from litestar import Request, Response, get, post

from backends.base import RowsTarget
from gateway.dense import dense_rows
from gateway.errors import ContextLengthError, EngineError, GatewayError, InvalidRequestError
from gateway.http import (
    MSGPACK_TYPES,
    PartsResponse,
    charge_rows,
    decode_json,
    json_response,
    resolve_model,
    settings,
    wants_msgpack,
)
from gateway.parallel_copy import copy_into
from gateway.prompts import token_inputs
from gateway.schemas.logprobs import (
    BatchingStats,
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
from logprob_gateway_client.encoding import ITEMSIZE, matrix_view, msgpack_bin_header, row_base64, row_views


def _float_row(values: np.ndarray) -> list[float | None]:
    # JSON has no -inf: it is sent as null (msgspec writes non-finite floats as null).
    return values.tolist()


@post("/v1/next_token_logprobs", status_code=200, summary="Dense next-token log-probabilities")
async def next_token_logprobs(request: Request) -> Response:
    begun = time.perf_counter()
    body = await decode_json(request, NextTokenLogprobsRequest)
    served, adapter = resolve_model(request, body.model)
    engine = served.require_engine()
    inputs = token_inputs(
        served,
        body.input,
        add_special_tokens=body.add_special_tokens,
        max_items=settings(request).limits.max_rows,
        param="input",
    )
    charge_rows(request, len(inputs))
    longest = max(len(i.ids) for i in inputs)
    if longest > engine.max_model_len:
        raise ContextLengthError(
            f"an input has {longest} tokens; this model's maximum context length is {engine.max_model_len}",
            param="input",
        )
    # Checked before any row is computed: a segment too small is the client's error.
    destination = _shared_memory_target(request, body, len(inputs) * engine.vocab_size * ITEMSIZE[body.dtype])
    target = _rows_target(request, body, destination, engine.vocab_size)
    started = time.perf_counter()
    # Rows are cached once their response is encoded: storing them holds the interpreter lock,
    # which the threads writing the response need.
    encoded: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    try:
        try:
            rows, hits = await dense_rows(
                served, request.app.state.cache, [i.ids for i in inputs], adapter, encoded, target
            )
        except GatewayError:
            raise
        except Exception as exc:
            raise EngineError(f"the engine failed to compute the rows: {type(exc).__name__}: {exc}") from exc
        binary = wants_msgpack(request)
        tokens = sum(len(i.ids) for i in inputs)
        usage = NextTokenLogprobsUsage(prompt_tokens=tokens, total_tokens=tokens, cache_hits=hits)
        computed = time.perf_counter()
        if target is not None and target.written:  # a few hundred bytes to say so: no thread hop
            assert destination is not None
            parts = _deliver(rows, body, engine.vocab_size, usage, binary, destination, True)
        # Copying or encoding megabytes of floats would stall the event loop: a worker thread does.
        elif destination is not None:
            parts = await asyncio.to_thread(
                _deliver, rows, body, engine.vocab_size, usage, binary, destination, False
            )
        else:
            parts = await asyncio.to_thread(_encode, rows, body, engine.vocab_size, usage, binary)
    finally:
        encoded.set_result(None)
    # Where the server's time went (ms), for clients and benches: the request read and checked,
    # rows (cache + queue + engine), encode (or the copy into shared memory).
    timing = ", ".join(
        f"{name};dur={seconds * 1e3:.2f}"
        for name, seconds in (
            ("parse", started - begun),
            ("rows", computed - started),
            ("encode", time.perf_counter() - computed),
        )
    )
    encoding = "shared_memory" if destination is not None else "msgpack" if binary else body.encoding_format
    served.metrics.dense_rows.labels(served.name, adapter or "", encoding).inc(len(inputs))
    served.metrics.dense_response_bytes.labels(served.name, encoding).inc(sum(len(p) for p in parts))
    return PartsResponse(
        parts,
        media_type=MSGPACK_TYPES[0] if binary else "application/json",
        headers={"Server-Timing": timing},
    )


def _shared_memory_target(request: Request, body: NextTokenLogprobsRequest, nbytes: int) -> np.ndarray | None:
    """Where in the client's segment the matrix goes; None: in the body (no segment named, the
    feature off, a segment this host cannot see, or a key that is not the segment's)."""
    if body.shared_memory is None:
        return None
    if body.layout != "matrix":
        raise InvalidRequestError('shared_memory needs layout: "matrix"', param="shared_memory")
    writer = request.app.state.shared_memory
    return None if writer is None else writer.target(body.shared_memory, nbytes)


def _rows_target(
    request: Request, body: NextTokenLogprobsRequest, destination: np.ndarray | None, vocab_size: int
) -> RowsTarget | None:
    """The client's segment as float32 rows, for an engine to write into from its GPU: when the
    gateway's mapping of it is registered for that and the answer is float32 (as computed). The
    engine keeps a copy of its own only for the output cache."""
    if destination is None or body.dtype != "float32" or body.shared_memory is None:
        return None
    if destination.ctypes.data % ITEMSIZE["float32"]:  # an offset that splits a float
        return None
    if not request.app.state.shared_memory.pinned(body.shared_memory):
        return None
    rows = destination.view(np.float32).reshape(-1, vocab_size)
    return RowsTarget(rows, keep=request.app.state.cache is not None)


def _deliver(
    rows: np.ndarray,
    body: NextTokenLogprobsRequest,
    vocab_size: int,
    usage: NextTokenLogprobsUsage,
    binary: bool,
    destination: np.ndarray,
    written: bool,
) -> list[bytes | memoryview]:
    """The matrix copied into the client's segment, unless the engine wrote it there itself; the
    body says where it lies."""
    if not written:
        copy_into(destination, np.frombuffer(matrix_view(rows, body.dtype), dtype=np.uint8))
    assert body.shared_memory is not None
    document = NextTokenLogprobsSharedMemoryResponse(
        model=body.model,
        vocab_size=vocab_size,
        rows=len(rows),
        dtype=body.dtype,
        usage=usage,
        offset=body.shared_memory.offset,
        nbytes=len(destination),
    )
    return [msgspec.msgpack.encode(document) if binary else msgspec.json.encode(document)]


def _encode(
    rows: np.ndarray,
    body: NextTokenLogprobsRequest,
    vocab_size: int,
    usage: NextTokenLogprobsUsage,
    binary: bool,
) -> list[bytes | memoryview]:
    """The response body, as buffers to send one after the other."""
    if body.layout == "matrix":
        fields = dict(model=body.model, vocab_size=vocab_size, rows=len(rows), usage=usage)
        return _encode_matrix(rows, body, binary, fields)
    if binary:
        return [
            msgspec.msgpack.encode(
                NextTokenLogprobsBinaryResponse(
                    model=body.model,
                    vocab_size=vocab_size,
                    dtype=body.dtype,
                    data=[
                        NextTokenLogprobsBinaryRow(index=i, logprobs=view)  # type: ignore[arg-type]
                        for i, view in enumerate(row_views(rows, body.dtype))
                    ],
                    usage=usage,
                )
            )
        ]
    if body.encoding_format == "base64":
        data = [NextTokenLogprobsRow(index=i, logprobs=row_base64(r, body.dtype)) for i, r in enumerate(rows)]
    else:
        data = [NextTokenLogprobsRow(index=i, logprobs=_float_row(r)) for i, r in enumerate(rows)]
    response = NextTokenLogprobsResponse(
        model=body.model,
        vocab_size=vocab_size,
        dtype=body.dtype if body.encoding_format == "base64" else "float32",
        data=data,
        usage=usage,
    )
    return [msgspec.json.encode(response)]


def _encode_matrix(
    rows: np.ndarray, body: NextTokenLogprobsRequest, binary: bool, fields: dict
) -> list[bytes | memoryview]:
    if binary:
        # The document with an empty matrix ends with the empty `bin` (0xc4 0x00), as the matrix is
        # its last field: swap that for the real header, and the array's memory follows unjoined.
        empty = msgspec.msgpack.encode(
            NextTokenLogprobsBinaryMatrixResponse(**fields, dtype=body.dtype, logprobs=b"")
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


@get("/v1/models/{model:str}/stats", summary="Dense-row batching counters of a model")
async def batching_stats(request: Request, model: str) -> Response:
    served, _ = resolve_model(request, model)
    served.require_engine()
    assert served.batcher is not None
    s = served.batcher.stats
    return json_response(
        BatchingStats(
            model=served.name,
            requests=s.requests,
            rows=s.rows,
            engine_rows=s.engine_rows,
            batches=s.batches,
            largest_batch=s.largest_batch,
        )
    )
