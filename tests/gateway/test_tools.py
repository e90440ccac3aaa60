"""Tool calls as OpenAI clients send them, on the real model: the default model's weights served
under chat templates that show calls (Qwen2.5's Hermes-style `<tool_call>`, Llama 3.1's JSON,
Mistral's `[TOOL_CALLS]`), through the official openai SDK and its stream helper."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest

from bench.launcher import start_gateway
from tests.gateway.test_structured_outputs import TIME, WEATHER

pytestmark = pytest.mark.slow
TEMPLATES = Path(__file__).parent / "chat_templates"
FORMATS = ("hermes", "llama3_json", "mistral")

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


# Earlier turns in which the assistant called the tool: the template shows the model its own call
# syntax, and the greedy model follows it.
def _call_turn(city: str, unit: str) -> dict:
    arguments = json.dumps({"city": city, "unit": unit})
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{city}",
                "type": "function",
                "function": {"name": "get_weather", "arguments": arguments},
            }
        ],
    }


FEW_SHOT = [
    {"role": "system", "content": "You call tools. Always answer with a tool call."},
    {"role": "user", "content": "What is the weather in Rome?"},
    _call_turn("Rome", "celsius"),
    {"role": "user", "content": "What is the weather in Boston?"},
    _call_turn("Boston", "fahrenheit"),
    {"role": "user", "content": "What is the weather in Paris?"},
]
PLAIN = [{"role": "user", "content": "What is the capital of France?"}]


def _model_with_template(model_dir: Path, directory: Path, template: str) -> Path:
    """The default model's weights (linked) under another chat template."""
    directory.mkdir()
    for item in model_dir.iterdir():
        if item.suffix == ".safetensors":
            (directory / item.name).symlink_to(item)
        elif item.name != "chat_template.jinja":
            shutil.copy(item, directory / item.name)
    (directory / "chat_template.jinja").write_text(template)
    return directory


def _with_special_trigger(directory: Path) -> None:
    """The vocabulary's unused special token `<gh_stars>` renamed `<tool_call>`: a Hermes-style
    model whose call opening is one special token, as Qwen's vocabulary has markers of its own."""
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    for token in tokenizer["added_tokens"]:
        if token["content"] == "<gh_stars>":
            token["content"] = "<tool_call>"
    vocab = tokenizer["model"]["vocab"]
    vocab["<tool_call>"] = vocab.pop("<gh_stars>")
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))


