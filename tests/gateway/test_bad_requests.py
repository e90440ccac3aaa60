"""Bad requests against the real gateway: every one gets a 4xx with OpenAI's error object, never a
500, and the server keeps serving afterwards. Real-model work stays at max_tokens <= 2."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from http.client import HTTPResponse
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL

pytestmark = pytest.mark.slow

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GENERATE = "/generate"
VOCAB = 49152  # SmolLM2's vocabulary
CONTEXT = 8192  # SmolLM2's context length

INVALID = "invalid_request_error"
NOT_FOUND = "model_not_found"
TOO_LONG = "context_length_exceeded"


def completion(**fields: Any) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 1, **fields}


def chat(**fields: Any) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1, **fields}


def raw(text: str) -> bytes:
    return text.encode()


def deep_tool_chat(depth: int) -> bytes:
    """A chat that must call a tool whose one parameter's schema is `depth` anyOf's deep."""
    schema = b'{"anyOf":[' * depth + b'{"type":"string"}' + b"]}" * depth
    parameters = b'{"type":"object","properties":{"a":' + schema + b"}}"
    tools = b'[{"type":"function","function":{"name":"f","parameters":' + parameters + b"}}]"
    return json.dumps(chat(tool_choice="required")).encode()[:-1] + b', "tools": ' + tools + b"}"


@dataclass(frozen=True)
class Case:
    endpoint: str
    body: dict | bytes  # bytes are sent as they are, with Content-Type application/json
    status: int
    param: str | None  # the error's `param`, checked exactly
    message: str  # a substring of the error's `message`
    code: str | None = None
    error_type: str = INVALID


CASES = {
    # unknown models and adapters: 404 model_not_found on both endpoints
    "completions-unknown-model": Case(
        COMPLETIONS,
        completion(model="no-such-model"),
        404,
        "model",
        "'no-such-model' does not exist",
        NOT_FOUND,
    ),
    "chat-unknown-model": Case(
        CHAT, chat(model="no-such-model"), 404, "model", "'no-such-model' does not exist", NOT_FOUND
    ),
    "completions-unknown-base-with-adapter": Case(
        COMPLETIONS,
        completion(model="no-such-model:lora"),
        404,
        "model",
        "'no-such-model:lora' does not exist",
        NOT_FOUND,
    ),
    "chat-unknown-base-with-adapter": Case(
        CHAT, chat(model="no-such-model:lora"), 404, "model", "'no-such-model:lora' does not exist", NOT_FOUND
    ),
    "completions-unknown-adapter": Case(
        COMPLETIONS,
        completion(model=f"{MODEL}:no-such-lora"),
        404,
        "model",
        "has no adapter 'no-such-lora'",
        NOT_FOUND,
    ),
    "chat-unknown-adapter": Case(
        CHAT, chat(model=f"{MODEL}:no-such-lora"), 404, "model", "has no adapter 'no-such-lora'", NOT_FOUND
    ),
    # bodies that are not a JSON object of the right shape
    "completions-not-json": Case(COMPLETIONS, raw("this is not json"), 400, None, "not valid JSON"),
    "chat-not-json": Case(CHAT, raw('{"model": "x",'), 400, None, "not valid JSON"),
    "completions-empty-body": Case(COMPLETIONS, b"", 400, None, "not valid JSON"),
    "chat-empty-body": Case(CHAT, b"", 400, None, "not valid JSON"),
    "completions-body-is-array": Case(
        COMPLETIONS, raw("[1, 2]"), 400, None, "Expected `object`, got `array`"
    ),
    "completions-body-is-null": Case(COMPLETIONS, raw("null"), 400, None, "Expected `object`, got `null`"),
    "completions-missing-model": Case(
        COMPLETIONS, {"prompt": "Hello"}, 400, None, "missing required field `model`"
    ),
    "chat-missing-model": Case(
        CHAT, {"messages": [{"role": "user", "content": "x"}]}, 400, None, "missing required field `model`"
    ),
    "completions-missing-prompt": Case(
        COMPLETIONS, {"model": MODEL}, 400, None, "missing required field `prompt`"
    ),
    "chat-missing-messages": Case(CHAT, {"model": MODEL}, 400, None, "missing required field `messages`"),
    # wrong types
    "prompt-number": Case(COMPLETIONS, completion(prompt=42), 400, "prompt", "got `int`"),
    "max_tokens-string": Case(COMPLETIONS, completion(max_tokens="5"), 400, "max_tokens", "got `str`"),
    "temperature-string": Case(COMPLETIONS, completion(temperature="hot"), 400, "temperature", "got `str`"),
    "chat-temperature-string": Case(CHAT, chat(temperature="0.5"), 400, "temperature", "got `str`"),
    "stop-number": Case(COMPLETIONS, completion(stop=7), 400, "stop", "got `int`"),
    # out-of-range values
    "temperature-3": Case(COMPLETIONS, completion(temperature=3), 400, "temperature", "<= 2.0"),
    "chat-temperature-3": Case(CHAT, chat(temperature=3), 400, "temperature", "<= 2.0"),
    "temperature-negative": Case(COMPLETIONS, completion(temperature=-0.5), 400, "temperature", ">= 0.0"),
    "top_p-0": Case(COMPLETIONS, completion(top_p=0), 400, "top_p", "> 0.0"),
    "top_p-above-1": Case(CHAT, chat(top_p=1.5), 400, "top_p", "<= 1.0"),
    "n-0": Case(COMPLETIONS, completion(n=0), 400, "n", ">= 1"),
    "chat-n-0": Case(CHAT, chat(n=0), 400, "n", ">= 1"),
    "n-1000": Case(COMPLETIONS, completion(n=1000), 400, "n", "n must be at most 16"),
    "chat-n-1000": Case(CHAT, chat(n=1000), 400, "n", "n must be at most 16"),
    "logprobs-21": Case(COMPLETIONS, completion(logprobs=21), 400, "logprobs", "logprobs must be at most 20"),
    "top_logprobs-21": Case(
        CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "top_logprobs must be at most 20"
    ),
    "top_logprobs-without-logprobs": Case(
        CHAT, chat(top_logprobs=2), 400, "top_logprobs", "requires logprobs to be true"
    ),
    "top_logprobs-with-logprobs-false": Case(
        CHAT, chat(logprobs=False, top_logprobs=2), 400, "top_logprobs", "requires logprobs to be true"
    ),
    "presence_penalty-5": Case(
        COMPLETIONS, completion(presence_penalty=5), 400, "presence_penalty", "<= 2.0"
    ),
    "frequency_penalty--5": Case(CHAT, chat(frequency_penalty=-5), 400, "frequency_penalty", ">= -2.0"),
    "max_tokens-negative": Case(COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens", ">= 0"),
    "chat-max_tokens-negative": Case(CHAT, chat(max_tokens=-1), 400, "max_tokens", ">= 0"),
    "seed-above-int64": Case(COMPLETIONS, completion(seed=2**64), 400, "seed", "<= 9223372036854775807"),
    # integers written as floats: 1.0 is one (see test_integral_floats_are_integers), 1.5 is not
    "max_tokens-1.5": Case(COMPLETIONS, completion(max_tokens=1.5), 400, "max_tokens", "got `float`"),
    "prompt-id-1.5": Case(COMPLETIONS, completion(prompt=[1.0, 1.5]), 400, "prompt[1]", "got `float`"),
    "prompt-id-1e20": Case(COMPLETIONS, completion(prompt=[1e20]), 400, "prompt[0]", "got `float`"),
    "n-1.0-then-max_tokens-string": Case(  # the error names the field that is wrong, not n
        COMPLETIONS,
        {"model": MODEL, "prompt": "Hello", "n": 1.0, "max_tokens": "5"},
        400,
        "max_tokens",
        "got `str`",
    ),
    # prompt forms
    "prompt-empty-string": Case(
        COMPLETIONS, completion(prompt=""), 400, "prompt", "must not contain an empty string"
    ),
    "prompt-empty-list": Case(
        COMPLETIONS, completion(prompt=[]), 400, "prompt", "must be a non-empty string"
    ),
    "prompt-empty-token-list": Case(
        COMPLETIONS, completion(prompt=[[]]), 400, "prompt", "must not contain an empty token list"
    ),
    "prompt-second-token-list-empty": Case(
        COMPLETIONS, completion(prompt=[[1, 2], []]), 400, "prompt", "must not contain an empty token list"
    ),
    "prompt-strings-and-ids": Case(
        COMPLETIONS, completion(prompt=["Hello", 5]), 400, "prompt", "must be a non-empty string"
    ),
    "prompt-ids-and-lists": Case(
        COMPLETIONS, completion(prompt=[5, [6]]), 400, "prompt", "must be a non-empty string"
    ),
    "prompt-id-equal-to-vocab": Case(
        COMPLETIONS, completion(prompt=[1, VOCAB]), 400, "prompt", f"token id {VOCAB} in prompt is outside"
    ),
    "prompt-id-huge": Case(
        COMPLETIONS, completion(prompt=[[2**64]]), 400, "prompt", f"token id {2**64} in prompt is outside"
    ),
    "prompt-id-negative": Case(COMPLETIONS, completion(prompt=[-1]), 400, "prompt[0]", ">= 0"),
    "prompt-too-many": Case(
        COMPLETIONS, completion(prompt=["Hello"] * 65), 400, "prompt", "at most 64 inputs per request"
    ),
    # the context: 8192 tokens
    "prompt-longer-than-context": Case(
        COMPLETIONS,
        completion(prompt=[1] * 9000),
        400,
        "prompt",
        "maximum context length is 8192 tokens",
        TOO_LONG,
    ),
    "stream-prompt-longer-than-context": Case(
        COMPLETIONS,
        completion(prompt=[1] * 9000, stream=True),
        400,
        "prompt",
        "has 9000 prompt tokens",
        TOO_LONG,
    ),
    "prompt-plus-max_tokens-over-context": Case(
        COMPLETIONS,
        completion(prompt=[1] * 5000, max_tokens=4000),
        400,
        "max_tokens",
        "has 5000 prompt tokens and asks for 4000 completion tokens",
        TOO_LONG,
    ),
    "chat-prompt-plus-max_tokens-over-context": Case(
        CHAT,
        chat(messages=[{"role": "user", "content": "hello " * 6000}], max_tokens=3000),
        400,
        "max_tokens",
        "prompt tokens and asks for 3000 completion tokens",
        TOO_LONG,
    ),
    # stop strings
    "stop-five": Case(
        COMPLETIONS, completion(stop=["a", "b", "c", "d", "e"]), 400, "stop", "at most 4 stop sequences"
    ),
    "chat-stop-five": Case(
        CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", "at most 4 stop sequences"
    ),
    "stop-empty-string": Case(COMPLETIONS, completion(stop=""), 400, "stop", "must not be empty strings"),
    "stop-list-with-empty": Case(
        COMPLETIONS, completion(stop=["\n", ""]), 400, "stop", "must not be empty strings"
    ),
    "chat-stop-empty-string": Case(CHAT, chat(stop=[""]), 400, "stop", "must not be empty strings"),
    # logit_bias
    "logit_bias-word-key": Case(
        COMPLETIONS, completion(logit_bias={"hello": 1}), 400, "logit_bias", "key 'hello' is not a token id"
    ),
    "logit_bias-float-key": Case(
        COMPLETIONS, completion(logit_bias={"1.5": 1}), 400, "logit_bias", "key '1.5' is not a token id"
    ),
    "logit_bias-negative-key": Case(
        COMPLETIONS, completion(logit_bias={"-1": 1}), 400, "logit_bias", "key '-1' is not a token id"
    ),
    "logit_bias-superscript-digit-key": Case(
        COMPLETIONS, completion(logit_bias={"\u00b2": 1}), 400, "logit_bias", "is not a token id"
    ),
    "logit_bias-arabic-digit-key": Case(
        COMPLETIONS, completion(logit_bias={"\u0661": 1}), 400, "logit_bias", "is not a token id"
    ),
    "logit_bias-5000-digit-key": Case(
        COMPLETIONS, completion(logit_bias={"9" * 5000: 1}), 400, "logit_bias", "is not a token id"
    ),
    "logit_bias-key-equal-to-vocab": Case(
        COMPLETIONS,
        completion(logit_bias={str(VOCAB): 1}),
        400,
        "logit_bias",
        f"key '{VOCAB}' is not a token id in [0, {VOCAB})",
    ),
    "logit_bias-value-500": Case(
        COMPLETIONS, completion(logit_bias={"5": 500}), 400, "logit_bias", "between -100 and 100"
    ),
    "chat-logit_bias-value--500": Case(
        CHAT, chat(logit_bias={"5": -500}), 400, "logit_bias", "between -100 and 100"
    ),
    "logit_bias-value-string": Case(
        COMPLETIONS, completion(logit_bias={"5": "up"}), 400, "logit_bias", "got `str`"
    ),
    # unsupported completion fields
    "best_of-not-n": Case(COMPLETIONS, completion(best_of=2), 400, "best_of", "best_of is not supported"),
    "best_of-not-n-with-n": Case(
        COMPLETIONS, completion(n=2, best_of=3), 400, "best_of", "best_of is not supported"
    ),
    "suffix": Case(COMPLETIONS, completion(suffix=" world"), 400, "suffix", "suffix is not supported"),
    # fields asking for more than plain text: refused, never ignored
    # structured outputs: a grammar that cannot be held to is a 400 with the grammar engine's message
    "chat-response_format-bad-schema": Case(
        CHAT,
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
        ),
        400,
        "response_format.json_schema.schema",
        "strin",
    ),
    "chat-response_format-schema-missing": Case(
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "response_format.json_schema",
        "`schema`",
    ),
    "response_format-unenforceable-keyword": Case(
        COMPLETIONS,
        completion(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "format": "no-such-format"}},
            }
        ),
        400,
        "response_format.json_schema.schema",
        "no-such-format",
    ),
    "structured_outputs-bad-regex": Case(
        COMPLETIONS,
        completion(structured_outputs={"regex": "(?<=a)b"}),
        400,
        "structured_outputs",
        "look-around",
    ),
    "structured_outputs-two": Case(
        COMPLETIONS,
        completion(structured_outputs={"regex": "a", "choice": ["a"]}),
        400,
        "structured_outputs",
        "exactly one",
    ),
    "structured_outputs-and-response_format": Case(
        CHAT,
        chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
        400,
        "structured_outputs",
        "cannot both",
    ),
    "structured_outputs-bad-grammar": Case(
        COMPLETIONS,
        completion(structured_outputs={"grammar": "root ::= nowhere"}),
        400,
        "structured_outputs",
        "nowhere",
    ),
    "chat-response_format-bogus": Case(
        CHAT, chat(response_format={"type": "bogus"}), 400, "response_format.type", "'bogus'"
    ),
    "chat-tools-auto-with-response_format": Case(
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            response_format={"type": "json_object"},
        ),
        400,
        "response_format",
        "cannot both constrain",
    ),
    "chat-tool_choice-required-no-tools": Case(
        CHAT, chat(tool_choice="required"), 400, "tool_choice", "no tools"
    ),
    "chat-tool_choice-unknown-function": Case(
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice",
        "no tool is named 'g'",
    ),
    "chat-tools-bad-parameters": Case(
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
            tool_choice="required",
        ),
        400,
        "tool_choice",
        "strin",
    ),
    "chat-tools-name-with-a-final-newline": Case(
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f\n"}}], tool_choice="required"),
        400,
        "tools[0].function.name",
        "matching regex",
    ),
    "chat-response_format-name-with-a-final-newline": Case(
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "n\n", "schema": {}}}),
        400,
        "response_format.json_schema.name",
        "matching regex",
    ),
    "chat-tools-x-guidance": Case(
        CHAT,
        chat(
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "x-guidance": {"item_separator": "}"}},
                    },
                }
            ],
            tool_choice="required",
        ),
        400,
        "tools[0].function.parameters",
        "x-guidance",
    ),
    "completion-tools": Case(
        COMPLETIONS,
        completion(tools=[{"type": "function", "function": {"name": "f"}}]),
        400,
        "tools",
        "/v1/chat/completions",
    ),
    "chat-modalities-audio": Case(CHAT, chat(modalities=["text", "audio"]), 400, "modalities[1]", "'audio'"),
    "chat-guided_json": Case(
        CHAT,
        chat(guided_json={"type": "object"}),
        400,
        "guided_json",
        "use response_format or structured_outputs",
    ),
    "guided_regex": Case(
        COMPLETIONS, completion(guided_regex="[0-9]+"), 400, "guided_regex", "structured_outputs"
    ),
    # chat messages
    "chat-empty-messages": Case(CHAT, chat(messages=[]), 400, "messages", "messages must not be empty"),
    "chat-unknown-role": Case(
        CHAT,
        chat(messages=[{"role": "wizard", "content": "x"}]),
        400,
        "messages[0].role",
        "Invalid enum value 'wizard'",
    ),
    "chat-missing-role": Case(
        CHAT, chat(messages=[{"content": "x"}]), 400, "messages[0]", "missing required field `role`"
    ),
    "chat-content-number": Case(
        CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", "got `int`"
    ),
    "chat-content-part-not-text": Case(
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]),
        400,
        "messages[0].content[0].type",
        "'image_url'",
    ),
    "chat-messages-not-list": Case(CHAT, chat(messages="Hello"), 400, "messages", "got `str`"),
    # JSON's non-numbers and overflowing numbers
    "temperature-NaN": Case(
        COMPLETIONS,
        raw(f'{{"model": "{MODEL}", "prompt": "Hi", "max_tokens": 1, "temperature": NaN}}'),
        400,
        None,
        "not valid JSON",
    ),
    "temperature-Infinity": Case(
        COMPLETIONS,
        raw(f'{{"model": "{MODEL}", "prompt": "Hi", "max_tokens": 1, "temperature": Infinity}}'),
        400,
        None,
        "not valid JSON",
    ),
    "chat-top_p--Infinity": Case(
        CHAT, raw(f'{{"model": "{MODEL}", "messages": [], "top_p": -Infinity}}'), 400, None, "not valid JSON"
    ),
    "logit_bias-NaN": Case(
        COMPLETIONS,
        raw(f'{{"model": "{MODEL}", "prompt": "Hi", "logit_bias": {{"5": NaN}}}}'),
        400,
        None,
        "not valid JSON",
    ),
    "temperature-1e400": Case(
        COMPLETIONS,
        raw(f'{{"model": "{MODEL}", "prompt": "Hi", "temperature": 1e400}}'),
        400,
        "temperature",
        "Number out of range",
    ),
    # SGLang's native /generate: SGLang's messages where it has one, 4xx where it answers a 500
    "generate-nothing": Case(GENERATE, {}, 400, "text", "Either text, input_ids or input_embeds"),
    "generate-empty-ids": Case(GENERATE, {"input_ids": []}, 400, "input_ids", "input_ids cannot be empty."),
    "generate-id-outside-vocab": Case(
        GENERATE, {"input_ids": [VOCAB]}, 400, "input_ids", "outside the vocabulary"
    ),
    "generate-unknown-sampling-key": Case(
        GENERATE, {"text": "Hi", "sampling_params": {"bogus": 1}}, 400, "sampling_params", "unknown field"
    ),
    "generate-bad-regex": Case(
        GENERATE,
        {"text": "Hi", "sampling_params": {"regex": "(?<=a)b"}},
        400,
        "sampling_params.regex",
        "look-around",
    ),
    "generate-structural_tag": Case(
        GENERATE,
        {"text": "Hi", "sampling_params": {"structural_tag": "{}"}},
        400,
        "sampling_params.structural_tag",
        "not supported",
    ),
    "generate-two-constraints": Case(
        GENERATE,
        {"text": "Hi", "sampling_params": {"regex": "a", "json_schema": "{}"}},
        400,
        "sampling_params",
        "Only one of json_schema, regex, ebnf, or structural_tag can be set.",
    ),
    "generate-start-past-prompt": Case(
        GENERATE,
        {"text": "Hi", "return_logprob": True, "logprob_start_len": 9},
        400,
        "logprob_start_len",
        "higher than",
    ),
    "generate-too-long": Case(
        GENERATE,
        {"input_ids": [1] * CONTEXT, "sampling_params": {"max_new_tokens": 1}},
        400,
        "sampling_params.max_new_tokens",
        "maximum context length",
        TOO_LONG,
    ),
    "generate-unknown-model": Case(
        GENERATE, {"text": "Hi", "model": "nope"}, 404, "model", "does not exist", NOT_FOUND
    ),
    "generate-unknown-lora": Case(
        GENERATE, {"text": "Hi", "lora_path": "nope"}, 404, "model", "no adapter", NOT_FOUND
    ),
    # nested as deep as a body decodes, deeper than Python recurses: the grammar engine's limit
    "chat-tool-nested-deep": Case(
        "/v1/chat/completions",
        deep_tool_chat(450),
        400,
        "tool_choice",
        "recursion limit exceeded",
    ),
    "generate-n-too-large": Case(
        GENERATE, {"text": "Hi", "sampling_params": {"n": 10**3}}, 400, "n", "n must be"
    ),
}


def post(http, case: Case):
    if isinstance(case.body, bytes):
        return http.post(case.endpoint, content=case.body, headers={"Content-Type": "application/json"})
    return http.post(case.endpoint, json=case.body)


def assert_error(response, status: int, error_type: str, param: str | None, code: str | None) -> dict:
    """The response is `status` with exactly OpenAI's error object; returns its `error`."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == error_type
    assert error["param"] == param
    assert error["code"] == code
    return error


