"""POST /v1/chat/completions."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from gateway.schemas.common import GenerationRequest, Name, NonNegativeInt, Usage


class TextPart(msgspec.Struct, kw_only=True):
    type: Literal["text"]
    text: str


# `(?!\n)`: a pattern's `$` (Python's re.search) also matches before a final newline, and a name
# the model cannot write back whole loses the call
FunctionName = Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_-]{1,64}(?!\\n)$")]


class FunctionCall(msgspec.Struct, kw_only=True):
    name: FunctionName
    arguments: str  # compact JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, kw_only=True):
    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: Name | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Name | None = None  # a tool's answer to that call


class FunctionSpec(msgspec.Struct, kw_only=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(msgspec.Struct, kw_only=True):
    name: FunctionName


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(GenerationRequest, kw_only=True):
    messages: list[ChatMessage]
    # Function calls (gateway/openai/tools.py): "auto" (the default with tools) in the model's own
    # call format, "required" or a named function forced; the grammar holds arguments to schema.
    tools: Annotated[list[Tool], msgspec.Meta(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: NonNegativeInt | None = None
    max_completion_tokens: NonNegativeInt | None = None
    logprobs: bool | None = False
    top_logprobs: NonNegativeInt | None = None


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
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class FunctionCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None  # in a call's first delta only
    arguments: str  # a fragment of the arguments' JSON text; "" in the first delta


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed call, as OpenAI sends it: its first delta names it (id, type, name, arguments
    ""), the ones after carry fragments of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
