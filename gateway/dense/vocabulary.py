"""Vocabulary bytes, tokenizer files, tokenize and detokenize: what a remote client needs to work
with token ids as if the model were local."""

from __future__ import annotations

import asyncio
import base64

from litestar import Request, Response, get, post

from backends.vocab import decode_text, token_display
from gateway.contract.operation import OPENAPI, Operation
from gateway.errors import InvalidRequestError
from gateway.models.served import ServedModel
from gateway.openai.chat import chat_prompt_ids
from gateway.prompts import check_text_chars, check_token_ids, tokenize
from gateway.requests import decode_json, resolve_model, settings, wants_msgpack
from gateway.responses import json_response, msgpack_response
from gateway.schemas.logprobs import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerFiles,
    Vocabulary,
    VocabularyBinary,
)
from gateway.settings import Limits


@get(
    "/v1/models/{model:str}/vocabulary",
    summary="Token bytes",
    description="Every token id's exact bytes (base64 in JSON, raw bytes in MessagePack), for byte-level "
    "constrained decoding. An adapter name resolves to its base.",
    tags=["Dense logprobs"],
    opt={
        OPENAPI: Operation(content={"application/json": Vocabulary, "application/msgpack": VocabularyBinary})
    },
)
async def vocabulary(request: Request, model: str) -> Response:
    served, _ = resolve_model(request, model)
    engine = served.require_engine()
    fields = {
        "model": served.name,
        "vocab_size": engine.info.vocab_size,
        "tokenizer_size": len(engine.info.tokenizer),
        "eos_token_ids": sorted(engine.info.eos_token_ids),
        "bos_token_id": engine.info.tokenizer.bos_token_id,
        "special_token_ids": sorted(served.special_ids),
    }
    if wants_msgpack(request):
        return msgpack_response(VocabularyBinary(**fields, tokens=served.token_bytes))
    tokens = [base64.b64encode(t).decode("ascii") for t in served.token_bytes]
    return json_response(Vocabulary(**fields, tokens=tokens))


@get(
    "/v1/models/{model:str}/tokenizer",
    summary="Tokenizer files",
    description="The tokenizer's files (tokenizer.json, config, chat template) to rebuild it offline.",
    tags=["Dense logprobs"],
    opt={OPENAPI: Operation(content={"application/json": TokenizerFiles})},
)
async def tokenizer_files(request: Request, model: str) -> Response:
    served, _ = resolve_model(request, model)
    served.require_engine()
    return json_response(TokenizerFiles(model=served.name, files=served.tokenizer_files))


@post(
    ["/v1/tokenize", "/tokenize"],
    status_code=200,
    summary="Tokenize",
    description="vLLM's shape: `prompt` or chat `messages` to token ids.",
    tags=["Tokenizer"],
    opt={
        OPENAPI: Operation(
            request=TokenizeRequest,
            content={"application/json": TokenizeResponse},
            example={"model": "smollm2-135m", "prompt": "Hello world"},
        )
    },
)
async def tokenize_route(request: Request) -> Response:
    body = await decode_json(request, TokenizeRequest)
    served, _ = resolve_model(request, body.model)
    served.require_engine()
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
    if body.prompt is not None:
        check_text_chars(served, settings(request).limits, len(body.prompt), "prompt")
    answer = await asyncio.to_thread(_tokenized, served, body, settings(request).limits)
    return json_response(answer)


def _tokenized(served: ServedModel, body: TokenizeRequest, limits: Limits) -> TokenizeResponse:
    """Blocks as long as templating and tokenizing take: runs off the event loop."""
    if body.messages is not None:
        ids = chat_prompt_ids(served, body.messages, limits, add_generation_prompt=body.add_generation_prompt)
    else:  # text the tokenizer drops entirely ("", some control characters) has no tokens
        ids = tokenize(
            served,
            body.prompt or "",
            add_special_tokens=body.add_special_tokens,
            param="prompt",
            allow_empty=True,
        )
    strs = [token_display(served.token_bytes[i]) for i in ids] if body.return_token_strs else None
    max_model_len = served.require_engine().info.max_model_len
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


@post(
    ["/v1/detokenize", "/detokenize"],
    status_code=200,
    summary="Detokenize",
    description="vLLM's shape: token ids to text.",
    tags=["Tokenizer"],
    opt={
        OPENAPI: Operation(
            request=DetokenizeRequest,
            content={"application/json": DetokenizeResponse},
            example={"model": "smollm2-135m", "tokens": [504, 3575]},
        )
    },
)
async def detokenize_route(request: Request) -> Response:
    body = await decode_json(request, DetokenizeRequest)
    served, _ = resolve_model(request, body.model)
    ids = check_token_ids(served, body.tokens, "tokens") if body.tokens else []
    # One Python step per id: in a thread, the event loop still gets the GIL between steps.
    text = await asyncio.to_thread(decode_text, served.token_bytes, ids)
    return json_response(DetokenizeResponse(prompt=text))
