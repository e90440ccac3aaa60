"""What POST /v1/responses checks beyond its request's types (gateway/openai/response_input.py and
the chat generation it runs), as constraints of the ResponsesRequest schema: the limits, each input
item's fields by its type, and a tool_choice that asks for a call only with tools."""

from __future__ import annotations

from typing import Any

from gateway.contract.constraints import CONTEXT_LIMIT
from gateway.settings import Settings

ROLES = ["user", "system", "developer", "assistant"]


def _not_null(schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return schema if schema is not None else {"not": {"type": "null"}}


def constrain_responses(schemas: dict[str, Any], settings: Settings) -> None:
    """The limits of `settings` and the route's checks, into `schemas` (msgspec's, by name)."""
    limits = settings.limits
    request = schemas["ResponsesRequest"]
    properties = request["properties"]
    properties["max_output_tokens"]["anyOf"][0]["maximum"] = limits.max_tokens
    properties["max_output_tokens"]["description"] = CONTEXT_LIMIT
    properties["top_logprobs"]["anyOf"][0]["maximum"] = limits.max_top_logprobs
    text = {"type": "string"}
    schemas["InputItem"]["anyOf"] = [
        {  # a message: `type` "message" or left out
            "properties": {"type": {"const": "message"}, "role": {"enum": ROLES}, "content": _not_null()},
            "required": ["role", "content"],
        },
        {
            "properties": {
                "type": {"const": "function_call"},
                "call_id": text,
                "name": text,
                "arguments": text,
            },
            "required": ["type", "call_id", "name", "arguments"],
        },
        {
            "properties": {"type": {"const": "function_call_output"}, "call_id": text, "output": _not_null()},
            "required": ["type", "call_id", "output"],
        },
    ]
    no_tools = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}
    request["allOf"] = [
        {  # a call only with tools; "auto" (the default with tools) needs a model whose template shows calls
            "anyOf": [
                {"properties": {"tools": no_tools, "tool_choice": {"enum": [None, "none", "auto"]}}},
                {"properties": {"tool_choice": {"const": "none"}}, "required": ["tool_choice"]},
                {
                    "properties": {
                        "tools": {"type": "array", "minItems": 1},
                        "tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]},
                    },
                    "required": ["tools", "tool_choice"],
                },
                {
                    "properties": {
                        "tools": {"type": "array", "minItems": 1},
                        "tool_choice": {"enum": [None, "auto"]},
                    },
                    "required": ["tools"],
                },
            ]
        }
    ]
