"""A Responses request turned into the chat route's request, one way down: `instructions` and
`input` become messages, function tools and `tool_choice` chat's, `text.format` chat's
response_format, `max_output_tokens` max_completion_tokens. The chat generation's errors name chat's
fields; `renamed` turns those names into the Responses request's own."""

from __future__ import annotations

import re

import msgspec

from gateway.errors import InvalidRequestError, decode_error
from gateway.schemas.chat import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionSpec,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolCall,
)
from gateway.schemas.chat import ToolChoice as ChatToolChoice
from gateway.schemas.common import (
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaSpec,
    ResponseFormat,
    TextFormat,
)
from gateway.schemas.responses import (
    NOT_SERVED,
    FunctionToolChoice,
    InputItem,
    JsonObjectTextFormat,
    JsonSchemaTextFormat,
    ResponsesRequest,
)

LOGPROBS = "message.output_text.logprobs"


def refusal(exc: msgspec.ValidationError) -> InvalidRequestError:
    """A body that does not match ResponsesRequest: msgspec's message and the field it names, with
    why the gateway refuses that field where it types it to fewer values than OpenAI does."""
    param = decode_error(exc).param
    field = (param or "").split(".")[0].split("[")[0]
    hint = f" ({field}: {NOT_SERVED[field]})" if field in NOT_SERVED else ""
    return InvalidRequestError(f"invalid request: {exc}{hint}", param=param)


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Whether the answer's text carries its tokens' logprobs: `include` asks for them, or
    `top_logprobs` is given."""
    return LOGPROBS in (body.include or ()) or body.top_logprobs is not None


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that makes this Responses request's answer (not yet checked: the chat
    route's admission and generation check it)."""
    logprobs = wants_logprobs(body)
    tools = [
        Tool(
            type="function",
            function=FunctionSpec(
                name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
            ),
        )
        for tool in body.tools or ()
    ]
    return ChatCompletionRequest(
        model=body.model,
        messages=chat_messages(body),
        tools=tools or None,  # none, as OpenAI's empty list: a text answer
        tool_choice=_tool_choice(body),
        parallel_tool_calls=body.parallel_tool_calls,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stream=body.stream,
        response_format=_response_format(body),
        user=body.user,
        logprobs=logprobs,
        top_logprobs=(body.top_logprobs or 0) if logprobs else None,
    )


def _tool_choice(body: ResponsesRequest) -> ChatToolChoice | None:
    """Chat's tool_choice; OpenAI's default "auto" (or "none") without tools asks for text."""
    choice = body.tool_choice
    if not body.tools and choice in ("auto", "none"):
        return None
    if isinstance(choice, FunctionToolChoice):
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return choice


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, JsonSchemaTextFormat):
        spec = JsonSchemaSpec(
            name=fmt.name, description=fmt.description, schema=fmt.schema, strict=fmt.strict
        )
        return JsonSchemaFormat(json_schema=spec)
    if isinstance(fmt, JsonObjectTextFormat):
        return JsonObjectFormat()
    return TextFormat() if fmt is not None else None


def chat_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """`instructions` as the system message, then `input`: a string is one user message; items
    in order, consecutive function calls one assistant turn with those calls, each call's output
    a tool message answering its call_id."""
    messages = (
        [ChatMessage(role="system", content=body.instructions)] if body.instructions is not None else []
    )
    if isinstance(body.input, str):
        return [*messages, ChatMessage(role="user", content=body.input)]
    for index, item in enumerate(body.input):
        if item.type == "message":
            role, content = _required(item, index, "role", "content")
            messages.append(ChatMessage(role=role, content=_text(content)))
        elif item.type == "function_call":
            call_id, name, arguments = _required(item, index, "call_id", "name", "arguments")
            call = ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls:
                last.tool_calls.append(call)  # parallel calls: one assistant turn
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        else:
            call_id, output = _required(item, index, "call_id", "output")
            messages.append(ChatMessage(role="tool", content=_text(output), tool_call_id=call_id))
    return messages


def _required(item: InputItem, index: int, *fields: str) -> list:
    values = [getattr(item, field) for field in fields]
    for field, value in zip(fields, values, strict=True):
        if value is None:
            raise InvalidRequestError(
                f"input[{index}] of type {item.type!r} needs {field}", param=f"input[{index}].{field}"
            )
    return values


def _text(content: object) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)  # type: ignore[attr-defined]


# The chat request's field names in the errors of the chat generation, and the Responses
# request's fields they come from.
_FIELDS = [
    (re.compile(r"^messages\b"), "input"),
    (re.compile(r"^prompt\b"), "input"),
    (re.compile(r"^max_(completion_)?tokens\b"), "max_output_tokens"),
    (re.compile(r"^response_format\.json_schema\."), "text.format."),
    (re.compile(r"^response_format\b"), "text.format"),
    (re.compile(r"^(tools\[\d+\])\.function\."), r"\1."),
]
_WORDS = [
    (re.compile(r"\bmessages\b"), "input"),
    (re.compile(r"\bmax_(completion_)?tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
]


def renamed(exc: InvalidRequestError) -> InvalidRequestError:
    """`exc` naming the Responses request's field where it names the chat request's."""
    if exc.param is not None:
        for pattern, name in _FIELDS:
            exc.param = pattern.sub(name, exc.param)
    for pattern, name in _WORDS:
        exc.message = pattern.sub(name, exc.message)
    return exc
