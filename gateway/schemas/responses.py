"""POST /v1/responses: OpenAI's Responses API, the request and the Response object.

The request's fields that ask for what the gateway does not give are typed to the values that ask
for nothing more (as gateway/schemas/common.py types chat's), so anything else is a 400 naming the
field; NOT_SERVED says why in that 400. Unknown fields are ignored, as on the chat route.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from gateway.schemas.chat import FunctionName, TokenLogprob
from gateway.schemas.common import ModelName, Name, NonNegativeInt, Temperature, TopP

_NOT_STORED = "this gateway does not store responses: send the whole conversation in input"
_NO_REASONING = "the served models do not reason"
NOT_SERVED = {
    "previous_response_id": _NOT_STORED,
    "conversation": _NOT_STORED,
    "prompt": "stored prompts are not served: send the text in input and instructions",
    "background": "responses are answered while the request waits (or streams), never in the background",
    "reasoning": _NO_REASONING,
    "include": 'only "message.output_text.logprobs" can be included',
    "truncation": 'only "disabled": an input beyond the context is a 400',
    "tools": 'only tools of type "function" are served',
    "tool_choice": 'tool_choice is "none", "auto", "required" or {"type": "function", "name": ...}',
    "max_tool_calls": "the number of calls is not limited here: leave it out",
    "text": 'text.format is {"type": "text"}, {"type": "json_schema", "name", "schema"} or '
    '{"type": "json_object"}; text.verbosity "medium" or none',
    "input": "input is a string or a list of messages (text parts), function_call and "
    "function_call_output items",
}


class InputText(msgspec.Struct, kw_only=True, tag_field="type", tag="input_text"):
    text: str


class OutputText(msgspec.Struct, kw_only=True, tag_field="type", tag="output_text"):
    """An earlier answer's text part, sent back (its annotations and logprobs are not read)."""

    text: str


ContentPart = InputText | OutputText


class InputItem(msgspec.Struct, kw_only=True):
    """One item of `input`: a message (`type` "message" or left out: `role` and `content`), an
    earlier `function_call` (`call_id`, `name`, `arguments`), or a `function_call_output`
    (`call_id`, `output`). Fields another type's item has are ignored; `id` and `status` too."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: Name | None = None
    name: FunctionName | None = None
    arguments: str | None = None  # JSON text, as the answer's function_call item gave it
    output: str | list[InputText] | None = None
    id: Name | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionTool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None


class FunctionToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    name: FunctionName


ToolChoice = Literal["none", "auto", "required"] | FunctionToolChoice


class PlainTextFormat(msgspec.Struct, kw_only=True, tag_field="type", tag="text"):
    """Plain text (the default)."""


class JsonSchemaTextFormat(msgspec.Struct, kw_only=True, tag_field="type", tag="json_schema"):
    """JSON that validates against `schema` (chat's response_format json_schema, flattened)."""

    name: Annotated[str, msgspec.Meta(max_length=64, pattern="^[A-Za-z0-9_-]+(?!\\n)$")]
    description: str | None = None
    schema: dict[str, Any]
    strict: bool | None = None


class JsonObjectTextFormat(msgspec.Struct, kw_only=True, tag_field="type", tag="json_object"):
    """Any JSON object."""


class TextConfig(msgspec.Struct, kw_only=True):
    format: PlainTextFormat | JsonSchemaTextFormat | JsonObjectTextFormat | None = None
    verbosity: Literal["medium"] | None = None


class Reasoning(msgspec.Struct, kw_only=True):
    effort: Literal["none"] | None = None
    summary: None = None
    generate_summary: None = None


MetadataKey = Annotated[str, msgspec.Meta(max_length=64)]
MetadataValue = Annotated[str, msgspec.Meta(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], msgspec.Meta(max_length=16)]
NotStored = Annotated[None, msgspec.Meta(description=_NOT_STORED)]


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """What `client.responses.create(...)` sends. The conversation is `instructions` (a system
    message first) and `input`; the answer is made by the chat route's generation."""

    model: ModelName
    input: str | Annotated[list[InputItem], msgspec.Meta(min_length=1)]
    instructions: str | None = None
    max_output_tokens: NonNegativeInt | None = None
    temperature: Temperature | None = 1.0
    top_p: TopP | None = 1.0
    tools: Annotated[list[FunctionTool], msgspec.Meta(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    metadata: Metadata | None = None
    user: Name | None = None
    store: bool | None = None  # answered `store: false` whatever it asks
    top_logprobs: NonNegativeInt | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: Reasoning | None = None
    previous_response_id: NotStored = None
    conversation: NotStored = None
    prompt: Annotated[None, msgspec.Meta(description=NOT_SERVED["prompt"])] = None
    background: Literal[False] | None = None
    max_tool_calls: None = None
    # asked of OpenAI's service and changing no output here
    service_tier: Literal["auto", "default"] | None = None
    prompt_cache_key: Name | None = None
    safety_identifier: Name | None = None


class OutputTextPart(msgspec.Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)  # always empty
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)  # with include or top_logprobs


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputTextPart]


class FunctionCallItem(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: Literal["max_output_tokens"] | None  # None: generation aborted for a weights update


class ResponseObject(msgspec.Struct, kw_only=True):
    """The Response object as the `openai` SDK types it, with the request's fields echoed."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None = None
    reasoning: Reasoning | None
    store: Literal[False] = False
    background: Literal[False] = False
    temperature: float | None
    text: TextConfig
    tool_choice: ToolChoice
    tools: list[FunctionTool]
    top_p: float | None
    top_logprobs: int | None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]


# The stream's events (`event: <type>` and `data: <json>`), in the order OpenAI sends them:
# response.created, response.in_progress, then per output item output_item.added, its content
# (content_part.added, output_text.delta..., output_text.done, content_part.done; or
# function_call_arguments.delta..., function_call_arguments.done), output_item.done; last
# response.completed (or response.incomplete); an `error` event where it fails.


class LifecycleEvent(msgspec.Struct, kw_only=True):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(msgspec.Struct, kw_only=True):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(msgspec.Struct, kw_only=True):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputTextPart


class TextDeltaEvent(msgspec.Struct, kw_only=True):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[TokenLogprob]


class TextDoneEvent(msgspec.Struct, kw_only=True):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[TokenLogprob]


class ArgumentsDeltaEvent(msgspec.Struct, kw_only=True):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(msgspec.Struct, kw_only=True):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(msgspec.Struct, kw_only=True):
    type: Literal["error"] = "error"
    sequence_number: int
    code: str | None
    message: str
    param: str | None
