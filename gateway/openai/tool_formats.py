"""The tool-call formats of chat templates, and the Lark grammar (llguidance's dialect) of a
request's calls in one of them.

A model calls tools in the syntax its chat template shows it (the template renders earlier calls
that way, and its tool prompt asks for it); the format is read off the template's text. Each call
is written `{"name": "NAME", "arguments": ARGS}` (or "parameters", as Llama 3.x names it), with the
name a literal of the grammar and ARGS the tool's own JSON schema embedded with `%json`, so every
call the grammar lets through validates, and each schema keeps its own `$defs` at its root.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backends.types import Grammar
from gateway.schemas.chat import FunctionSpec

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
# The JSON of templated calls spaced as Jinja's `tojson` (Python's json.dumps) writes it, which is
# how the template shows the model earlier calls; the gateway's own format is compact.
TEMPLATE_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
COMPACT_JSON = {"whitespace_flexible": False}


@dataclass(frozen=True)
class ToolFormat:
    """Where calls go in a model's output: `trigger` opens the calls (at the start of the output
    only where `at_start_only`; a call may also open it bare, without the trigger, where
    `bare_start`), then `opening`, the calls joined by `separator`, then `closing`."""

    name: str
    trigger: str
    opening: str
    separator: str
    closing: str
    arguments_key: str = "arguments"
    at_start_only: bool = False
    bare_start: bool = False
    parallel: bool = True
    json_style: dict[str, Any] | None = None

    def call_head(self, name: str) -> str:
        """The text of a call up to its arguments."""
        if self.json_style is COMPACT_JSON:
            return f'{{"name":"{name}","{self.arguments_key}":'
        return f'{{"name": "{name}", "{self.arguments_key}": '


HERMES = ToolFormat(
    "hermes",
    trigger="<tool_call>",
    opening="\n",
    separator="\n</tool_call>\n<tool_call>\n",
    closing="\n</tool_call>",
    json_style=TEMPLATE_JSON,
)
MISTRAL = ToolFormat(
    "mistral", trigger="[TOOL_CALLS]", opening="[", separator=", ", closing="]", json_style=TEMPLATE_JSON
)
LLAMA3_JSON = ToolFormat(
    "llama3_json",
    trigger="<|python_tag|>",
    opening="",
    separator="; ",
    closing="",
    arguments_key="parameters",
    at_start_only=True,
    bare_start=True,
    json_style=TEMPLATE_JSON,
)
# The gateway's own, for forced calls on a model whose template shows none: a JSON list.
GATEWAY_JSON = ToolFormat(
    "json",
    trigger="",
    opening="[",
    separator=",",
    closing="]",
    arguments_key="parameters",
    json_style=COMPACT_JSON,
)


# The formats a model's settings may name (`tool_call_format`), as the template reading names them.
TOOL_FORMATS = {fmt.name: fmt for fmt in (HERMES, LLAMA3_JSON, MISTRAL)}


def template_format(template: str) -> ToolFormat | None:
    """The tool-call format a chat template's text declares; None where it shows no tool calls."""
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or '"parameters": ' in template:
        # Llama 3.1's template refuses a turn of several calls: one call per turn
        single = "only supports single tool-call" in template
        return LLAMA3_JSON if not single else _single(LLAMA3_JSON)
    return None


def _single(fmt: ToolFormat) -> ToolFormat:
    return ToolFormat(**{**fmt.__dict__, "parallel": False})


def _literal(text: str) -> str:
    return json.dumps(text)


