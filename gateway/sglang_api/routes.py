"""SGLang's native API (0.5.17), for SGLang's own clients: the frontend language's
`RuntimeEndpoint` and TorchRL's `AsyncSGLang` with an external server. Semantics: gateway/sglang_api/items.py and generate.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

from litestar import Request, Response, get, route

from backends.types import SamplingParams
from gateway.contract.operation import EMPTY_TEXT, OPENAPI, SSE, TEXT, Operation, Reply
from gateway.dense.routes import dense_response
from gateway.dense.service import DenseService
from gateway.errors import InvalidRequestError
from gateway.generation import choices as gen
from gateway.models.served import ServedModel
from gateway.requests import (
    decode_json,
    read_non_dense_body,
    registry,
    reserve_stream,
    resolve_model,
    settings,
    wants_msgpack,
    with_lora_path,
)
from gateway.responses import json_response, sse_event, sse_response
from gateway.schemas.sglang import GenerateRequest, GenerateResponse, ModelInfo, ServerInfo
from gateway.sglang_api import generate as native
from gateway.sglang_api.dense_rows import dense_request
from gateway.sglang_api.items import plan
from gateway.weights.routes import require_admin

SGLANG_VERSION = "0.5.17"
HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
_STARTED = time.time()
# what SGLang's model gateway (SMG) puts in `model` of a /generate body that names none
ROUTER_UNNAMED_MODEL = "unknown"


def _model(request: Request, name: str | None) -> tuple[ServedModel, str | None]:
    """A request's model (`base` or `base:adapter`); without one, the first configured model."""
    if name is None or name == ROUTER_UNNAMED_MODEL:
        name = next(iter(registry(request).models))
    return resolve_model(request, name)


def _served_for(request: Request, body: GenerateRequest):  # noqa: ANN202 (a closure for plan())
    named = _model(request, body.model)

    def served_for(lora_path: str | None) -> tuple[ServedModel, str | None]:
        return with_lora_path(request, named, body.model or ROUTER_UNNAMED_MODEL, lora_path)

    return served_for


