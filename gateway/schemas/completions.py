"""POST /v1/completions."""

from __future__ import annotations

from typing import Literal

import msgspec

from gateway.schemas.common import GenerationRequest, NonNegativeInt, PositiveInt, TokenId, Usage

# OpenAI accepts a string, strings, token ids, or lists of token ids; msgspec unions allow one array
# type, so the list's elements are checked to be all of one kind in the route.
Prompt = str | list[str | TokenId | list[TokenId]]


class CompletionRequest(GenerationRequest, kw_only=True):
    prompt: Prompt
    max_tokens: NonNegativeInt | None = 16
    best_of: PositiveInt | None = None
    echo: bool | None = False
    logprobs: NonNegativeInt | None = None
    suffix: str | None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
