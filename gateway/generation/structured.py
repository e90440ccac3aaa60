"""The grammar an OpenAI request asks its output to match: `response_format` (OpenAI's) or
`structured_outputs` (vLLM's), on /v1/completions and /v1/chat/completions alike."""

from __future__ import annotations

import json

from backends.grammar.text import PARSER_LIMITS
from backends.types import Grammar
from gateway.errors import InvalidRequestError
from gateway.schemas.common import JsonObjectFormat, JsonSchemaFormat, OutputControls, StructuredOutputs

ANY_OBJECT = Grammar("json_schema", '{"type": "object"}')
MAX_CHOICES = PARSER_LIMITS["max_items_in_row"]  # the grammar engine's bound on one rule's alternatives


def requested_grammar(body: OutputControls) -> tuple[Grammar | None, str]:
    """The request's grammar (None: plain text) and the field that asks for it."""
    fmt, structured = body.response_format, body.structured_outputs
    if structured is not None and isinstance(fmt, JsonObjectFormat | JsonSchemaFormat):
        raise InvalidRequestError(
            "response_format and structured_outputs cannot both constrain the output",
            param="structured_outputs",
        )
    if structured is not None:
        return _structured(structured), "structured_outputs"
    if isinstance(fmt, JsonSchemaFormat):
        return Grammar(
            "json_schema", json.dumps(fmt.json_schema.schema)
        ), "response_format.json_schema.schema"
    if isinstance(fmt, JsonObjectFormat):
        return ANY_OBJECT, "response_format"
    return None, "response_format"


def _structured(spec: StructuredOutputs) -> Grammar:
    given = [name for name in StructuredOutputs.__struct_fields__ if getattr(spec, name) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequestError(
            "structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
            f"got {', '.join(given) or 'none'}",
            param="structured_outputs",
        )
    if spec.json is not None:
        return Grammar("json_schema", spec.json if isinstance(spec.json, str) else json.dumps(spec.json))
    if spec.regex is not None:
        return Grammar("regex", spec.regex)
    if spec.choice is not None:  # one of the strings, exactly: a Lark grammar of string literals
        if len(spec.choice) > MAX_CHOICES:  # refused at once, not after a compile that must fail
            raise InvalidRequestError(
                f"structured_outputs.choice has {len(spec.choice)} options; at most {MAX_CHOICES}",
                param="structured_outputs.choice",
            )
        return Grammar("lark", "start: " + " | ".join(json.dumps(choice) for choice in spec.choice))
    if spec.grammar is not None:  # GBNF (vLLM's EBNF) or Lark: llguidance tells them apart
        return Grammar("ebnf", spec.grammar)
    return ANY_OBJECT
