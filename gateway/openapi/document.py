"""The OpenAPI 3.1 document, built from the same msgspec types that decode requests.

Routes decode their bodies themselves (JSON or MessagePack), so the document is assembled here
from one table of operations rather than inferred from handler signatures. Limits from the
settings (n, logprobs, max_tokens, rows, ...) appear as schema maxima, and the routes' own checks
(nothing empty, best_of equal to n, ...) as constraints, so the document describes exactly what the
running server accepts. Links say which response values other operations take.
"""

from __future__ import annotations

import copy
from typing import Any

import msgspec

from gateway.errors import ErrorResponse
from gateway.guard import DURING_SHUTDOWN, open_paths
from gateway.openapi.operation import REF, Operation, schema_ref
from gateway.openapi.vocabulary import bound_by_vocabulary
from gateway.openapi.weight_sync import RESPONSE_TYPES as WEIGHT_SYNC_RESPONSES
from gateway.openapi.weight_sync import WEIGHT_SYNC_OPERATIONS
from gateway.schemas.chat import ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse
from gateway.schemas.completions import CompletionRequest, CompletionResponse
from gateway.schemas.logprobs import (
    BatchingStats,
    DetokenizeRequest,
    DetokenizeResponse,
    NextTokenLogprobsBinaryMatrixResponse,
    NextTokenLogprobsBinaryResponse,
    NextTokenLogprobsMatrixResponse,
    NextTokenLogprobsRequest,
    NextTokenLogprobsResponse,
    NextTokenLogprobsSharedMemoryResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerFiles,
    Vocabulary,
    VocabularyBinary,
)
from gateway.schemas.models import (
    AdapterStatus,
    Health,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoraAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
)
from gateway.schemas.sglang import GenerateRequest, GenerateResponse, ModelInfo, ServerInfo
from gateway.settings import Settings

MSGPACK = "application/msgpack"
ERRORS = {
    "400": "Invalid request: a field is missing, of the wrong type or out of range, or the prompt is too long.",
    "401": "Missing or wrong API key (when keys are configured), or admin key on admin endpoints.",
    "403": "Admin endpoints disabled, or a path outside the adapters root.",
    "404": "Unknown model or adapter, or unknown path.",
    "405": "Method not allowed on this path.",
    "413": "Request body too large.",
    "415": "A body that is neither JSON nor MessagePack (by its Content-Type; none is read as JSON).",
    "429": "A per-key limit (requests in flight, rows per minute) or the server's stream limit; see Retry-After.",
    "500": "The engine failed; the service keeps serving.",
    "503": "The model is still loading, or failed to load; or the server is shutting down (see Retry-After).",
    "501": "The engine cannot do this (a restart or another backend can): new weights without a restart, "
    "or over a collective.",
}


def _ref(t: type) -> dict[str, Any]:
    return schema_ref(t)


MODEL_PARAM = {
    "name": "model",
    "in": "path",
    "required": True,
    "description": "A served model name, or `base:adapter`.",
    "schema": {"type": "string"},
}

SSE = {  # OpenAPI 3.1: the schema of one event
    "type": "object",
    "description": "Server-sent events: `data: <chunk JSON>` lines, then `data: [DONE]`. An error while "
    'streaming is sent as `data: {"error": {...}}` before `[DONE]`.',
    "properties": {"data": {"type": "string", "description": "A chunk's JSON, or `[DONE]`."}},
    "required": ["data"],
}

