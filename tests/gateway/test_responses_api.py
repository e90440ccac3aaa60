"""/v1/responses on the real model through the official openai SDK: the same answers as
/v1/chat/completions for the same conversation, whole, streamed and through the stream helper;
function calls and their second turn; text.format; truncation; what is refused."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import msgspec
import openai
import pytest

from gateway.errors import InvalidRequestError
from gateway.openai.response_output import ResponseShape
from gateway.openai.response_stream import ResponseEvents
from gateway.responses import sse_response
from gateway.schemas.responses import LifecycleEvent, ResponsesRequest
from tests.conftest import MODEL
from tests.gateway.test_structured_outputs import WEATHER

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"
INSTRUCTIONS = "You answer in one word."
TOKENS = 12
FUNCTION = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool
WEATHER_SCHEMA = WEATHER["function"]["parameters"]
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "country": {"type": "string", "maxLength": 16},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}


def _chat_text(client, messages, **fields) -> str:
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **fields)
    return out.choices[0].message.content


def test_whole_text_is_the_chat_completion_s_text(client):
    chat = _chat_text(client, [{"role": "user", "content": QUESTION}], max_tokens=TOKENS)
    out = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=TOKENS, temperature=0)
    assert out.output_text.encode() == chat.encode() and chat
    assert out.object == "response" and out.id.startswith("resp_") and out.model == MODEL
    [message] = out.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]
    assert out.store is False and out.tools == [] and out.temperature == 0
    usage = out.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and usage.output_tokens > 0
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert out.status == ("incomplete" if usage.output_tokens == TOKENS else "completed")


def test_instructions_are_the_system_message(client):
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    chat = _chat_text(client, messages, max_tokens=6)
    items = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    out = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=items, max_output_tokens=6, temperature=0
    )
    assert out.output_text == chat and out.instructions == INSTRUCTIONS
    # the system message without instructions: the model's default one is replaced the same way
    developer = [{"role": "developer", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    again = client.responses.create(model=MODEL, input=developer, max_output_tokens=6, temperature=0)
    assert again.output_text == chat


def test_streamed_deltas_join_to_the_whole_text_in_openai_s_order(client):
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=TOKENS, temperature=0)
    events = list(
        client.responses.create(
            model=MODEL, input=QUESTION, max_output_tokens=TOKENS, temperature=0, stream=True
        )
    )
    kinds = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text and len(deltas) > 1
    head = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    final = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds == [*head, *["response.output_text.delta"] * len(deltas), *tail, final]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_the_stream_helper_s_final_response_is_the_whole_one(client):
    whole = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=40, temperature=0)
    assert whole.status == "completed"  # the model ends its turn well before 40 tokens
    with client.responses.stream(
        model=MODEL, input="Say hello.", max_output_tokens=40, temperature=0
    ) as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == whole.output_text
    assert final.status == "completed" and final.usage.output_tokens == whole.usage.output_tokens
    assert [item.type for item in final.output] == ["message"]


def test_max_output_tokens_cuts_the_answer_as_incomplete(client):
    out = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, temperature=0)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 2 and out.output[0].status == "incomplete"
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_logprobs_are_the_chat_completion_s(client):
    messages = [{"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    out = client.responses.create(
        model=MODEL,
        input=QUESTION,
        max_output_tokens=4,
        temperature=0,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
    )
    got = out.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [(e.token, e.logprob, len(e.top_logprobs)) for e in got] == [
        (e.token, e.logprob, len(e.top_logprobs)) for e in want
    ]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_forced_call_is_a_function_call_item_whose_arguments_validate(client, tool_choice):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = client.responses.create(
        model=MODEL, input=ask, tools=[FUNCTION], tool_choice=tool_choice, max_output_tokens=40, temperature=0
    )
    assert out.status == "completed", out.output
    [call] = out.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    echoed = out.tool_choice if isinstance(tool_choice, str) else out.tool_choice.model_dump()
    assert out.output_text == "" and echoed == tool_choice and out.tools[0].name == "get_weather"
    # the tool loop's second turn: the call and its output sent back as input items
    second = [
        *ask,
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"},
    ]
    answer = client.responses.create(
        model=MODEL, input=second, tools=[FUNCTION], max_output_tokens=8, tool_choice="none", temperature=0
    )
    turn = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    chat = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [turn]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"},
    ]
    said = _chat_text(client, chat, max_tokens=8, tools=[WEATHER], tool_choice="none")
    assert answer.output[0].type == "message" and answer.output_text == said
    assert answer.usage.input_tokens > out.usage.input_tokens


def test_a_streamed_call_is_the_whole_call(client):
    fields = dict(
        model=MODEL,
        input="What is the weather in Rome?",
        tools=[FUNCTION],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    )
    whole = client.responses.create(**fields)
    with client.responses.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [call] = final.output
    assert "".join(deltas) == call.arguments == whole.output[0].arguments
    assert call.parsed_arguments is None or isinstance(call.parsed_arguments, dict)


def test_text_format_json_schema_is_chat_s_response_format(client):
    ask = [{"role": "user", "content": "Name a city and its country."}]
    schema_format = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    chat = _chat_text(
        client,
        ask,
        max_tokens=40,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": CITY, "strict": True},
        },
    )
    out = client.responses.create(
        model=MODEL, input=ask, text={"format": schema_format}, max_output_tokens=40, temperature=0
    )
    assert out.output_text == chat
    jsonschema.validate(json.loads(out.output_text), CITY)
    assert out.text.format.type == "json_schema" and out.text.format.name == "city"
    plain = client.responses.create(
        model=MODEL,
        input="Describe Paris as JSON.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=40,
        temperature=0,
    )
    assert isinstance(json.loads(plain.output_text), dict) or plain.status == "incomplete"


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "does not store responses"),
        ({"background": True}, "background", "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type", "grammar"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort", "do not reason"),
        ({"include": ["file_search_call.results"]}, "include[0]", "include"),
        ({"truncation": "auto"}, "truncation", "disabled"),
        ({"max_output_tokens": 10**6}, "max_output_tokens", "max_output_tokens"),
        ({"tool_choice": "required"}, "tool_choice", "no tools"),
        ({"input": []}, "input", "input"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
            "call_id",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
            "input",
        ),
    ],
)
def test_what_is_not_served_is_a_400_naming_the_field(http, fields, param, words):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, **fields}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_the_sdk_raises_on_a_refused_request(client):
    with pytest.raises(openai.BadRequestError, match="does not store responses"):
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")


def test_a_failure_midway_is_openai_s_error_event_and_the_end():
    """The gateway layer alone: what a stream sends when its generation fails after it began."""
    body = msgspec.json.decode(b'{"model": "m", "input": "Hi"}', type=ResponsesRequest)
    events = ResponseEvents(ResponseShape(body, False, "resp_1", 0))

    async def failing():
        yield events.event(
            LifecycleEvent, type="response.created", response=events.shape.response("in_progress", [])
        )
        raise InvalidRequestError("the grammar failed while generating", param="text.format")

    async def sent() -> list[bytes]:
        return [chunk async for chunk in sse_response(failing(), error_event=events.error, ending=b"").events]

    created, error = asyncio.run(sent())
    assert created.startswith(b"event: response.created\ndata: ")
    head, data = error.decode().strip().split("\n")
    assert head == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error",
        "sequence_number": 1,
        "code": None,
        "message": "the grammar failed while generating",
        "param": "text.format",
    }
