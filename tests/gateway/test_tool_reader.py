"""The reading of generated text into content and calls, and the call grammars, on the default
model's vocabulary: every format, every way a stream may split the text."""

from __future__ import annotations

import llguidance
import llguidance.hf
import pytest

from gateway.openai.tool_formats import (
    GATEWAY_JSON,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    calls_grammar,
    function_parameters,
)
from gateway.openai.tool_reader import ArgumentsDelta, CallReader, CallStarted, ContentDelta
from gateway.schemas.chat import FunctionSpec

NESTED = {
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/A"}, "b": {"type": "array", "items": {"type": "integer"}}},
    "required": ["a", "b"],
    "additionalProperties": False,
    "$defs": {"A": {"type": "string", "maxLength": 8}},
}
FUNCTIONS = [FunctionSpec(name="f", parameters=NESTED), FunctionSpec(name="g")]
ARGS = '{"a": "}{\\"x", "b": [1, 2]}'
OUTPUTS = {
    "hermes": (
        HERMES,
        f'Sure.<tool_call>\n{{"name": "f", "arguments": {ARGS}}}\n</tool_call>\n<tool_call>\n'
        '{"name": "g", "arguments": {}}\n</tool_call>',
        "Sure.",
    ),
    "mistral": (
        MISTRAL,
        f'[TOOL_CALLS][{{"name": "f", "arguments": {ARGS}}}, {{"name": "g", "arguments": {{}}}}]',
        "",
    ),
    "llama": (LLAMA3_JSON, f'<|python_tag|>{{"name": "f", "parameters": {ARGS}}}', ""),
    "json": (
        GATEWAY_JSON,
        '[{"name":"f","parameters":{"a":"}{\\"x","b":[1,2]}},{"name":"g","parameters":{}}]',
        "",
    ),
}


def _read(fmt, text: str, size: int):
    reader, events = CallReader(fmt), []
    for start in range(0, len(text), size):
        events += reader.feed(text[start : start + size])
    return reader, events + reader.finish()


@pytest.mark.parametrize("name", OUTPUTS)
def test_calls_are_read_the_same_however_the_text_is_split(name):
    fmt, text, content = OUTPUTS[name]
    for size in range(1, len(text) + 1):
        reader, events = _read(fmt, text, size)
        assert reader.content == content and not reader.truncated
        assert [call.name for call in reader.calls] == (["f"] if name == "llama" else ["f", "g"])
        # compact as OpenAI's, however the format spaces them; the strings' own spaces stay
        assert reader.calls[0].arguments == '{"a":"}{\\"x","b":[1,2]}'
        streamed = "".join(e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == 0)
        assert streamed == reader.calls[0].arguments
        assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == content
        assert [e.index for e in events if isinstance(e, CallStarted)] == list(range(len(reader.calls)))


def test_text_that_only_looks_like_a_call_is_content():
    for fmt, text in ((HERMES, "a <tool_ call and <tool"), (LLAMA3_JSON, 'Hi {"name": "f"}')):
        reader, _ = _read(fmt, text, 3)
        assert reader.content == text and reader.calls == []


def test_a_call_cut_short_is_truncated():
    reader, _ = _read(HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": "x', 4)
    assert reader.truncated and reader.calls[0].arguments == '{"a":"x' and reader.content == ""


def test_spaces_inside_argument_strings_are_kept():
    reader, events = _read(HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": "x, y: z ", "b": 1}}', 2)
    assert reader.calls[0].arguments == '{"a":"x, y: z ","b":1}'
    assert "".join(e.text for e in events if isinstance(e, ArgumentsDelta)) == reader.calls[0].arguments


@pytest.fixture(scope="module")
def vocabulary(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))


def _accepts(vocabulary, fmt, functions, output: str, forced: bool) -> bool:
    tokenizer, lexicon = vocabulary
    grammar = calls_grammar(fmt, functions, forced=forced, parallel=True, trigger_token=None)
    matcher = llguidance.LLMatcher(lexicon, llguidance.grammar_from("lark", grammar.source), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer(output, add_special_tokens=False).input_ids
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


@pytest.mark.parametrize("name", OUTPUTS)
def test_the_grammar_takes_its_own_calls_and_nothing_off_schema(vocabulary, name):
    fmt, text, _ = OUTPUTS[name]
    valid = text.replace('"}{\\"x"', '"ok"')

    def accepts(output: str, forced: bool) -> bool:
        return _accepts(vocabulary, fmt, FUNCTIONS, output, forced=forced)

    forced = name == "json"  # the gateway's own format serves forced calls only
    assert accepts(valid, forced=forced)
    assert not accepts(valid.replace('"ok"', "7"), forced=forced)  # "a" must be a string
    if name != "json":
        assert accepts("Just text.", forced=False) and not accepts("Just text.", forced=True)


def test_a_call_holds_only_the_keys_its_function_lists(vocabulary):
    """An object that lists its properties and says nothing of others is closed, as xgrammar's
    strict mode (vLLM's and SGLang's default) holds it; one that says keeps its word."""
    city = {"city": {"type": "string"}}
    open_ended = {"type": "object", "properties": city}
    nested = {"type": "object", "properties": {"to": open_ended}, "$defs": {"To": open_ended}}

    def accepts(parameters: dict, arguments: str) -> bool:
        output = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
        return _accepts(vocabulary, HERMES, [FunctionSpec(name="f", parameters=parameters)], output, True)

    assert accepts(open_ended, '{"city": "Rome"}') and accepts(open_ended, "{}")
    assert not accepts(open_ended, '{"city": "Rome", "x": 1}')
    assert not accepts(nested, '{"to": {"city": "Rome", "x": 1}}')
    assert accepts({**open_ended, "additionalProperties": True}, '{"city": "Rome", "x": 1}')
    both = {"allOf": [open_ended, {"type": "object", "properties": {"x": {"type": "integer"}}}]}
    assert accepts(both, '{"city": "Rome", "x": 1}')  # an allOf's parts stay open to each other


def test_parameters_nested_deeper_than_python_recurses_are_closed():
    """msgspec decodes bodies nested deeper than Python recurses: closing their objects walks
    them with a stack (recursing, a 450-deep tool was a 500)."""
    innermost = {"type": "object", "properties": {"city": {"type": "string"}}}
    schema: dict = innermost
    for _ in range(5000):
        schema = {"anyOf": [schema], "properties": {"p": {"items": [innermost]}}}
    closed = function_parameters(FunctionSpec(name="f", parameters=schema))
    for _ in range(5000):
        assert closed["additionalProperties"] is False  # each level lists properties
        assert closed["properties"]["p"]["items"][0]["additionalProperties"] is False
        closed = closed["anyOf"][0]
    assert closed == {**innermost, "additionalProperties": False}
