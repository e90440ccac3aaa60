"""Function calls on /v1/chat/completions. A `tool_choice` of "required" or a named function holds
the output to the JSON of a call, whose arguments validate against the function's `parameters`;
the answer carries it as `tool_calls`, finish reason "tool_calls". "auto" would need a parser of
the model's own call syntax (each chat template has its own), which the gateway does not have, so
it is refused rather than answered with calls left in the text."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from backends.types import Grammar
from gateway.errors import InvalidRequestError
from gateway.responses import new_id
from gateway.schemas.chat import ChatCompletionRequest, FunctionCall, FunctionSpec, NamedToolChoice, ToolCall
from gateway.schemas.common import JsonObjectFormat, JsonSchemaFormat

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolCalls:
    """The grammar of the output's JSON, and how that JSON becomes calls."""

    grammar: Grammar
    named: str | None  # the output is this function's arguments; None: a list of {"name", "parameters"}

    def calls(self, text: str) -> list[ToolCall]:
        value = json.loads(text)
        pairs = [(self.named, value)] if self.named else [(c["name"], c["parameters"]) for c in value]
        return [
            ToolCall(id=new_id("call"), function=FunctionCall(name=name, arguments=json.dumps(arguments)))
            for name, arguments in pairs
        ]


def requested_calls(body: ChatCompletionRequest) -> ToolCalls | None:
    """The calls the request asks for; None: a text answer ("none", or no tools)."""
    tools = body.tools or []
    choice = body.tool_choice or "auto"
    if choice == "none" or (choice == "auto" and not tools):
        return None
    if not tools:
        raise InvalidRequestError(
            "tool_choice asks for a call, but the request has no tools", param="tool_choice"
        )
    if choice == "auto":
        raise InvalidRequestError(
            'tool_choice "auto" (the default with tools) needs a parser of this model\'s own call syntax, '
            'which the gateway does not have: ask "required", a named function, or "none"',
            param="tool_choice",
        )
    if body.structured_outputs is not None or isinstance(
        body.response_format, JsonObjectFormat | JsonSchemaFormat
    ):
        raise InvalidRequestError(
            "a tool call and response_format cannot both constrain the output", param="tool_choice"
        )
    functions: dict[str, FunctionSpec] = {}
    for tool in tools:
        if tool.function.name in functions:
            raise InvalidRequestError(f"two tools are named {tool.function.name!r}", param="tools")
        functions[tool.function.name] = tool.function
    if isinstance(choice, NamedToolChoice):
        function = functions.get(choice.function.name)
        if function is None:
            raise InvalidRequestError(f"no tool is named {choice.function.name!r}", param="tool_choice")
        return ToolCalls(Grammar("json_schema", json.dumps(_parameters(function))), function.name)
    call: dict[str, Any] = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "parameters": _parameters(f)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for f in functions.values()
        ]
    }
    calls: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if body.parallel_tool_calls is False:
        calls["maxItems"] = 1
    return ToolCalls(Grammar("json_schema", json.dumps(calls)), None)


def _parameters(function: FunctionSpec) -> dict[str, Any]:
    return NO_ARGUMENTS if function.parameters is None else function.parameters


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (a template that knows no tools ignores them)."""
    if not body.tools:
        return None
    tools = msgspec.to_builtins(body.tools)
    for tool in tools:
        tool["function"] = {k: v for k, v in tool["function"].items() if v is not None and k != "strict"}
    return tools
