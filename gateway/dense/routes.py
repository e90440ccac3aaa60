"""POST /v1/next_token_logprobs: the full next-token distribution for batches of prefixes."""

from __future__ import annotations

from litestar import Request, Response, get, post

from gateway import requests, responses
from gateway.contract.operation import OPENAPI, Operation
from gateway.dense.service import DenseService
from gateway.schemas.logprobs import (
    DenseStats,
    EnginePassStats,
    NextTokenLogprobsBinaryMatrixResponse,
    NextTokenLogprobsBinaryResponse,
    NextTokenLogprobsMatrixResponse,
    NextTokenLogprobsRequest,
    NextTokenLogprobsResponse,
    NextTokenLogprobsSharedMemoryResponse,
)
from logprob_gateway_client.local_socket import HEADER as LOCAL_SOCKET_HEADER


def _dense(request: Request) -> DenseService:
    return request.app.state.dense


@post(
    "/v1/next_token_logprobs",
    status_code=200,
    summary="Dense next-token log-probabilities",
    description="For each input (a token-id list, or a string tokenized without special tokens unless "
    "`add_special_tokens`; or rows packed as `{ids, lengths}`: every row's ids one after another as "
    "little-endian int32, row i the next `lengths[i]` of them), the log_softmax of the model's logits after it, over the whole vocabulary "
    "(`vocab_size` = width of the logits). `encoding_format: float` gives JSON numbers (-inf as null); "
    "`base64` gives little-endian `dtype` bytes (bfloat16 = upper half of the float32). With "
    "`Accept: application/msgpack` the document is MessagePack with rows as raw bytes. `layout: matrix` "
    "returns one `[rows, vocab_size]` array instead of one object per input (in MessagePack a single "
    "`bin`, the last field, that a client reads without copying). A client on the gateway's host may "
    "name a sealed memfd of its own in `shared_memory`, with the key it keeps in the segment's last 16 "
    "bytes: the matrix is written there and the answer says where (`next_token_logprobs.shared_memory`); "
    "a segment the gateway cannot open, or whose key differs, is ignored and the matrix comes in the "
    "body. An answer written into shared memory names, in its `Logprob-Gateway-Socket` header, a Unix "
    "socket of the gateway's host where later calls may go without HTTP (docs/api.md). Request bodies "
    "may be MessagePack too (`Content-Type: application/msgpack`). Concurrent "
    "requests share the engine's forward passes; rows may come from the output cache (`usage.cache_hits`), "
    "bit-identical to computing them.",
    tags=["Dense logprobs"],
    opt={
        OPENAPI: Operation(
            request=NextTokenLogprobsRequest,
            content={
                "application/json": {
                    "oneOf": [
                        NextTokenLogprobsResponse,
                        NextTokenLogprobsMatrixResponse,
                        NextTokenLogprobsSharedMemoryResponse,
                    ]
                },
                "application/msgpack": {
                    "oneOf": [
                        NextTokenLogprobsBinaryResponse,
                        NextTokenLogprobsBinaryMatrixResponse,
                        NextTokenLogprobsSharedMemoryResponse,
                    ]
                },
            },
            example={
                "model": "smollm2-135m",
                "input": [[504, 3575, 282, 4649, 314]],
                "encoding_format": "base64",
            },
        )
    },
)
async def next_token_logprobs(request: Request) -> Response:
    body = await requests.decode_json(request, NextTokenLogprobsRequest)
    return await dense_response(request, body, requests.wants_msgpack(request))


async def dense_response(request: Request, body: NextTokenLogprobsRequest, binary: bool) -> Response:
    """The dense answer to `body` (MessagePack when `binary`), as this route and SGLang's
    `/generate` with `next_token_logprobs` give it."""
    served, adapter = requests.resolve_model(request, body.model)
    limits = requests.settings(request).limits
    answer = await _dense(request).serve(served, adapter, body, binary, limits, requests.Admission(request))
    media_type = requests.MSGPACK_TYPES[0] if binary else "application/json"
    headers = {"Server-Timing": answer.server_timing}
    local_socket = request.app.state.local_socket
    if answer.in_shared_memory and local_socket is not None and local_socket.path is not None:
        headers[LOCAL_SOCKET_HEADER] = local_socket.path  # this client's host: calls may skip HTTP
    return responses.PartsResponse(answer.parts, media_type=media_type, headers=headers)


@get(
    "/v1/models/{model:str}/stats",
    summary="Dense-row counters",
    description="Counters of a model's dense rows: the requests that asked its engine for rows, "
    "the engine calls they made (at most `max_batch_rows` distinct rows each), and, where the "
    "engine merges concurrent calls in a scheduler of its own (transformers, MLX), its shared passes.",
    tags=["Dense logprobs"],
    opt={OPENAPI: Operation(content={"application/json": DenseStats})},
)
async def dense_stats(request: Request, model: str) -> Response:
    served, _ = requests.resolve_model(request, model)
    s = _dense(request).calls(served).stats
    engine = served.require_engine().status().pass_stats
    passes = None
    if engine is not None:
        passes = EnginePassStats(
            passes=engine.passes, submissions=engine.submissions, rows=engine.rows, largest=engine.largest
        )
    return responses.json_response(
        DenseStats(
            model=served.name,
            requests=s.requests,
            rows=s.rows,
            engine_rows=s.engine_rows,
            engine_calls=s.calls,
            largest_call=s.largest_call,
            engine_passes=passes,
        )
    )