@pytest.fixture(scope="module")
def tool_gateway(model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tools")
    config = ""
    for name in FORMATS:
        path = _model_with_template(model_dir, workdir / name, (TEMPLATES / f"{name}.jinja").read_text())
        config += f'[[models]]\nname = "{name}"\nmodel = "{path}"\ndtype = "float32"\n\n'
    special = _model_with_template(
        model_dir, workdir / "hermes_special", (TEMPLATES / "hermes.jinja").read_text()
    )
    _with_special_trigger(special)
    config += f'[[models]]\nname = "hermes_special"\nmodel = "{special}"\ndtype = "float32"\n\n'
    config += f'[[models]]\nname = "plain"\nmodel = "{model_dir}"\ndtype = "float32"\n'
    (workdir / "gateway.toml").write_text(config)
    gateway = start_gateway(["--config", str(workdir / "gateway.toml")], workdir / "gateway.log")
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def tools_client(tool_gateway):
    import openai

    return openai.OpenAI(base_url=tool_gateway.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _valid(call) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.parametrize("model", FORMATS)
def test_auto_answers_text_or_calls_that_validate(tools_client, model):
    answer = tools_client.chat.completions.create(
        model=model, messages=FEW_SHOT, tools=[WEATHER, TIME], max_tokens=60, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call") and call.type == "function"
        _valid(call)
    # without the example, the same request may answer in text: it is content, never a 400
    text = tools_client.chat.completions.create(
        model=model, messages=PLAIN, tools=[WEATHER], max_tokens=12, temperature=0
    )
    assert text.choices[0].message.tool_calls is None or text.choices[0].finish_reason == "tool_calls"


def test_a_streamed_call_is_sent_as_openai_sends_it(tools_client):
    kwargs = dict(model="hermes", messages=FEW_SHOT, tools=[WEATHER, TIME], max_tokens=60, temperature=0)
    whole = tools_client.chat.completions.create(**kwargs).choices[0]
    chunks = list(tools_client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant" and deltas[0].content is None and not deltas[0].tool_calls
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    first, fragments = calls[0], calls[1:]
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert first.function.arguments == ""
    assert len(fragments) > 1 and all(f.id is None and f.function.name is None for f in fragments)
    arguments = whole.message.tool_calls[0].function.arguments
    assert "".join(f.function.arguments for f in fragments) == arguments
    # compact, as OpenAI's, though the template shows the model spaced JSON
    assert arguments == json.dumps(json.loads(arguments), separators=(",", ":"), ensure_ascii=False)
    # the finish reason comes alone, after the last fragment: the SDK's helper closes the call on it
    assert (
        chunks[-1].choices[0].finish_reason == "tool_calls" and chunks[-1].choices[0].delta.tool_calls is None
    )
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)

    with tools_client.chat.completions.stream(**kwargs) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert [(e.name, e.arguments) for e in done] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert final.choices[0].message.tool_calls[0].function.arguments == done[0].arguments


def test_nested_pydantic_tools_are_called_with_valid_arguments(tools_client):
    """Their `$defs` and `$ref`s stay whole however the call's grammar embeds them."""
    import openai
    import pydantic

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        country: str = pydantic.Field(max_length=12)

    class Trip(pydantic.BaseModel):
        origin: City
        stops: list[City] = pydantic.Field(max_length=2)

    tool = openai.pydantic_function_tool(Trip, name="plan_trip")
    assert "$defs" in tool["function"]["parameters"]
    ask = [{"role": "user", "content": "Plan a trip from Paris to Rome."}]
    asks = [
        dict(model=model, messages=ask, tools=[tool], tool_choice=choice, max_tokens=200, temperature=0)
        for model, choice in (
            ("plain", "required"),
            ("plain", {"type": "function", "function": {"name": "plan_trip"}}),
            ("hermes", "required"),
            ("hermes", {"type": "function", "function": {"name": "plan_trip"}}),
        )
    ]
    one_call = {**asks[2], "parallel_tool_calls": False}
    # All at once, so that the engine decodes them together.
    with ThreadPoolExecutor(len(asks) + 1) as pool:
        *answers, single = pool.map(lambda a: tools_client.chat.completions.create(**a), [*asks, one_call])
    for request, answer in zip(asks, answers, strict=True):
        assert answer.choices[0].finish_reason == "tool_calls", (request["model"], request["tool_choice"])
        for call in answer.choices[0].message.tool_calls:
            Trip.model_validate_json(call.function.arguments)
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert single.choices[0].finish_reason == "tool_calls" and len(single.choices[0].message.tool_calls) == 1
    with tools_client.chat.completions.stream(**one_call) as stream:
        (done,) = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
    assert isinstance(done.parsed_arguments, Trip)


def test_tool_results_reach_the_template_with_arguments_as_objects(tools_client, tool_gateway):
    """Qwen's template writes `arguments | tojson`: given the JSON text, it would quote it again."""
    from transformers import AutoTokenizer

    messages = [
        *FEW_SHOT[1:3],
        {"role": "tool", "tool_call_id": "call_Rome", "content": '{"temperature": 21}'},
    ]
    answer = tools_client.chat.completions.create(
        model="hermes", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=1, temperature=0
    )
    tokenizer = AutoTokenizer.from_pretrained(Path(tool_gateway.log_path).parent / "hermes")
    templated = [
        messages[0],
        {
            **messages[1],
            "tool_calls": [
                {
                    **messages[1]["tool_calls"][0],
                    "function": {"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}},
                }
            ],
        },
        messages[2],
    ]
    text = tokenizer.apply_chat_template(
        templated, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert '"arguments": {"city": "Rome", "unit": "celsius"}' in text and "<tool_response>" in text
    assert answer.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False).input_ids)


def test_a_forced_call_cut_by_max_tokens_is_a_truncated_call(tools_client):
    def ask(model, max_tokens):
        return tools_client.chat.completions.create(
            model=model,
            messages=FEW_SHOT,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=max_tokens,
            temperature=0,
        )

    for model in ("plain", "hermes"):
        whole = ask(model, 80)
        assert whole.choices[0].finish_reason == "tool_calls"
        # eight tokens short: inside the arguments, past the call's name
        choice = ask(model, whole.usage.completion_tokens - 8).choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        (call,) = choice.message.tool_calls
        full = whole.choices[0].message.tool_calls[0].function.arguments
        assert call.function.name == "get_weather" and call.function.arguments != full
        assert full.startswith(call.function.arguments)
        with pytest.raises(ValueError):
            json.loads(call.function.arguments)


# As most tools are written (vLLM's own tests among them): properties listed, nothing said of others.
OPEN_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. 'San Francisco'"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
        },
    },
}