@route(
    "/generate",
    http_method=["POST", "PUT"],
    status_code=200,
    summary="Generate (SGLang's native API)",
    description="SGLang 0.5.17's `/generate` for SGLang's own clients (its frontend language, TorchRL): "
    "`text` or `input_ids`, one prompt or a batch, `sampling_params`, logprob triples; one object for one "
    "prompt, an array for a batch or `n > 1`; with `stream: true`, server-sent events of cumulative objects. "
    "Lists in per-prompt fields (`sampling_params`, `rid`, `return_logprob`, `logprob_start_len`, "
    "`top_logprobs_num`, `lora_path`) have one value per prompt; `logprob_start_len` is at most the "
    "prompt's length. See docs/sglang-clients.md.",
    tags=["SGLang"],
    opt={
        OPENAPI: Operation(
            request=GenerateRequest,
            content={
                "application/json": {
                    "anyOf": [GenerateResponse, {"type": "array", "items": GenerateResponse}]
                },
                "text/event-stream": SSE,
            },
            example={
                "text": "The capital of France is",
                "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            },
        )
    },
)
async def sglang_generate(request: Request) -> Response:
    body = await decode_json(request, GenerateRequest)
    if body.next_token_logprobs is not None:
        return await _dense_rows(request, body)
    items, as_list = await plan(body, _served_for(request, body), settings(request).limits)
    dense: DenseService = request.app.state.dense  # rows for token_ids_logprob and rescoring
    runs = [native.ItemRun(item, dense) for item in items]
    if body.stream:
        reserve_stream(request)
        return sse_response(_stream(runs, as_list))
    results = await asyncio.gather(*(_last(run) for run in runs))
    _count(runs)
    return Response(content=native.encode(results if as_list else results[0]), media_type="application/json")


async def _dense_rows(request: Request, body: GenerateRequest) -> Response:
    """The prompts' dense rows (gateway/sglang_api/dense_rows.py)."""
    if isinstance(body.lora_path, list) and len(set(body.lora_path)) > 1:
        raise InvalidRequestError(
            "next_token_logprobs takes one lora_path for every prompt", param="lora_path"
        )
    lora_path = body.lora_path[0] if isinstance(body.lora_path, list) else body.lora_path
    served, adapter = _served_for(request, body)(lora_path)
    model = served.name if adapter is None else f"{served.name}:{adapter}"
    binary = body.next_token_logprobs.msgpack or wants_msgpack(request)  # type: ignore[union-attr]
    return await dense_response(request, dense_request(body, model), binary)


async def _last(run: native.ItemRun) -> GenerateResponse:
    async for result in run.results(final_only=True):
        return result
    raise AssertionError("every run yields its final result")


async def _stream(runs: list[native.ItemRun], as_list: bool) -> AsyncIterator[bytes]:
    async for index, result in gen.merge([run.results() for run in runs]):
        if as_list:
            result.index = index
        yield sse_event(result)
    _count(runs)


def _count(runs: list[native.ItemRun]) -> None:
    for run in runs:
        served, adapter = run.item.served, run.item.adapter
        labels = (served.name, adapter or "", "generate")
        served.metrics.prompt_tokens.labels(*labels).inc(len(run.item.ids))
        served.metrics.generation_tokens.labels(*labels).inc(run.completion_tokens)


def _config(served: ServedModel) -> dict:
    try:
        return json.loads((Path(served.require_engine().info.path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


@get(
    ["/model_info", "/get_model_info"],
    summary="The model, as SGLang describes it",
    description="`model_path` (the weights' directory), `tokenizer_path`, `is_generation`, ... of the model "
    "named by the `model` query parameter (default: the first configured model).",
    tags=["SGLang"],
    opt={OPENAPI: Operation(content={"application/json": ModelInfo})},
)
async def sglang_model_info(request: Request, model: str | None = None) -> Response:
    served, _ = _model(request, model)
    path = served.require_engine().info.path
    config = _config(served)
    return json_response(
        ModelInfo(
            model_path=path,
            tokenizer_path=path,
            weight_version=served.weight_version,
            model_type=config.get("model_type"),
            architectures=config.get("architectures"),
            served_model_name=served.name,
        )
    )


@get(
    ["/server_info", "/get_server_info"],
    summary="The server, as SGLang describes it",
    description="`tp_size` and `dp_size` (1), the context length, and the SGLang API version served.",
    tags=["SGLang"],
    opt={OPENAPI: Operation(content={"application/json": ServerInfo})},
)
async def sglang_server_info(request: Request, model: str | None = None) -> Response:
    served, _ = _model(request, model)
    engine = served.require_engine()
    return json_response(
        ServerInfo(
            model_path=engine.info.path,
            tokenizer_path=engine.info.path,
            weight_version=served.weight_version,
            served_model_name=served.name,
            context_length=engine.info.max_model_len,
            max_req_input_len=engine.info.max_model_len - 1,
            status="ready" if registry(request).healthy else "loading",
            startup_time=_STARTED,
            version=SGLANG_VERSION,
            backend=served.settings.backend,
        )
    )


@get(
    "/health_generate",
    summary="Generation health",
    description="200 with an empty body once every model generates a token within 20 s; 503 with an empty "
    "body otherwise.",
    tags=["SGLang"],
    opt={
        OPENAPI: Operation(
            content={"text/plain": EMPTY_TEXT},
            errors=("503",),
            # SGLang's: an empty body either way
            replies={"503": Reply("Loading, or a model failed to generate.", {"text/plain": EMPTY_TEXT})},
        )
    },
)
async def health_generate(request: Request) -> Response:
    models = registry(request)
    if not models.healthy:
        return Response(content=b"", status_code=503, media_type="text/plain")
    try:
        async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
            for served in models.models.values():
                engine = served.require_engine()
                async for _ in engine.generate([0], SamplingParams(max_tokens=1, temperature=0.0)):
                    pass
    except Exception:  # a failing or hanging engine is what this endpoint reports
        return Response(content=b"", status_code=503, media_type="text/plain")
    return Response(content=b"", status_code=200, media_type="text/plain")


@route(
    "/flush_cache",
    http_method=["GET", "POST"],
    status_code=200,
    summary="Empty the caches",
    description="Every model's prefix keys/values in its engine and its rows in the output cache. Needs the "
    "admin key unless `open_flush_cache` (or `trusted_weight_sync`) is set.",
    tags=["SGLang"],
    opt={OPENAPI: Operation(content={"text/plain": TEXT}, errors=("403", "413"))},
)
async def flush_cache(request: Request) -> Response:
    """Every model's prefix K/V in its engine, and its rows in the output cache (by a new cache
    scope: in Redis the old entries stay until they expire, unreachable). The admin key's: one key
    would otherwise empty every key's shared cache; `open_flush_cache` opens it, and so does
    `trusted_weight_sync` (TorchRL flushes after each update, without a key). A body is read (413
    beyond max_non_dense_body_bytes) and ignored, as SGLang ignores it."""
    config = settings(request)
    if not (config.open_flush_cache or config.trusted_weight_sync):
        require_admin(request)
    await read_non_dense_body(request)
    for served in registry(request).models.values():
        if served.engine is not None and served.engine.prefix_cache is not None:
            await served.engine.prefix_cache.flush()
        served.cache_epoch += 1
    return Response(content=FLUSHED, media_type="text/plain")
