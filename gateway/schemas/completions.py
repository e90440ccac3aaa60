"""POST /v1/completions."""

from __future__ import annotations

from typing import Literal

import msgspec

from gateway.schemas.common import (
    ModelName,
    Name,
    NonNegativeInt,
    OutputControls,
    Penalty,
    PositiveInt,
    Seed,
    Stop,
    StreamOptions,
    Temperature,
    TokenId,
    TopP,
    Usage,
    sampling_seed,
)

# OpenAI accepts a string, strings, token ids, or lists of token ids; msgspec unions allow one array
# type, so the list's elements are checked to be all of one kind in the route.
Prompt = str | list[str | TokenId | list[TokenId]]


class CompletionRequest(OutputControls, kw_only=True):
    model: ModelName
    prompt: Prompt
    max_tokens: NonNegativeInt | None = 16
    temperature: Temperature | None = 1.0
    top_p: TopP | None = 1.0
    n: PositiveInt | None = 1
    best_of: PositiveInt | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    echo: bool | None = False
    logprobs: NonNegativeInt | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    user: Name | None = None

    def __post_init__(self) -> None:
        self.seed = sampling_seed(self.seed)


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