OPERATIONS = [
    Operation(
        "post",
        "/v1/completions",
        "Create a completion",
        "OpenAI's (legacy) completions. `prompt` is a string, a list of strings, a list of token ids, or a "
        "list of token-id lists. `echo` + `logprobs` + `max_tokens: 0` scores the prompt (the first token has "
        "no score). With `stream: true` the response is server-sent events of `CompletionResponse` chunks.",
        CompletionRequest,
        {"application/json": _ref(CompletionResponse), "text/event-stream": SSE},
        example={
            "model": "smollm2-135m",
            "prompt": "The capital of France is",
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": 2,
        },
        tags=("OpenAI",),
    ),
    Operation(
        "post",
        "/v1/chat/completions",
        "Create a chat completion",
        "OpenAI's chat completions through the model's chat template; with `stream: true`, server-sent events "
        "of `ChatCompletionChunk`.",
        ChatCompletionRequest,
        {"application/json": _ref(ChatCompletionResponse), "text/event-stream": SSE},
        example={"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16},
        tags=("OpenAI",),
    ),
    Operation(
        "post",
        "/v1/next_token_logprobs",
        "Dense next-token log-probabilities",
        "For each input (a token-id list, or a string tokenized without special tokens unless "
        "`add_special_tokens`), the log_softmax of the model's logits after it, over the whole vocabulary "
        "(`vocab_size` = width of the logits). `encoding_format: float` gives JSON numbers (-inf as null); "
        "`base64` gives little-endian `dtype` bytes (bfloat16 = upper half of the float32). With "
        "`Accept: application/msgpack` the document is MessagePack with rows as raw bytes. `layout: matrix` "
        "returns one `[rows, vocab_size]` array instead of one object per input (in MessagePack a single "
        "`bin`, the last field, that a client reads without copying). A client on the gateway's host may "
        "name a sealed memfd of its own in `shared_memory`, with the key it keeps in the segment's last 16 "
        "bytes: the matrix is written there and the answer says where (`next_token_logprobs.shared_memory`); "
        "a segment the gateway cannot open, or whose key differs, is ignored and the matrix comes in the "
        "body. Request bodies may "
        "be MessagePack too (`Content-Type: application/msgpack`). Concurrent requests share engine batches; "
        "rows may come from the output cache (`usage.cache_hits`), bit-identical to computing them.",
        NextTokenLogprobsRequest,
        {
            "application/json": {
                "oneOf": [
                    _ref(NextTokenLogprobsResponse),
                    _ref(NextTokenLogprobsMatrixResponse),
                    _ref(NextTokenLogprobsSharedMemoryResponse),
                ]
            },
            MSGPACK: {
                "oneOf": [
                    _ref(NextTokenLogprobsBinaryResponse),
                    _ref(NextTokenLogprobsBinaryMatrixResponse),
                    _ref(NextTokenLogprobsSharedMemoryResponse),
                ]
            },
        },
        example={
            "model": "smollm2-135m",
            "input": [[504, 3575, 282, 4649, 314]],
            "encoding_format": "base64",
        },
        tags=("Dense logprobs",),
    ),
    Operation(
        "get",
        "/v1/models",
        "List models",
        "Served base models and their adapters (`base:adapter`).",
        responses={"application/json": _ref(ModelList)},
        errors=("500",),
        tags=("OpenAI",),
    ),
    Operation(
        "get",
        "/v1/models/{model}",
        "Describe a model",
        "One served model or adapter.",
        responses={"application/json": _ref(ModelCard)},
        errors=("404", "500"),
        tags=("OpenAI",),
    ),
    Operation(
        "get",
        "/v1/models/{model}/vocabulary",
        "Token bytes",
        "Every token id's exact bytes (base64 in JSON, raw bytes in MessagePack), for byte-level constrained "
        "decoding. An adapter name resolves to its base.",
        responses={"application/json": _ref(Vocabulary), MSGPACK: _ref(VocabularyBinary)},
        tags=("Dense logprobs",),
    ),
    Operation(
        "get",
        "/v1/models/{model}/tokenizer",
        "Tokenizer files",
        "The tokenizer's files (tokenizer.json, config, chat template) to rebuild it offline.",
        responses={"application/json": _ref(TokenizerFiles)},
        tags=("Dense logprobs",),
    ),
    Operation(
        "get",
        "/v1/models/{model}/stats",
        "Batching counters",
        "Counters of the dense-row batcher of a model.",
        responses={"application/json": _ref(BatchingStats)},
        tags=("Dense logprobs",),
    ),
    Operation(
        "post",
        "/v1/tokenize",
        "Tokenize",
        "vLLM's shape: `prompt` or chat `messages` to token ids.",
        TokenizeRequest,
        {"application/json": _ref(TokenizeResponse)},
        example={"model": "smollm2-135m", "prompt": "Hello world"},
        tags=("Tokenizer",),
    ),
    Operation(
        "post",
        "/tokenize",
        "Tokenize (vLLM path)",
        "Same as `/v1/tokenize`.",
        TokenizeRequest,
        {"application/json": _ref(TokenizeResponse)},
        tags=("Tokenizer",),
    ),
    Operation(
        "post",
        "/v1/detokenize",
        "Detokenize",
        "vLLM's shape: token ids to text.",
        DetokenizeRequest,
        {"application/json": _ref(DetokenizeResponse)},
        example={"model": "smollm2-135m", "tokens": [504, 3575]},
        tags=("Tokenizer",),
    ),
    Operation(
        "post",
        "/detokenize",
        "Detokenize (vLLM path)",
        "Same as `/v1/detokenize`.",
        DetokenizeRequest,
        {"application/json": _ref(DetokenizeResponse)},
        tags=("Tokenizer",),
    ),
    Operation(
        "post",
        "/v1/load_lora_adapter",
        "Load a LoRA adapter (admin)",
        "Needs `Authorization: Bearer <admin key>`. `lora_path` must lie inside the model's adapters root; the "
        "adapter must be a PEFT LoRA adapter with safetensors weights and a rank within the limit.",
        LoadLoraAdapterRequest,
        {"application/json": _ref(AdapterStatus)},
        errors=("400", "401", "403", "404", "500", "503"),
        tags=("Admin",),
    ),
    Operation(
        "post",
        "/v1/unload_lora_adapter",
        "Unload a LoRA adapter (admin)",
        "Needs `Authorization: Bearer <admin key>`.",
        UnloadLoraAdapterRequest,
        {"application/json": _ref(AdapterStatus)},
        errors=("400", "401", "403", "404", "500", "503"),
        tags=("Admin",),
    ),
    Operation(
        "post",
        "/update_weights_from_disk",
        "Load new weights in place (admin; SGLang's)",
        "Needs `Authorization: Bearer <admin key>`. New weights of the same architecture from a Hugging Face "
        "directory of safetensors weights, without a restart: requests reading the old weights finish on "
        "them first, and the model's output-cache keys change with the weights. Answers SGLang's "
        "`{success, message}`; a failure (400 weights that do not fit, 501 an engine that cannot) adds the "
        "error object. See docs/sglang-clients.md.",
        UpdateWeightsFromDiskRequest,
        {"application/json": _ref(UpdateWeightsFromDiskResponse)},
        errors=("400", "401", "403", "404", "501", "503"),
        tags=("Admin",),
    ),
    Operation(
        "get",
        "/health",
        "Readiness",
        "200 when every model (and its configured adapters) is loaded and "
        "healthy; 503 with the same body otherwise.",
        responses={"application/json": _ref(Health)},
        errors=("503",),
        tags=("Operations",),
    ),
    *(
        Operation(
            method,
            "/generate",
            "Generate (SGLang's native API)",
            "SGLang 0.5.17's `/generate` for SGLang's own clients (its frontend language, TorchRL): `text` or "
            "`input_ids`, one prompt or a batch, `sampling_params`, logprob triples; one object for one prompt, "
            "an array for a batch or `n > 1`; with `stream: true`, server-sent events of cumulative objects. "
            "Lists in per-prompt fields (`sampling_params`, `rid`, `return_logprob`, `logprob_start_len`, "
            "`top_logprobs_num`, `lora_path`) have one value per prompt; `logprob_start_len` is at most the "
            "prompt's length. See docs/sglang-clients.md.",
            GenerateRequest,
            {
                "application/json": {
                    "anyOf": [_ref(GenerateResponse), {"type": "array", "items": _ref(GenerateResponse)}]
                },
                "text/event-stream": SSE,
            },
            example={
                "text": "The capital of France is",
                "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            },
            tags=("SGLang",),
        )
        for method in ("post", "put")
    ),
    *(
        Operation(
            "get",
            path,
            "The model, as SGLang describes it",
            "`model_path` (the weights' directory), `tokenizer_path`, `is_generation`, ... of the model named by "
            "the `model` query parameter (default: the first configured model).",
            responses={"application/json": _ref(ModelInfo)},
            tags=("SGLang",),
        )
        for path in ("/model_info", "/get_model_info")
    ),
    *(
        Operation(
            "get",
            path,
            "The server, as SGLang describes it",
            "`tp_size` and `dp_size` (1), the context length, and the SGLang API version served.",
            responses={"application/json": _ref(ServerInfo)},
            tags=("SGLang",),
        )
        for path in ("/server_info", "/get_server_info")
    ),
    Operation(
        "get",
        "/health_generate",
        "Generation health",
        "200 with an empty body once every model generates a token within 20 s; 503 with an empty body otherwise.",
        responses={"text/plain": {"type": "string", "maxLength": 0}},
        errors=("503",),
        tags=("SGLang",),
    ),
    *(
        Operation(
            method,
            "/flush_cache",
            "Empty the caches",
            "Every model's prefix keys/values in its engine and its rows in the output cache. Needs the "
            "admin key unless `open_flush_cache` (or `trusted_weight_sync`) is set.",
            responses={"text/plain": {"type": "string"}},
            errors=("403", "413"),
            tags=("SGLang",),
        )
        for method in ("post", "get")
    ),
    *WEIGHT_SYNC_OPERATIONS,
    Operation(
        "get",
        "/metrics",
        "Prometheus metrics",
        "Prometheus text exposition format.",
        responses={"text/plain": {"type": "string"}},
        errors=(),
        tags=("Operations",),
    ),
    Operation(
        "get",
        "/openapi.json",
        "This document",
        "The OpenAPI document of the running server.",
        responses={"application/json": {"type": "object"}},
        errors=(),
        tags=("Operations",),
    ),
]

_TYPES = [t for op in OPERATIONS for t in (op.request,) if t is not None] + [
    ErrorResponse,
    CompletionResponse,
    ChatCompletionResponse,
    ChatCompletionChunk,
    NextTokenLogprobsResponse,
    NextTokenLogprobsBinaryResponse,
    NextTokenLogprobsMatrixResponse,
    NextTokenLogprobsBinaryMatrixResponse,
    NextTokenLogprobsSharedMemoryResponse,
    ModelList,
    ModelCard,
    UpdateWeightsFromDiskResponse,
    Vocabulary,
    VocabularyBinary,
    TokenizerFiles,
    BatchingStats,
    TokenizeResponse,
    DetokenizeResponse,
    AdapterStatus,
    Health,
    GenerateResponse,
    ModelInfo,
    ServerInfo,
    *WEIGHT_SYNC_RESPONSES,
]


def _apply_limits(schemas: dict[str, Any], settings: Settings) -> None:
    """Write the configured limits into the schemas as maxima."""
    limits = settings.limits

    def cap(schema: str, prop: str, maximum: int) -> None:
        target = schemas[schema]["properties"][prop]
        options = target.get("anyOf", [target])
        for option in options:
            if option.get("type") == "integer":
                option["maximum"] = maximum
            if option.get("type") == "array":
                option["maxItems"] = maximum
        if isinstance(target.get("default"), int) and target["default"] > maximum:
            # the route applies the default as if sent, and refuses it: the field must be given
            schemas[schema]["properties"][prop] = next(o for o in options if o.get("type") == "integer")
            schemas[schema]["required"].append(prop)

    cap("CompletionRequest", "n", limits.max_n)
    cap("ChatCompletionRequest", "n", limits.max_n)
    cap("CompletionRequest", "logprobs", limits.max_top_logprobs)
    cap("ChatCompletionRequest", "top_logprobs", limits.max_top_logprobs)
    cap("CompletionRequest", "max_tokens", limits.max_tokens)
    cap("ChatCompletionRequest", "max_tokens", limits.max_tokens)
    cap("ChatCompletionRequest", "max_completion_tokens", limits.max_tokens)


def _text() -> dict[str, Any]:
    return {"type": "string", "minLength": 1}


def _token_ids() -> dict[str, Any]:
    return {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}


def _inputs(max_items: int) -> dict[str, Any]:
    """OpenAI's four input forms as gateway/prompts.py takes them: one kind per list, nothing empty;
    a token-id list is one input, the limit counts the strings or lists of a list."""
    return {
        "anyOf": [
            _text(),
            {"type": "array", "items": _text(), "minItems": 1, "maxItems": max_items},
            _token_ids(),
            {"type": "array", "items": _token_ids(), "minItems": 1, "maxItems": max_items},
        ]
    }


def _null_or(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}], "default": None}


