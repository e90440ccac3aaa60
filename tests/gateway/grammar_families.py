"""Generated grammars that are deep or wide in every way the grammar engine reads them: `$ref`
chains, nested objects and arrays, wide anyOf and enums, long Lark rule chains, big GBNF, giant
regex alternations. Each is (name, request fields of /v1/chat/completions)."""

from __future__ import annotations

import json
from typing import Any


def ref_chain(depth: int, leaf: dict[str, Any] | None = None) -> dict[str, Any]:
    """A JSON schema whose `$ref`s lead `depth` objects deep (1,000: ~110 KB) to `leaf`."""
    defs: dict[str, Any] = {
        f"node{i:05d}": {
            "type": "object",
            "properties": {"next": {"$ref": f"#/$defs/node{i + 1:05d}"}},
            "required": ["next"],
            "additionalProperties": False,
        }
        for i in range(depth)
    }
    defs[f"node{depth:05d}"] = leaf or {"type": "integer"}
    return {"$ref": "#/$defs/node00000", "$defs": defs}


def nested(depth: int, container: str) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        if container == "object":
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        else:
            schema = {"type": "array", "items": schema, "minItems": 1}
    return schema


def lark_chain(rules: int, tag: str = "") -> str:
    """`rules` Lark rules, each the next one's only use (3,000: a stack overflow in llguidance)."""
    lines = ["start: r0", *(f"r{i}: r{i + 1}" for i in range(rules)), f'r{rules}: "x{tag}"']
    return "\n".join(lines)


def gbnf_chain(rules: int, tag: str = "") -> str:
    """GBNF whose conversion to Lark is quadratic in its rules (1,300: ~56 KB, ~1 s)."""
    lines = [
        "root ::= r0",
        *(f'r{i} ::= "a{i}{tag}" r{i + 1} | "b{i}" | [0-9]+ "c"' for i in range(rules)),
        f'r{rules} ::= "x"',
    ]
    return "\n".join(lines)


def schema_request(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "generated", "schema": schema}}
    }


def grammar_request(grammar: str) -> dict[str, Any]:
    return {"structured_outputs": {"grammar": grammar}}


def family() -> list[tuple[str, dict[str, Any]]]:
    cases: list[tuple[str, dict[str, Any]]] = []
    for depth in (10, 300, 1000, 3000):
        cases.append((f"ref-chain-{depth}", schema_request(ref_chain(depth))))
    for depth in (50, 400):
        cases.append((f"nested-objects-{depth}", schema_request(nested(depth, "object"))))
        cases.append((f"nested-arrays-{depth}", schema_request(nested(depth, "array"))))
    for width in (2000, 20000):
        branches = [
            {"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]}
            for i in range(width)
        ]
        cases.append((f"any-of-{width}", schema_request({"anyOf": branches})))
    cases.append(("enum-50000", schema_request({"enum": [f"value {i}" for i in range(50000)]})))
    for rules in (700, 1500, 3000, 10000):
        cases.append((f"lark-chain-{rules}", grammar_request(lark_chain(rules))))
    for rules in (700, 2000, 4000):
        cases.append((f"gbnf-{rules}", grammar_request(gbnf_chain(rules))))
    for words in (1000, 20000):
        alternation = "(" + "|".join(f"w{i}x" for i in range(words)) + ")"
        cases.append((f"regex-alternation-{words}", {"structured_outputs": {"regex": alternation}}))
    cases.append(("choice-50000", {"structured_outputs": {"choice": [f"o{i}" for i in range(50000)]}}))
    return cases


def body_size(fields: dict[str, Any]) -> int:
    return len(json.dumps(fields))
