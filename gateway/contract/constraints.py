"""What the settings and the routes' own checks allow, written into the request schemas of the
OpenAPI document: limits from the settings (n, logprobs, max_tokens, rows, ...) as maxima, and the
routes' checks (nothing empty, best_of equal to n, ...) as constraints, so that the document
describes exactly what the running server accepts."""

from __future__ import annotations

from typing import Any

from gateway.openai.unhonoured import NEUTRAL as NEUTRAL_SAMPLING
from gateway.schemas.common import StructuredOutputs
from gateway.settings import Settings


def constrain(schemas: dict[str, Any], settings: Settings) -> None:
    """The limits of `settings` and the routes' checks, into `schemas` (msgspec's, by name)."""
    _apply_limits(schemas, settings)
    _apply_route_checks(schemas, settings)


def _apply_limits(schemas: dict[str, Any], settings: Settings) -> None:
    """Write the configured limits into the schemas as maxima."""
    limits = settings.limits

    def cap(schema: str, prop: str, maximum: int) -> None:
        target = schemas[schema]["properties"][prop]
        options = target.get("anyOf", [target])
        for option in options:
            if option.get("type") == "integer":
                option["maximum"] = maximum
            if option.get("type") == "array":
                option["maxItems"] = maximum
        if isinstance(target.get("default"), int) and target["default"] > maximum:
            # the route applies the default as if sent, and refuses it: the field must be given
            schemas[schema]["properties"][prop] = next(o for o in options if o.get("type") == "integer")
            schemas[schema]["required"].append(prop)

    cap("CompletionRequest", "n", limits.max_n)
    cap("ChatCompletionRequest", "n", limits.max_n)
    cap("CompletionRequest", "logprobs", limits.max_top_logprobs)
    cap("ChatCompletionRequest", "top_logprobs", limits.max_top_logprobs)
    cap("CompletionRequest", "max_tokens", limits.max_tokens)
    cap("ChatCompletionRequest", "max_tokens", limits.max_tokens)
    cap("ChatCompletionRequest", "max_completion_tokens", limits.max_tokens)
    for schema, prop in (
        ("CompletionRequest", "max_tokens"),
        ("ChatCompletionRequest", "max_tokens"),
        ("ChatCompletionRequest", "max_completion_tokens"),
    ):
        schemas[schema]["properties"][prop]["description"] = CONTEXT_LIMIT


# The one limit only the running model knows: the document states it in words.
CONTEXT_LIMIT = (
    "At most `limits.max_tokens`; and the prompt's tokens plus these must fit the model's context "
    "(`max_model_len` of GET /v1/models/{model}), else 400 `context_length_exceeded`."
)
# Standard base64 (padded) of a whole number of little-endian int32 ids, as the route decodes it.
PACKED_IDS_BASE64 = "^(?:[A-Za-z0-9+/]{16})*(?:[A-Za-z0-9+/]{6}==|[A-Za-z0-9+/]{11}=)?$"


# vLLM's sampling fields the gateway refuses unless they change nothing (gateway/openai/unhonoured.py)
UNHONOURED = "vLLM's; not supported: only the value that changes nothing (docs/api.md, Sampling fields)."


def _only(values: list[Any]) -> dict[str, Any]:
    if values == [[]]:
        return {"type": "array", "maxItems": 0}
    return {"const": values[0]} if len(values) == 1 else {"enum": values}


def _text() -> dict[str, Any]:
    return {"type": "string", "minLength": 1}


def _token_ids() -> dict[str, Any]:
    return {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}


def _inputs(max_items: int) -> dict[str, Any]:
    """OpenAI's four input forms as gateway/prompts.py takes them: one kind per list, nothing empty;
    a token-id list is one input, the limit counts the strings or lists of a list."""
    return {
        "anyOf": [
            _text(),
            {"type": "array", "items": _text(), "minItems": 1, "maxItems": max_items},
            _token_ids(),
            {"type": "array", "items": _token_ids(), "minItems": 1, "maxItems": max_items},
        ]
    }


def _null_or(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}], "default": None}