def _apply_route_checks(schemas: dict[str, Any], settings: Settings) -> None:
    """Write what the routes check beyond the types (gateway/prompts.py, gateway/generation.py and
    the routes themselves) into the schemas, so that a request the document allows is served. Only
    what each model decides stays out: prompts within its context (GET /v1/models/{model}), texts its
    tokenizer has a token for (its vocabulary); token ids below its vocab_size are stated by the
    running server (gateway/openapi_vocabulary.py)."""
    limits = settings.limits
    completion, chat = schemas["CompletionRequest"], schemas["ChatCompletionRequest"]
    completion["properties"]["prompt"] = _inputs(limits.max_prompts)
    schemas["NextTokenLogprobsRequest"]["properties"]["input"] = _inputs(limits.max_rows)
    for request in (completion, chat):
        stop = _null_or(_text())
        stop["anyOf"].insert(1, {"type": "array", "items": _text(), "maxItems": limits.max_stop})
        request["properties"]["stop"] = stop
    for request in (completion, chat, schemas["SglangSamplingParams"]):
        # keys in ASCII digits: a token id, below the model's vocab_size
        bias = {
            "type": "object",
            "propertyNames": {"type": "string", "pattern": "^[0-9]+$", "maxLength": 20},
            "additionalProperties": {"type": "number", "minimum": -100.0, "maximum": 100.0},
        }
        request["properties"]["logit_bias"] = _null_or(bias)
    chat["properties"]["messages"]["minItems"] = 1
    schemas["TokenizeRequest"]["properties"]["messages"]["anyOf"][0]["minItems"] = 1
    completion["properties"]["suffix"] = {
        **_null_or({"type": "string", "maxLength": 0}),
        "description": "Not supported: empty or null only.",
    }
    completion["properties"]["best_of"]["description"] = "Equal to n when given."
    completion["anyOf"] = [
        {"properties": {"best_of": {"type": "null"}}},
        {"properties": {"n": {"enum": [1, None]}, "best_of": {"const": 1}}},
        *(
            {"properties": {"n": {"const": n}, "best_of": {"const": n}}, "required": ["n"]}
            for n in range(2, limits.max_n + 1)
        ),
    ]
    chat["anyOf"] = [
        {"properties": {"top_logprobs": {"type": "null"}}},
        {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
    ]
    for request in (completion, chat):  # stream_options only with stream: true, as OpenAI's
        streamed_only = [
            {"properties": {"stream_options": {"type": "null"}}},
            {"properties": {"stream": {"const": True}}, "required": ["stream"]},
        ]
        request["allOf"] = [{"anyOf": request.pop("anyOf")}, {"anyOf": streamed_only}]
    schemas["NextTokenLogprobsRequest"]["anyOf"] = [
        {"properties": {"shared_memory": {"type": "null"}}},
        {"properties": {"layout": {"const": "matrix"}}, "required": ["layout"]},
    ]
    generate = schemas["GenerateRequest"]["properties"]
    texts = {"type": "array", "items": _text(), "minItems": 1, "maxItems": limits.max_prompts}
    generate["text"] = _null_or({"anyOf": [_text(), texts]})
    generate["input_ids"] = _null_or(
        {"anyOf": [_token_ids(), {**_token_ids(), "items": _token_ids(), "maxItems": limits.max_prompts}]}
    )
    named_ids = {**_token_ids(), "minItems": 0}  # [] names none
    generate["token_ids_logprob"] = _null_or(
        {
            "anyOf": [
                named_ids,
                {"type": "array", "items": named_ids, "minItems": 1, "maxItems": limits.max_prompts},
            ]
        }
    )
    schemas["TokenizeRequest"]["oneOf"] = [
        {"properties": {"prompt": {"type": "string"}}, "required": ["prompt"]},
        {"properties": {"messages": {"type": "array"}}, "required": ["messages"]},
    ]


def _operation_id(op: Operation) -> str:
    return (op.method + op.path).replace("/", "_").replace("{", "").replace("}", "").strip("_")


MODEL_REQUESTS = (
    CompletionRequest,
    ChatCompletionRequest,
    NextTokenLogprobsRequest,
    TokenizeRequest,
    DetokenizeRequest,
)


def _model_links(source: Operation, model: str) -> dict[str, Any]:
    """Links from a response naming a served model (`model`, a runtime expression) to every
    operation that names one: in its path, or as `model` in its body (the rest of the body is the
    caller's)."""
    links: dict[str, Any] = {}
    for op in OPERATIONS:
        if "{model}" in op.path and op is not source:
            links[_operation_id(op)] = {"operationId": _operation_id(op), "parameters": {"model": model}}
        elif op.request in MODEL_REQUESTS:
            links[_operation_id(op)] = {
                "operationId": _operation_id(op),
                "requestBody": {"model": "{" + model + "}"},
            }
    return links


def _links(op: Operation) -> dict[str, Any]:
    """What a success response gives that other operations take (OpenAPI links)."""
    if op.path == "/v1/models":
        return _model_links(op, "$response.body#/data/0/id")
    if op.path == "/v1/models/{model}":
        return _model_links(op, "$response.body#/id")
    if op.path == "/v1/load_lora_adapter":
        target = next(o for o in OPERATIONS if o.path == "/v1/models/{model}")
        return {
            "describe_adapter": {
                "operationId": _operation_id(target),
                "parameters": {"model": "$response.body#/id"},
            }
        }
    if op.request is TokenizeRequest:
        detokenize = next(o for o in OPERATIONS if o.path == op.path.replace("tokenize", "detokenize"))
        body = {"model": "{$request.body#/model}", "tokens": "{$response.body#/tokens}"}
        return {"detokenize": {"operationId": _operation_id(detokenize), "requestBody": body}}
    return {}


def build_openapi(settings: Settings | None = None, vocab_size: int | None = None) -> dict[str, Any]:
    """The document for `settings`; with `vocab_size` (the running server's, once its models have
    loaded), token ids and `logit_bias` keys bounded by it."""
    settings = settings or Settings()
    _, schemas = msgspec.json.schema_components(_TYPES, ref_template=REF)
    schemas = copy.deepcopy(schemas)
    _apply_limits(schemas, settings)
    _apply_route_checks(schemas, settings)
    if vocab_size is not None:
        bound_by_vocabulary(schemas, vocab_size)
    unguarded = open_paths(metrics_public=settings.metrics_public)
    paths: dict[str, Any] = {}
    for op in OPERATIONS:
        responses: dict[str, Any] = {
            op.ok_status: {
                "description": "Success.",
                "content": {m: {"schema": s} for m, s in op.responses.items()},
            }
        }
        if links := _links(op):
            responses[op.ok_status]["links"] = links
        statuses = set(op.errors)
        if op.path not in unguarded:
            statuses |= {"401", "429"}
        if op.request is not None:
            statuses |= {"413", "415"}
        if op.path not in DURING_SHUTDOWN:
            statuses.add("503")
        for status in sorted(statuses):
            responses[status] = {
                "description": ERRORS[status],
                "content": {"application/json": {"schema": _ref(ErrorResponse)}},
            }
        if op.path == "/health_generate":  # SGLang's: an empty body either way
            responses["503"] = {
                "description": "Loading, or a model failed to generate.",
                "content": {"text/plain": {"schema": {"type": "string", "maxLength": 0}}},
            }
        if op.path == "/health":  # 503 carries the health document, not an error object
            responses["503"] = {
                "description": "Loading or unhealthy.",
                "content": {"application/json": {"schema": _ref(Health)}},
            }
        spec: dict[str, Any] = {
            "summary": op.summary,
            "description": op.description,
            "operationId": _operation_id(op),
            "tags": list(op.tags),
            "responses": responses,
        }
        if op.path in unguarded:
            spec["security"] = []
        if "{model}" in op.path:
            spec["parameters"] = [MODEL_PARAM]
        if op.request is not None:
            media: dict[str, Any] = {"schema": _ref(op.request)}
            if op.example is not None:
                media["example"] = op.example
            spec["requestBody"] = {"required": True, "content": {"application/json": media}}
        paths.setdefault(op.path, {})[op.method] = spec
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "logprob-gateway",
            "version": "0.1.0",
            "description": "OpenAI-compatible gateway for in-process LLM engines, with dense next-token "
            "log-probabilities over the whole vocabulary. Errors use OpenAI's error object. A request whose "
            "head (request line and headers) is not complete within the server's header timeout gets a 408 "
            "and its connection is closed.",
        },
        "paths": paths,
        **({"security": [{"apiKey": []}]} if settings.api_keys or settings.api_keys_file else {}),
        "components": {
            "schemas": schemas,
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer", "description": "An API key."}},
        },
    }