@pytest.mark.parametrize("model", ("llama3_json", "mistral", "plain"))
def test_a_forced_call_holds_only_the_listed_keys(tools_client, model):
    """Open to other keys, the model wrote the schema itself as arguments until max_tokens (or keys
    of its own); closed, as vLLM's and SGLang's default grammar engine holds it, the call ends."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        answer = tools_client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the weather in Dallas, Texas?"}],
            tools=[OPEN_WEATHER],
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=60,
            temperature=0,
        )
        answered = answer.choices[0]
        assert answered.finish_reason == "tool_calls", (choice, answered.message)
        (call,) = answered.message.tool_calls
        assert set(json.loads(call.function.arguments)) <= {"city", "unit"}, call.function.arguments


def test_a_forced_call_wins_over_response_format(tools_client):
    answer = tools_client.chat.completions.create(
        model="hermes",
        messages=FEW_SHOT,
        tools=[WEATHER],
        tool_choice="required",
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    assert answer.choices[0].finish_reason == "tool_calls"
    _valid(answer.choices[0].message.tool_calls[0])


@pytest.mark.parametrize(
    ("model", "fields", "param", "words"),
    [
        ("plain", {"tools": [WEATHER]}, "tool_choice", "model 'plain'"),
        ("hermes", {"tools": []}, "tools", "tools is empty"),
        ("hermes", {"tools": [], "tool_choice": "auto"}, "tools", "tools is empty"),
        ("hermes", {"tool_choice": "auto"}, "tool_choice", "no tools"),
        (
            "hermes",
            {"tools": [WEATHER], "response_format": {"type": "json_object"}},
            "response_format",
            "auto",
        ),
    ],
)
def test_tool_requests_that_cannot_be_served_are_400s(tools_client, model, fields, param, words):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        tools_client.chat.completions.create(model=model, messages=PLAIN, max_tokens=4, **fields)
    assert caught.value.body["param"] == param and words in caught.value.body["message"]


def test_a_call_opened_by_a_special_token(tools_client, tool_gateway):
    """The opening is one special token: text cannot spell it, the grammar asks for the token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(tool_gateway.log_path).parent / "hermes_special")
    assert tokenizer("<tool_call>", add_special_tokens=False).input_ids == [7]
    for choice in ("auto", "required"):
        answer = tools_client.chat.completions.create(
            model="hermes_special",
            messages=FEW_SHOT,
            tools=[WEATHER],
            tool_choice=choice,
            max_tokens=60,
            temperature=0,
            logprobs=True,
            logit_bias={"7": 100},  # steers "auto" to open a call; the grammar does the rest
        )
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "tool_calls", (choice, message)
        assert message.content is None and _valid(message.tool_calls[0])
        assert answer.choices[0].logprobs.content[0].bytes == list(b"<tool_call>")
