"""Grammars for bench/grammar_engines.py, each with one instance it must accept.

The instance steers the decode simulation (a stream takes the instance's next token whenever its mask
allows it), so every stream reaches an accepting state in a bounded number of steps, and a mask that
rejects a valid instance shows up as a divergence.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema


@dataclass(frozen=True)
class JsonCase:
    name: str
    schema: dict[str, Any]
    instance: Any


@dataclass(frozen=True)
class RegexCase:
    name: str
    pattern: str
    instance: str


_ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string"},
        "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    },
    "required": ["street", "city"],
}
_ITEM = {
    "type": "object",
    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
    "required": ["sku", "qty"],
}


def _wide_schema(width: int) -> JsonCase:
    kinds = ("string", "integer", "number", "boolean")
    samples: dict[str, Any] = {"string": "v", "integer": 7, "number": 1.5, "boolean": True}
    properties = {f"field_{i:02d}": {"type": kinds[i % 4]} for i in range(width)}
    instance = {name: samples[spec["type"]] for name, spec in properties.items()}
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    return JsonCase(f"wide_{width}", schema, instance)


JSON_CASES: list[JsonCase] = [
    JsonCase(
        "flat_1",
        {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        {"ok": True},
    ),
    JsonCase(
        "flat_3",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "score": {"type": "number"},
            },
            "required": ["name", "age", "score"],
        },
        {"name": "Ada", "age": 36, "score": 9.5},
    ),
    JsonCase(
        "enum",
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}},
            "required": ["color"],
        },
        {"color": "green"},
    ),
    JsonCase(
        "const_and_null",
        {
            "type": "object",
            "properties": {"kind": {"const": "event"}, "parent": {"type": "null"}},
            "required": ["kind", "parent"],
        },
        {"kind": "event", "parent": None},
    ),
    JsonCase(
        "string_bounds",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 4}},
            "required": ["code"],
        },
        {"code": "ab"},
    ),
    JsonCase(
        "pattern",
        {
            "type": "object",
            "properties": {"ticket": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
            "required": ["ticket"],
        },
        {"ticket": "ABC-1234"},
    ),
    JsonCase(
        "format_date",
        {
            "type": "object",
            "properties": {"born": {"type": "string", "format": "date"}},
            "required": ["born"],
        },
        {"born": "1815-12-10"},
    ),
    JsonCase(
        "formats_mixed",
        {
            "type": "object",
            "properties": {
                "email": {"type": "string", "format": "email"},
                "at": {"type": "string", "format": "date-time"},
                "id": {"type": "string", "format": "uuid"},
            },
            "required": ["email", "at", "id"],
        },
        {
            "email": "ada@example.org",
            "at": "2024-05-01T12:30:00Z",
            "id": "123e4567-e89b-12d3-a456-426614174000",
        },
    ),
    JsonCase(
        "int_range",
        {
            "type": "object",
            "properties": {"pct": {"type": "integer", "minimum": 0, "maximum": 100}},
            "required": ["pct"],
        },
        {"pct": 42},
    ),
    JsonCase(
        "optional_mix",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "nick": {"type": "string"},
                "bio": {"type": "string"},
                "admin": {"type": "boolean"},
            },
            "required": ["id"],
        },
        {"id": 5, "admin": False},
    ),
    JsonCase(
        "array_of_strings",
        {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5}
            },
            "required": ["tags"],
        },
        {"tags": ["a", "bc"]},
    ),
    JsonCase(
        "nested_2",
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "address": _ADDRESS},
            "required": ["address"],
        },
        {"name": "Bo", "address": {"street": "Main St 1", "city": "Oslo", "zip": "01234"}},
    ),
    JsonCase(
        "array_of_objects",
        {"type": "object", "properties": {"items": {"type": "array", "items": _ITEM}}, "required": ["items"]},
        {"items": [{"sku": "X1", "qty": 2}, {"sku": "Y2", "qty": 1}]},
    ),
    JsonCase(
        "any_of",
        {
            "type": "object",
            "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]}},
            "required": ["value"],
        },
        {"value": "eight"},
    ),
    JsonCase(
        "one_of_tagged",
        {
            "type": "object",
            "properties": {
                "shape": {
                    "oneOf": [
                        {
                            "type": "object",
                            "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                            "required": ["kind", "r"],
                        },
                        {
                            "type": "object",
                            "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
                            "required": ["kind", "side"],
                        },
                    ]
                }
            },
            "required": ["shape"],
        },
        {"shape": {"kind": "square", "side": 2}},
    ),
    JsonCase(
        "refs_defs",
        {
            "type": "object",
            "$defs": {"address": _ADDRESS},
            "properties": {"home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"}},
            "required": ["home"],
        },
        {"home": {"street": "A 1", "city": "B"}, "work": {"street": "C 2", "city": "D"}},
    ),
    JsonCase(
        "nested_3",
        {
            "type": "object",
            "properties": {
                "order": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "customer": {
                            "type": "object",
                            "properties": {"name": {"type": "string"}, "address": _ADDRESS},
                            "required": ["name", "address"],
                        },
                        "lines": {"type": "array", "items": _ITEM, "minItems": 1},
                    },
                    "required": ["id", "customer", "lines"],
                }
            },
            "required": ["order"],
        },
        {
            "order": {
                "id": "o-1",
                "customer": {"name": "Cy", "address": {"street": "S 3", "city": "Rome"}},
                "lines": [{"sku": "Z", "qty": 3}],
            }
        },
    ),
    JsonCase(
        "additional_props",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"a": 1, "b": 2},
    ),
    _wide_schema(20),
    _wide_schema(50),
]

REGEX_CASES: list[RegexCase] = [
    RegexCase("iso_date", r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "2024-02-29"),
    RegexCase(
        "email", r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}", "ada.l@math.example.org"
    ),
    RegexCase("signed_decimal", r"[+-]?(0|[1-9]\d*)(\.\d+)?", "-12.375"),
]

ARITHMETIC_INSTANCE = "(1+23)*4-5/6"
# xgrammar reads GBNF-style EBNF with `root` as the start rule.
ARITHMETIC_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""
# llguidance reads Lark with `start` as the start rule; upper-case names are lexemes.
ARITHMETIC_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
ARITHMETIC_PATTERN = r"[0-9()+\-*/]+"


@dataclass(frozen=True)
class FeatureProbe:
    """Whether a library compiles `source` and accepts `text`, against what JSON Schema / `re` say."""

    label: str
    kind: str  # "json" | "regex"
    source: Any
    text: str
    valid: bool


def _one(spec: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"v": spec}, "required": ["v"]}


_LOOKAHEAD = r"^(?=.*[0-9])[a-z0-9]+$"
# A bad schema and a regex feature outside regular languages come first: their messages are quoted.
FEATURE_PROBES: list[FeatureProbe] = [
    FeatureProbe(
        "invalid schema: minimum 'zero'", "json", _one({"type": "integer", "minimum": "zero"}), "", False
    ),
    FeatureProbe("regex with lookahead", "regex", r"(?=.*\d)[a-z0-9]{8}", "abcdefg1", True),
    FeatureProbe(
        "pattern with lookahead, 'abc'",
        "json",
        _one({"type": "string", "pattern": _LOOKAHEAD}),
        '{"v": "abc"}',
        False,
    ),
    FeatureProbe(
        "format date, month 13",
        "json",
        _one({"type": "string", "format": "date"}),
        '{"v": "1815-13-10"}',
        False,
    ),
    FeatureProbe("maximum 100, 101", "json", _one({"type": "integer", "maximum": 100}), '{"v": 101}', False),
    FeatureProbe("multipleOf 5, 7", "json", _one({"type": "integer", "multipleOf": 5}), '{"v": 7}', False),
    FeatureProbe(
        "uniqueItems, [1, 1]",
        "json",
        _one({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
        '{"v": [1, 1]}',
        False,
    ),
    FeatureProbe("not string, 1", "json", _one({"not": {"type": "string"}}), '{"v": 1}', True),
    FeatureProbe("undeclared property", "json", {"type": "object"}, '{"a": 1}', True),
    FeatureProbe(
        'if/then, {"a": 1, "b": 2}',
        "json",
        {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
        '{"a": 1, "b": 2}',
        True,
    ),
]


@dataclass(frozen=True)
class Grammar:
    """One request's grammar: what each library compiles, the instance that steers decoding, a check."""

    name: str
    kind: str  # "json" | "regex" | "ebnf"
    source: Any  # schema dict, regex, or {"xgrammar": ebnf, "llguidance": lark}
    instance_text: str
    is_valid: Callable[[str], bool]


def _json_valid(schema: dict[str, Any]) -> Callable[[str], bool]:
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER

    def check(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema, format_checker=checker)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    return check


def _arithmetic_valid(text: str) -> bool:
    if not re.fullmatch(ARITHMETIC_PATTERN, text):
        return False
    try:
        compile(text, "<grammar>", "eval")
    except SyntaxError:
        return False
    return True


def all_grammars() -> list[Grammar]:
    grammars = [
        Grammar(c.name, "json", c.schema, json.dumps(c.instance), _json_valid(c.schema)) for c in JSON_CASES
    ]
    grammars += [
        Grammar(
            f"re:{c.name}", "regex", c.pattern, c.instance, lambda t, p=c.pattern: bool(re.fullmatch(p, t))
        )
        for c in REGEX_CASES
    ]
    arithmetic = {"xgrammar": ARITHMETIC_EBNF, "llguidance": ARITHMETIC_LARK}
    grammars.append(Grammar("ebnf:arithmetic", "ebnf", arithmetic, ARITHMETIC_INSTANCE, _arithmetic_valid))
    return grammars
