"""POST /v1/next_token_logprobs: the full next-token distribution for batches of prefixes."""

from __future__ import annotations

import asyncio
from functools import partial

from litestar import Request, Response, get, post

from gateway import requests, responses
from gateway.dense.delivery import answer_nbytes
from gateway.dense.service import DenseService
from gateway.prompts import has_text, token_inputs
from gateway.schemas.logprobs import BatchingStats, NextTokenLogprobsRequest


def _dense(request: Request) -> DenseService:
    return request.app.state.dense


@post("/v1/next_token_logprobs", status_code=200, summary="Dense next-token log-probabilities")
async def next_token_logprobs(request: Request) -> Response:
    body = await requests.decode_json(request, NextTokenLogprobsRequest)
    served, adapter = requests.resolve_model(request, body.model)
    limits = requests.settings(request).limits
    prepare = partial(
        token_inputs,
        served,
        body.input,
        add_special_tokens=body.add_special_tokens,
        limits=limits,
        max_items=limits.max_rows,
        param="input",
    )
    # Token-id rows are checked in one C pass; only text is worth a thread.
    inputs = await asyncio.to_thread(prepare) if has_text(body.input) else prepare()
    requests.charge_rows(request, len(inputs))
    binary = requests.wants_msgpack(request)
    dense = _dense(request)
    # Before any row is computed: its size is known, and a server full of unread answers says so.
    shared = body.shared_memory is not None and dense.shared_memory is not None
    vocab_size = served.require_engine().vocab_size
    requests.reserve_answer_bytes(request, answer_nbytes(len(inputs), vocab_size, body, binary, shared))
    answer = await dense.answer(served, adapter, [i.ids for i in inputs], body, binary)
    media_type = requests.MSGPACK_TYPES[0] if binary else "application/json"
    return responses.PartsResponse(
        answer.parts, media_type=media_type, headers={"Server-Timing": answer.server_timing}
    )


@get("/v1/models/{model:str}/stats", summary="Dense-row batching counters of a model")
async def batching_stats(request: Request, model: str) -> Response:
    served, _ = requests.resolve_model(request, model)
    s = _dense(request).batcher(served).stats
    return responses.json_response(
        BatchingStats(
            model=served.name,
            requests=s.requests,
            rows=s.rows,
            engine_rows=s.engine_rows,
            batches=s.batches,
            largest_batch=s.largest_batch,
        )
    )
