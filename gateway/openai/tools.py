"""Function calls on /v1/chat/completions, held to the tools' schemas by the grammar.

- "auto" (the default with tools): free text, or text then calls in the model's own format, as
  its chat template shows it (gateway/openai/tool_formats.py) or its settings name it
  (gateway/models/chat_template.py); a model without one is refused with a 400 naming it.
- "required", a named function: calls only (a named one: that function's, once). On a model whose
  template shows no calls, "required" is a JSON list of `{"name", "parameters"}` and a named call
  its arguments alone.
- "none", or no tools: text.

Once a call starts, its arguments are held to the function's `parameters`, so a call that ends is
valid; a call cut short (max_tokens, a stop string) comes back as it is, with finish reason
"length" (or "stop"). With a call forced, the call's grammar wins over `response_format`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from backends.types import Grammar
from gateway.errors import InvalidRequestError
from gateway.models.served import ServedModel
from gateway.openai.tool_formats import (
    GATEWAY_JSON,
    ToolFormat,
    calls_grammar,
    function_parameters,
)
from gateway.openai.tool_reader import CallReader
from gateway.schemas.chat import ChatCompletionRequest, FunctionSpec, NamedToolChoice
from gateway.schemas.common import JsonObjectFormat, JsonSchemaFormat


@dataclass(frozen=True)
class ToolCalls:
    """The grammar of a request's output, and how its text becomes content and calls."""

    grammar: Grammar
    fmt: ToolFormat | None  # None: the output is the arguments of `named`
    named: str | None = None
    forced: bool = True  # no text, only calls ("required", a named function)
    shown_ids: frozenset[int] = frozenset()  # special tokens the reader must see (the trigger)

    def reader(self) -> CallReader:
        return CallReader(self.fmt, self.named)


def requested_calls(body: ChatCompletionRequest, served: ServedModel) -> ToolCalls | None:
    """The calls the request may make; None: a text answer ("none", or no tools)."""
    choice = body.tool_choice or ("none" if body.tools is None else "auto")
    if choice == "none":
        return None
    tools = body.tools or []
    if not tools:
        if body.tools is not None:
            raise InvalidRequestError(
                'tools is empty: leave it out, or give tool_choice "none", for a text answer', param="tools"
            )
        raise InvalidRequestError(
            "tool_choice asks for a call, but the request has no tools", param="tool_choice"
        )
    functions: dict[str, FunctionSpec] = {}
    for index, tool in enumerate(tools):
        if tool.function.name in functions:
            raise InvalidRequestError(f"two tools are named {tool.function.name!r}", param="tools")
        if isinstance(tool.function.parameters, dict) and "x-guidance" in tool.function.parameters:
            # its separators and leniency would let arguments through that are no JSON or miss keys
            raise InvalidRequestError(
                "x-guidance is not taken in a tool's parameters: the gateway holds a call's arguments "
                "to valid JSON of the schema",
                param=f"tools[{index}].function.parameters",
            )
        functions[tool.function.name] = tool.function
    fmt = served.tool_format
    if choice == "auto":
        if fmt is None:
            raise InvalidRequestError(
                f'tool_choice "auto" (the default with tools) needs a parser of the model\'s own call '
                f"syntax, and the chat template of model {served.name!r} shows no tool-call format: "
                'ask "required", a named function, or "none" (or serve the model with a '
                "chat_template that shows one, or a tool_call_format)",
                param="tool_choice",
            )
        if body.structured_outputs is not None or isinstance(
            body.response_format, JsonObjectFormat | JsonSchemaFormat
        ):
            raise InvalidRequestError(
                'tool_choice "auto" and response_format cannot both constrain the output: force a call '
                '(its grammar wins) or ask tool_choice "none"',
                param="response_format",
            )
    named = None
    if isinstance(choice, NamedToolChoice):
        named = choice.function.name
        if named not in functions:
            raise InvalidRequestError(f"no tool is named {named!r}", param="tool_choice")
    chosen = [functions[named]] if named is not None else list(functions.values())
    if fmt is None and named is not None:
        return ToolCalls(Grammar("json_schema", json.dumps(function_parameters(chosen[0]))), None, named)
    fmt = fmt or GATEWAY_JSON
    trigger_token = _special_token(served, fmt.trigger)
    grammar = calls_grammar(
        fmt,
        chosen,
        forced=choice != "auto",
        parallel=named is None and body.parallel_tool_calls is not False,
        trigger_token=trigger_token,
    )
    shown = frozenset() if trigger_token is None else frozenset([trigger_token])
    return ToolCalls(grammar, fmt, None, forced=choice != "auto", shown_ids=shown)


def _special_token(served: ServedModel, text: str) -> int | None:
    """The id of `text` where it is one special token of the model's vocabulary (its text is then
    no text the model can spell, only that token)."""
    if not text:
        return None
    tokenizer = served.require_engine().info.tokenizer
    token_id = tokenizer.convert_tokens_to_ids(text)
    if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != text:
        return None  # not one token (the unknown token's id comes back for any text)
    return token_id if token_id in served.special_ids else None


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (a template that knows no tools ignores them)."""
    if not body.tools:
        return None
    tools = msgspec.to_builtins(body.tools)
    for tool in tools:
        tool["function"] = {k: v for k, v in tool["function"].items() if v is not None and k != "strict"}
    return tools


def template_tool_calls(calls: list[Any]) -> list[dict[str, Any]]:
    """An assistant turn's earlier calls as chat templates take them: each call's arguments as the
    object they encode (Qwen's, Hermes' and Llama's templates write `arguments | tojson`; a JSON
    string there would be quoted twice); text that is no JSON object stays text."""
    turns = msgspec.to_builtins(calls)
    for call in turns:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except (ValueError, RecursionError):  # not JSON, or nested past Python's recursion limit
            continue
        if isinstance(arguments, dict):
            call["function"]["arguments"] = arguments
    return turns
