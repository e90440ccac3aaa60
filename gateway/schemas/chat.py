"""POST /v1/chat/completions."""

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
    TopP,
    Usage,
    sampling_seed,
)


class TextPart(msgspec.Struct, kw_only=True):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: Name | None = None


class ChatCompletionRequest(OutputControls, kw_only=True):
    model: ModelName
    messages: list[ChatMessage]
    max_tokens: NonNegativeInt | None = None
    max_completion_tokens: NonNegativeInt | None = None
    temperature: Temperature | None = 1.0
    top_p: TopP | None = 1.0
    n: PositiveInt | None = 1
    stop: Stop | None = None
    seed: Seed | None = None
    logprobs: bool | None = False
    top_logprobs: NonNegativeInt | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: Name | None = None

    def __post_init__(self) -> None:
        self.seed = sampling_seed(self.seed)


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprob] | None


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
