"""What the served models' vocabularies allow, written into the OpenAPI document: token ids below
the vocabulary's size, and `logit_bias` keys that name such ids. The running server states it in
`/openapi.json` once its models have loaded; the committed document, built without a model, states
only that ids are non-negative."""

from __future__ import annotations

from typing import Any

# The request fields that hold token ids (alone, in lists, or in lists of lists).
TOKEN_ID_FIELDS = (
    "prompt",
    "input",
    "tokens",
    "input_ids",
    "token_ids_logprob",
    "stop_token_ids",
    "allowed_token_ids",
)
REQUESTS = (
    "CompletionRequest",
    "ChatCompletionRequest",
    "NextTokenLogprobsRequest",
    "TokenizeRequest",
    "DetokenizeRequest",
    "GenerateRequest",
    "SglangSamplingParams",
)
LOGIT_BIAS_HOLDERS = ("CompletionRequest", "ChatCompletionRequest", "SglangSamplingParams")


def decimal_below(limit: int) -> str:
    """A regular expression for the decimal numbers in [0, limit), without leading zeros."""
    top = str(limit - 1)
    if len(top) == 1:
        return f"[0-{top}]"
    options = ["[0-9]"] + [f"[1-9][0-9]{{{n - 1}}}" for n in range(2, len(top))]
    for i, digit in enumerate(top):
        low = 1 if i == 0 else 0
        if int(digit) > low:
            rest = len(top) - i - 1
            options.append(top[:i] + f"[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    options.append(top)
    return "(?:" + "|".join(options) + ")"


def _cap_token_ids(schema: Any, maximum: int) -> None:
    """Every token id (an integer >= 0) in `schema` at most `maximum`."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer" and schema.get("minimum") == 0:
            schema["maximum"] = maximum
        for value in schema.values():
            _cap_token_ids(value, maximum)
    elif isinstance(schema, list):
        for value in schema:
            _cap_token_ids(value, maximum)


def bound_by_vocabulary(schemas: dict[str, Any], vocab_size: int) -> None:
    """Token ids below `vocab_size`, in every field that holds them; `logit_bias` keys likewise
    (leading zeros allowed: the routes read "007" as 7)."""
    for name in REQUESTS:
        properties = schemas[name]["properties"]
        for field in TOKEN_ID_FIELDS:
            if field in properties:
                _cap_token_ids(properties[field], vocab_size - 1)
    for name in LOGIT_BIAS_HOLDERS:
        bias = schemas[name]["properties"]["logit_bias"]
        for option in bias.get("anyOf", [bias]):
            if option.get("type") == "object":
                option["propertyNames"]["pattern"] = f"^0*{decimal_below(vocab_size)}$"