# the cases a hostile probe found (docs/testing.md, Hostile cases)
HOSTILE = {
    "chat-tools-name-with-a-final-newline",
    "chat-response_format-name-with-a-final-newline",
    "chat-tools-x-guidance",
}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, id=name, marks=[pytest.mark.hostile] if name in HOSTILE else [])
        for name, case in CASES.items()
    ],
)
def test_bad_request_gets_openai_error(http, case: Case):
    error = assert_error(post(http, case), case.status, case.error_type, case.param, case.code)
    assert case.message in error["message"]
    assert "\n" not in error["message"]


POST_ONLY = {"POST", "OPTIONS"}
GET_ONLY = {"GET", "OPTIONS"}


@pytest.mark.parametrize(
    ("method", "path", "status", "error_type", "message", "allow"),
    [
        ("GET", "/no/such/route", 404, "not_found_error", "Not Found", None),
        ("POST", "/v1/no_such_endpoint", 404, "not_found_error", "Not Found", None),
        ("GET", COMPLETIONS, 405, INVALID, "Method Not Allowed", POST_ONLY),
        ("GET", CHAT, 405, INVALID, "Method Not Allowed", POST_ONLY),
        ("DELETE", COMPLETIONS, 405, INVALID, "Method Not Allowed", POST_ONLY),
        ("TRACE", "/v1/tokenize", 405, INVALID, "Method Not Allowed", POST_ONLY),
        ("PUT", "/v1/models", 405, INVALID, "Method Not Allowed", GET_ONLY),
        ("DELETE", f"/v1/models/{MODEL}", 405, INVALID, "Method Not Allowed", GET_ONLY),
        ("PATCH", "/health", 405, INVALID, "Method Not Allowed", GET_ONLY),
    ],
)
def test_unknown_route_and_wrong_method_use_the_error_format(
    http, method, path, status, error_type, message, allow
):
    response = http.request(method, path)
    error = assert_error(response, status, error_type, None, None)
    assert error["message"] == message
    if allow is None:
        assert "allow" not in response.headers
    else:  # RFC 9110: a 405 lists the methods the path serves
        assert {m.strip() for m in response.headers["allow"].split(",")} == allow


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
def test_integral_floats_are_integers(http, binary):
    """JSON Schema counts 1.0 as an integer, and so does the OpenAPI document: so does the server,
    in JSON and MessagePack, with the same answer as for the integers."""

    def send(path: str, body: dict):
        if binary:
            content, content_type = msgspec.msgpack.encode(body), "application/msgpack"
        else:
            content, content_type = json.dumps(body).encode(), "application/json"
        response = http.post(path, content=content, headers={"Content-Type": content_type})
        assert response.status_code == 200, response.text
        return response.json()

    floats = completion(
        prompt=[[504.0, 3575.0]], n=1.0, max_tokens=2.0, logprobs=1.0, seed=7.0, temperature=0
    )
    ints = completion(prompt=[[504, 3575]], n=1, max_tokens=2, logprobs=1, seed=7, temperature=0)
    with_floats, with_ints = send(COMPLETIONS, floats)["choices"], send(COMPLETIONS, ints)["choices"]
    assert [c["text"] for c in with_floats] == [c["text"] for c in with_ints]
    # The second reuses the first's prompt keys/values (the engine's prefix cache): its logprobs
    # equal the first's to float32 round-off, not bit for bit.
    logprobs = [[c["logprobs"]["token_logprobs"] for c in choices] for choices in (with_floats, with_ints)]
    assert np.allclose(*logprobs, rtol=0, atol=1e-5)
    assert send("/v1/detokenize", {"model": MODEL, "tokens": [504.0, -0.0]}) == send(
        "/v1/detokenize", {"model": MODEL, "tokens": [504, 0]}
    )
    rows = {"model": MODEL, "encoding_format": "base64"}
    assert (
        send("/v1/next_token_logprobs", {**rows, "input": [504.0, 3575.0]})["data"]
        == send("/v1/next_token_logprobs", {**rows, "input": [504, 3575]})["data"]
    )


