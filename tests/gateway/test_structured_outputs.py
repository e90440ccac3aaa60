"""Structured outputs through the real gateway on the real default model, with the clients users
have: the `openai` SDK's `response_format` and vLLM's `structured_outputs` on both endpoints, and
SGLang's /generate `regex` / `json_schema` / `ebnf`. Every output is checked by a validator of its
own (jsonschema, re.fullmatch, Python's parser), never against a recorded answer."""

from __future__ import annotations

import ast
import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.conftest import MODEL
from tests.gateway.structured_cases import ARITHMETIC, PROMPTS, REGEXES, SCHEMAS


def _schema_format(index: int) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": f"case_{index}", "schema": SCHEMAS[index], "strict": True},
    }


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schemas_of_growing_size_validate_for_every_prompt(tiny_client, index):
    def ask(prompt: str):
        return tiny_client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=400,
            temperature=0,
            response_format=_schema_format(index),
        )

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: they share the engine's passes
        answers = list(pool.map(ask, PROMPTS))
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (prompt, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[index])


def test_json_object_and_schema_on_both_endpoints(client):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    completion = client.completions.create(
        model=MODEL,
        prompt="A JSON object describing a person:",
        max_tokens=200,
        temperature=0,
        extra_body={"response_format": _schema_format(3)},
    )
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMAS[3])


@pytest.mark.parametrize("name", sorted(REGEXES))
def test_regexes_match_the_whole_output(client, name):
    pattern, question = REGEXES[name]
    for stream in (False, True):
        answer = client.completions.create(
            model=MODEL,
            prompt=question + "\nAnswer:",
            max_tokens=40,
            temperature=0,
            stream=stream,
            extra_body={"structured_outputs": {"regex": pattern}},
        )
        text = "".join(c.choices[0].text for c in answer) if stream else answer.choices[0].text
        assert re.fullmatch(pattern, text, re.ASCII), text


def _arithmetic(text: str) -> None:
    """The text parses as an arithmetic expression of integers (Python's parser, nothing else)."""
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    tree = ast.parse(text, mode="eval")
    assert all(isinstance(node, allowed) for node in ast.walk(tree)), text


def _sampled_chat(client, question: str, constraint: dict, max_tokens: int, **sampling):
    """n sampled answers to `question` under vLLM's `structured_outputs` constraint."""
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0.7,
        extra_body={"structured_outputs": constraint},
        **sampling,
    )


def test_an_ebnf_arithmetic_grammar_parses(client, http):
    answer = _sampled_chat(
        client, "Write an arithmetic expression.", {"grammar": ARITHMETIC}, 64, n=3, seed=3
    )
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        _arithmetic(choice.message.content)
    # SGLang's spelling of the same grammar
    out = http.post(
        "/generate",
        json={
            "text": "2 + 3 * 4 = 14, and",
            "sampling_params": {"ebnf": ARITHMETIC, "max_new_tokens": 64, "temperature": 0},
        },
    ).json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    _arithmetic(out["text"])


def test_choice_is_one_of_the_strings(client):
    choices = ["Paris", "Berlin", "a banana"]
    answer = _sampled_chat(client, "What is the capital of France?", {"choice": choices}, 10, n=4, seed=0)
    assert {c.message.content for c in answer.choices} <= set(choices)


def test_sglang_generate_holds_json_schema_and_regex(http):
    schema = SCHEMAS[8]
    out = http.post(
        "/generate",
        json={
            "text": ["A person and their address, as JSON:", "Another one:"],
            "sampling_params": {"json_schema": json.dumps(schema), "max_new_tokens": 200, "temperature": 0},
        },
    ).json()
    for result in out:
        jsonschema.validate(json.loads(result["text"]), schema)
    pattern = REGEXES["email"][0]
    out = http.post(
        "/generate", json={"text": "Email:", "sampling_params": {"regex": pattern, "temperature": 0}}
    ).json()
    assert re.fullmatch(pattern, out["text"], re.ASCII)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _arguments_validate(call) -> None:
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_named_function_is_called_with_valid_arguments(client):
    answer = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=80,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    _arguments_validate(call)
    # the conversation goes on with the call and its result, as the SDK's tool loop sends them
    follow_up = client.chat.completions.create(
        model=MODEL,
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
        ],
        max_tokens=8,
        temperature=0,
    )
    assert follow_up.choices[0].message.content


def test_required_calls_one_of_the_tools_streamed_or_not(client):
    def ask(parallel: bool, stream: bool = False):
        return client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=120,
            temperature=0,
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=parallel,
            stream=stream,
        )

    for parallel in (False, True):
        answer = ask(parallel)
        calls = answer.choices[0].message.tool_calls
        assert answer.choices[0].finish_reason == "tool_calls" and calls
        assert parallel or len(calls) == 1
        for call in calls:
            _arguments_validate(call)
    chunks = list(ask(False, stream=True))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    streamed: dict[int, dict[str, str]] = {}  # a call's name and arguments, rebuilt from its fragments
    for chunk in chunks:
        for part in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = streamed.setdefault(part.index, {"name": "", "arguments": ""})
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
    assert len(streamed) == 1
    (only,) = streamed.values()
    assert only == {"name": calls[0].function.name, "arguments": calls[0].function.arguments}