def _regex_literal(text: str) -> str:
    """`text` as a literal inside a Lark /regex/ (Rust's syntax: `\\<` would be a word boundary,
    so only metacharacters are escaped)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)


def calls_grammar(
    fmt: ToolFormat,
    functions: Sequence[FunctionSpec],
    *,
    forced: bool,
    parallel: bool,
    trigger_token: int | None,
) -> Grammar:
    """The grammar of an output in `fmt`: free text, or (`forced`: no text, at least one call)
    calls of `functions` after the trigger; one call only unless `parallel`. `trigger_token`: the
    trigger's id where it is one special token of the vocabulary (text can never spell it)."""
    lines = ["%llguidance {}"]
    trigger = (
        (f"<[{trigger_token}]>" if trigger_token is not None else _literal(fmt.trigger))
        if fmt.trigger
        else ""
    )
    if forced:
        lines.append(f"start: {trigger} section")
    elif fmt.bare_start:
        lines.append(f"start: TEXT | {trigger}? section" if trigger else "start: TEXT | section")
        no_trigger = f" & ~/{_regex_literal(fmt.trigger)}(.|\\n)*/" if trigger_token is None else ""
        lines.append(f"TEXT: /([^{{](.|\\n)*)?/{no_trigger}")
    elif trigger_token is not None:
        lines += [f"start: TEXT? ({trigger} section)?", "TEXT: /(.|\\n)+/"]
    else:
        escaped = _regex_literal(fmt.trigger)
        lines += [
            "start: TEXT | head section",
            f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{escaped}(.|\\n)*/",
            # lazy: the head ends at the trigger's first occurrence, so the text before it has none
            f"head[lazy]: /(.|\\n)*{escaped}/",
        ]
    separator = _literal(fmt.separator)
    if trigger_token is not None and fmt.trigger in fmt.separator:  # the next call's opening token
        separator = f" {trigger} ".join(_literal(part) for part in fmt.separator.split(fmt.trigger))
    repeat = f" ({separator} call)*" if parallel and fmt.parallel else ""
    opening = _literal(fmt.opening) + " " if fmt.opening else ""
    closing = " " + _literal(fmt.closing) if fmt.closing else ""
    lines.append(f"section: {opening}call{repeat}{closing}")
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(functions))))
    for i, function in enumerate(functions):
        schema = json.dumps(arguments_schema(function, fmt.json_style or COMPACT_JSON))
        lines.append(f'call_{i}: {_literal(fmt.call_head(function.name))} %json {schema} "}}"')
    return Grammar("lark", "\n".join(lines) + "\n")


def arguments_schema(function: FunctionSpec, style: dict[str, Any]) -> dict[str, Any]:
    """The function's parameters as a schema of its own (its `$defs` at its root), JSON spaced by
    `style` unless the schema's own "x-guidance" says otherwise."""
    parameters = function_parameters(function)
    own = parameters.get("x-guidance", {})
    # a schema's own options that are no object are the grammar engine's to refuse
    return {**parameters, "x-guidance": {**style, **own} if isinstance(own, dict) else own}


def function_parameters(function: FunctionSpec) -> dict[str, Any]:
    """The schema a call's arguments are held to: the function's `parameters`, each object that
    lists its properties closed to others unless it says (`additionalProperties` or
    `unevaluatedProperties`), as vLLM's and SGLang's default grammar engine (xgrammar's strict
    mode) holds them; open, a small model writes keys of its own until `max_tokens`."""
    return NO_ARGUMENTS if function.parameters is None else _closed(function.parameters)


_DATA_KEYS = frozenset({"const", "enum", "default", "examples", "x-guidance"})  # values, not schemas
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _closed(schema: Any) -> Any:
    """A copy of `schema` with its objects closed as `function_parameters` says, walked with a
    stack: a body may nest deeper than Python recurses (msgspec decodes it in C)."""
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(schema, root, 0)]  # (a value, its copy's parent, its key)
    while stack:
        value, parent, key = stack.pop()
        if isinstance(value, list):
            parent[key] = copied = [None] * len(value)
            stack.extend((item, copied, i) for i, item in enumerate(value))
        elif isinstance(value, dict):
            parent[key] = closed = dict.fromkeys(value)  # the keys in their order, filled below
            for name, part in value.items():
                if name in _SCHEMA_MAPS and isinstance(part, dict):  # names to schemas: each one's
                    closed[name] = schemas = dict.fromkeys(part)
                    stack.extend((item, schemas, field) for field, item in part.items())
                elif name in _DATA_KEYS or name == "allOf":
                    # an allOf's branches are parts of one object: closing each would refuse the others' keys
                    closed[name] = part
                else:
                    stack.append((part, closed, name))
            lists_properties = "properties" in value or "patternProperties" in value
            if (
                lists_properties
                and not {"additionalProperties", "unevaluatedProperties", "allOf"} & value.keys()
            ):
                closed["additionalProperties"] = False
        else:
            parent[key] = value
    return root[0]