MALFORMED_HTTP = {
    "chunk-size-not-hex": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    b"Content-Type: application/json\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "chunk-longer-than-its-size": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    b'Transfer-Encoding: chunked\r\n\r\n2\r\n{"model": 1}\r\n0\r\n\r\n',
    "content-length-not-a-number": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n",
    "request-line-garbage": b"NOT HTTP AT ALL\r\n\r\n",
}


def server_errors(gateway) -> float:
    """Requests the gateway has counted with a 5xx status."""
    text = httpx.get(gateway.base_url + "/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "logprob_gateway_requests_total" and sample.labels["status"].startswith("5")
    )


@pytest.mark.parametrize("request_bytes", list(MALFORMED_HTTP.values()), ids=list(MALFORMED_HTTP))
def test_malformed_http_gets_an_openai_error(gateway, request_bytes):
    """Requests the HTTP parser refuses before the app sees them: still OpenAI's error object."""
    errors_before = server_errors(gateway)
    url = urlsplit(gateway.base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    sock.sendall(request_bytes)
    response = HTTPResponse(sock)
    response.begin()
    body = response.read()
    sock.close()
    time.sleep(0.5)  # the app, if it saw the request, counts it as it ends
    # A request cut off mid-body reached the app as a departed client: a 499 there, never a 500.
    assert server_errors(gateway) == errors_before
    assert response.status == 400, body
    assert response.getheader("content-type") == "application/json"
    assert response.getheader("connection") == "close"
    error = json.loads(body)["error"]
    assert error == {
        "message": "Invalid HTTP request received.",
        "type": INVALID,
        "param": None,
        "code": None,
    }


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no-such-model", "model 'no-such-model' does not exist; available: smollm2-135m"),
        (f"{MODEL}:no-such-lora", f"model '{MODEL}' has no adapter 'no-such-lora'; available adapters: none"),
    ],
)
def test_retrieve_unknown_model_is_404(http, name, message):
    error = assert_error(http.get(f"/v1/models/{name}"), 404, INVALID, "model", NOT_FOUND)
    assert error["message"] == message