def _apply_route_checks(schemas: dict[str, Any], settings: Settings) -> None:
    """Write what the routes check beyond the types (gateway/prompts.py, gateway/generation/ and
    the routes themselves) into the schemas, so that a request the document allows is served. Only
    what each model decides stays out: prompts within its context (GET /v1/models/{model}), texts its
    tokenizer has a token for (its vocabulary); token ids below its vocab_size are stated by the
    running server (gateway/contract/vocabulary.py)."""
    limits = settings.limits
    completion, chat = schemas["CompletionRequest"], schemas["ChatCompletionRequest"]
    completion["properties"]["prompt"] = _inputs(limits.max_prompts)
    dense_input = _inputs(limits.max_rows)
    dense_input["anyOf"].append({"$ref": "#/components/schemas/PackedTokenIds"})
    schemas["NextTokenLogprobsRequest"]["properties"]["input"] = dense_input
    packed_ids = schemas["PackedTokenIds"]["properties"]["ids"]
    packed_ids.update(pattern=PACKED_IDS_BASE64, minLength=8)  # at least one id
    lengths = schemas["PackedTokenIds"]["properties"]["lengths"]
    lengths.update(minItems=1, maxItems=limits.max_rows)
    for request in (completion, chat):
        stop = _null_or(_text())
        stop["anyOf"].insert(1, {"type": "array", "items": _text(), "maxItems": limits.max_stop})
        request["properties"]["stop"] = stop
    for request in (completion, chat, schemas["SglangSamplingParams"]):
        # keys in ASCII digits: a token id, below the model's vocab_size
        bias = {
            "type": "object",
            "propertyNames": {"type": "string", "pattern": "^[0-9]+$", "maxLength": 20},
            "additionalProperties": {"type": "number", "minimum": -100.0, "maximum": 100.0},
        }
        request["properties"]["logit_bias"] = _null_or(bias)
    chat["properties"]["messages"]["minItems"] = 1
    schemas["TokenizeRequest"]["properties"]["messages"]["anyOf"][0]["minItems"] = 1
    completion["properties"]["suffix"] = {
        **_null_or({"type": "string", "maxLength": 0}),
        "description": "Not supported: empty or null only.",
    }
    completion["properties"]["best_of"]["description"] = "Equal to n when given."
    chat["properties"]["best_of"]["description"] = "Equal to n when given."
    for request in (completion, chat):
        for field, values in NEUTRAL_SAMPLING.items():
            neutral = [v for v in values if v is not None]
            only = {"type": "null"} if not neutral else _null_or(_only(neutral))
            request["properties"][field] = {**only, "description": UNHONOURED}
        request["properties"]["top_k"]["description"] = "vLLM's: 1 is greedy sampling; -1 and 0 every token."
        request["properties"]["min_tokens"]["description"] = "vLLM's; beyond max_tokens: max_tokens."
        words = request["properties"]["bad_words"]["anyOf"][0]
        words["maxItems"] = limits.max_bad_words
        keep = {"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1}]}
        request["properties"]["truncate_prompt_tokens"] = {
            **_null_or(keep),
            "description": "vLLM's: the prompt's last k tokens; -1: as many as the model's context.",
        }
    # best_of equal to n (completions and chat). Exclusive options (each given best_of its own), as
    # `oneOf`: schemathesis' canonical form gives up on an `anyOf` of max_n options beside the other
    # rules, and then never generates a request.
    completion_rule = {
        "oneOf": [
            {"properties": {"best_of": {"type": "null"}}},
            {"properties": {"n": {"enum": [1, None]}, "best_of": {"const": 1}}, "required": ["best_of"]},
            *(
                {"properties": {"n": {"const": n}, "best_of": {"const": n}}, "required": ["n", "best_of"]}
                for n in range(2, limits.max_n + 1)
            ),
        ]
    }
    chat_rule = {
        "anyOf": [
            {"properties": {"top_logprobs": {"type": "null"}}},
            {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
        ]
    }
    for request, rules in ((completion, [completion_rule]), (chat, [chat_rule, completion_rule])):
        streamed_only = [  # stream_options only with stream: true, as OpenAI's
            {"properties": {"stream_options": {"type": "null"}}},
            {"properties": {"stream": {"const": True}}, "required": ["stream"]},
        ]
        request["allOf"] = [*rules, {"anyOf": streamed_only}]
    _apply_grammar_checks(schemas)
    schemas["NextTokenLogprobsRequest"]["anyOf"] = [
        {"properties": {"shared_memory": {"type": "null"}}},
        {"properties": {"layout": {"const": "matrix"}}, "required": ["layout"]},
    ]
    schemas["SglangSamplingParams"]["properties"]["top_k"] = {
        **_null_or({"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1}]}),
        "description": "-1: every token; 1: greedy sampling.",
    }
    generate = schemas["GenerateRequest"]["properties"]
    generate["image_data"] = {"type": "null", "default": None, "description": "Not supported: null only."}
    texts = {"type": "array", "items": _text(), "minItems": 1, "maxItems": limits.max_prompts}
    generate["text"] = _null_or({"anyOf": [_text(), texts]})
    generate["input_ids"] = _null_or(
        {"anyOf": [_token_ids(), {**_token_ids(), "items": _token_ids(), "maxItems": limits.max_prompts}]}
    )
    named_ids = {**_token_ids(), "minItems": 0}  # [] names none
    generate["token_ids_logprob"] = _null_or(
        {
            "anyOf": [
                named_ids,
                {"type": "array", "items": named_ids, "minItems": 1, "maxItems": limits.max_prompts},
            ]
        }
    )
    schemas["TokenizeRequest"]["oneOf"] = [
        {"properties": {"prompt": {"type": "string"}}, "required": ["prompt"]},
        {"properties": {"messages": {"type": "array"}}, "required": ["messages"]},
    ]


GRAMMAR_FIELDS = ("response_format", "structured_outputs", "tools", "tool_choice")


def _apply_grammar_checks(schemas: dict[str, Any]) -> None:
    """gateway/generation/structured.py and gateway/openai/tools.py: one constraint per request
    (structured_outputs naming exactly one; not both it and a JSON response_format; no tool call
    beside either), and a tool_choice that asks for a call only with tools; "auto" with tools (its
    default) is served by a model whose chat template shows a tool-call format (the default model's
    does; `tool_call_format`), else a 400. Whether a grammar compiles is the grammar engine's to
    say (a 400 with its message)."""
    fields = StructuredOutputs.__struct_fields__
    schemas["StructuredOutputs"]["anyOf"] = [
        {
            "properties": {
                **{other: {"type": "null"} for other in fields if other not in (field, "json_object")},
                **({} if field == "json_object" else {"json_object": {"enum": [None, False]}}),
                field: {"const": True} if field == "json_object" else {"not": {"type": "null"}},
            },
            "required": [field],
        }
        for field in fields
    ]
    plain_text = {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"type": {"const": "text"}}}]}
    one_grammar = {
        "anyOf": [
            {"properties": {"structured_outputs": {"type": "null"}}},
            {"properties": {"response_format": plain_text}},
        ]
    }
    no_tools = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}
    calls = {
        "anyOf": [
            {"properties": {"tools": no_tools, "tool_choice": {"enum": [None, "none", "auto"]}}},
            {"properties": {"tool_choice": {"const": "none"}}, "required": ["tool_choice"]},
            {
                "properties": {
                    "tools": {"type": "array", "minItems": 1},
                    "tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]},
                    "structured_outputs": {"type": "null"},
                    "response_format": plain_text,
                },
                "required": ["tools", "tool_choice"],
            },
            {
                "properties": {
                    "tools": {"type": "array", "minItems": 1},
                    "tool_choice": {"enum": [None, "auto"]},
                    "structured_outputs": {"type": "null"},
                    "response_format": plain_text,
                },
                "required": ["tools"],
            },
        ]
    }
    schemas["CompletionRequest"]["allOf"].append(one_grammar)
    schemas["ChatCompletionRequest"]["allOf"] += [one_grammar, calls]
