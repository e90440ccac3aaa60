"""Grammars the structured-output tests hold the real default model to: 20 JSON schemas of
increasing size (nested objects, arrays, enums, anyOf, string patterns), regexes (dates, emails,
numbers) and an arithmetic grammar in EBNF (GBNF).

Strings, arrays and integers are bounded (maxLength, maxItems, maximum), as a schema must be for
greedy output of a small model to end within max_tokens: a grammar constrains what comes, not when
it stops, and an output cut at max_tokens is a prefix that validates against nothing.
"""

from __future__ import annotations

from typing import Any


def _s(n: int = 12, **more: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": n, **more}


def _i(top: int = 999) -> dict[str, Any]:
    return {"type": "integer", "minimum": 0, "maximum": top}


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def _list(items: dict[str, Any], most: int = 3) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": 1, "maxItems": most}


_ADDRESS = _obj({"street": _s(16), "city": _s(), "zip": _s(5, pattern="^[0-9]{5}$")})
_ITEM = _obj({"sku": _s(8, pattern="^[A-Z]{2}[0-9]{3}$"), "qty": _i(50)})
_COLOR = {"type": "string", "enum": ["red", "green", "blue"]}

SCHEMAS: list[dict[str, Any]] = [
    _obj({"ok": {"type": "boolean"}}),
    _obj({"name": _s()}),
    _obj({"color": _COLOR}),
    _obj({"name": _s(), "age": _i(120)}),
    _obj({"year": _i(2100), "month": _i(12), "leap": {"type": "boolean"}}),
    _obj({"tags": _list(_s(8))}),
    _obj({"id": {"anyOf": [_i(), _s(8)]}}),
    _obj({"code": _s(6, pattern="^[A-Z]{3}-[0-9]{2}$"), "color": _COLOR}),
    _obj({"name": _s(), "address": _ADDRESS}),
    _obj({"items": _list(_ITEM), "paid": {"type": "boolean"}}),
    _obj({"scores": _list(_i(100), 4), "grade": {"enum": ["A", "B", "C", "D"]}}),
    _obj({"value": {"anyOf": [{"type": "boolean"}, {"type": "null"}, _obj({"x": _i(9)})]}}),
    _obj(
        {
            "user": _obj({"name": _s(), "email": _s(24, pattern="^[a-z]{1,8}@[a-z]{1,8}\\.com$")}),
            "active": {"type": "boolean"},
        }
    ),
    _obj({"title": _s(20), "authors": _list(_obj({"first": _s(8), "last": _s(10)}), 2), "year": _i(2100)}),
    _obj({"shape": {"anyOf": [_obj({"circle": _i(99)}), _obj({"square": _i(99)})]}, "color": _COLOR}),
    _obj({"matrix": _list(_list(_i(9), 3), 3)}),
    _obj(
        {"order": _obj({"id": _i(), "items": _list(_ITEM, 2), "ship_to": _ADDRESS}), "note": _s(16)},
        ["order"],
    ),
    _obj(
        {
            "event": _s(16),
            "date": _s(10, pattern="^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"),
            "guests": _list(_obj({"name": _s(10), "rsvp": {"enum": ["yes", "no", "maybe"]}}), 3),
        }
    ),
    _obj(
        {
            "company": _s(16),
            "employees": _list(
                _obj({"name": _s(10), "role": {"enum": ["dev", "ops", "pm"]}, "skills": _list(_s(8), 2)}), 2
            ),
            "hq": _ADDRESS,
        }
    ),
    _obj(
        {
            "library": _obj(
                {
                    "name": _s(16),
                    "books": _list(
                        _obj(
                            {
                                "title": _s(16),
                                "isbn": _s(13, pattern="^[0-9]{13}$"),
                                "tags": _list(_COLOR, 2),
                                "rating": {"anyOf": [_i(5), {"type": "null"}]},
                            }
                        ),
                        2,
                    ),
                }
            ),
            "open": {"type": "boolean"},
            "branches": _list(_ADDRESS, 2),
        }
    ),
]

PROMPTS = [
    "Answer in JSON.",
    "Describe a person you know as a JSON object.",
    "Return a small JSON record for a shop.",
    "Fill in the JSON object with plausible values.",
]

REGEXES = {  # a regex and a request that asks for a matching text
    "date": (r"\d{4}-\d{2}-\d{2}", "When did the first person walk on the moon? Answer with a date."),
    "email": (r"[a-z]{1,10}\.[a-z]{1,10}@[a-z]{1,10}\.(com|org)", "Write an email address for Ada Lovelace."),
    "number": (r"-?[0-9]{1,6}(\.[0-9]{1,3})?", "What is twelve times eleven?"),
}

ARITHMETIC = r"""
root   ::= expr
expr   ::= term (("+" | "-") term){0,3}
term   ::= factor (("*" | "/") factor){0,3}
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]{0,2}
"""