def test_sdk_raises_bad_request_with_server_message(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=[1] * 9000, max_tokens=1)
    err = caught.value
    assert err.status_code == 400
    assert err.code == TOO_LONG and err.param == "prompt" and err.type == INVALID
    expected = "this model's maximum context length is 8192 tokens; the request has 9000 prompt tokens"
    assert err.body["message"].startswith(expected)
    assert expected in str(err)

    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, top_logprobs=3
        )
    assert caught.value.param == "top_logprobs"
    assert caught.value.body["message"] == "top_logprobs requires logprobs to be true"


def test_sdk_raises_not_found_with_server_message(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=1
        )
    err = caught.value
    assert err.status_code == 404
    assert err.code == NOT_FOUND and err.param == "model"
    assert err.body["message"] == "model 'no-such-model' does not exist; available: smollm2-135m"
    assert "model 'no-such-model' does not exist" in str(err)

    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model=f"{MODEL}:no-such-lora", prompt="Hi", max_tokens=1)
    assert caught.value.code == NOT_FOUND
    assert "has no adapter 'no-such-lora'" in caught.value.body["message"]


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (CHAT, chat(response_format={"type": "text"}, tools=[], tool_choice="none", modalities=["text"])),
        (COMPLETIONS, completion(response_format={"type": "text"}, guided_json=None)),
    ],
)
def test_fields_that_ask_for_plain_text_are_accepted(http, endpoint, body):
    assert http.post(endpoint, json=body).status_code == 200


def test_server_still_serves_after_bad_requests(http):
    """Runs after the cases above (file order): nothing they sent broke the server."""
    health = http.get("/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    response = http.post(
        COMPLETIONS, json=completion(prompt="The capital of France is", max_tokens=2, temperature=0)
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"].strip()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2
    reply = http.post(CHAT, json=chat(max_tokens=2, temperature=0))
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["role"] == "assistant"
