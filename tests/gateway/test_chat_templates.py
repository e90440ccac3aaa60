"""Chat templates and tool-call formats as settings, on the real default model through the openai
SDK: the template shipped for smollm2-135m (its own ChatML, plus Hermes-style tools) makes
`tool_choice: "auto"` work and leaves every conversation without tools as it was; a template file
is read only inside `chat_templates_root`; `tool_call_format` names the call syntax; and what
cannot be served is refused before anything loads. What the settings make of the served tokenizer
and of the calls' syntax is the gateway's alone: that test runs the mock engine with the default
model's tokenizer."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from bench.launcher import free_port
from gateway import cli
from gateway.models.chat_template import SHIPPED, chat_template_text, served_tool_format
from gateway.openai.tool_formats import HERMES, MISTRAL
from gateway.settings import ENV_PREFIX, ModelSettings, Settings
from tests.conftest import MODEL, mock_app_client
from tests.gateway.test_structured_outputs import TIME, WEATHER

REPO = Path(__file__).resolve().parents[2]
SHIPPED_TEXT = (SHIPPED / "smollm2-tools.jinja").read_text()
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
CALL = {
    "id": "call_rome",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
}
# One earlier call in the conversation: the template shows the model its call syntax, and at
# temperature 0 it follows it.
ONE_EARLIER_CALL = [
    {"role": "user", "content": "What is the weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line reads os.environ: no LOGPROB_GATEWAY_* variable of the machine may leak in."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _valid(call) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


# ---------------------------------------------------------------- the shipped template


def test_conversations_without_tools_render_as_the_models_own_template(tokenizer):
    own = tokenizer.chat_template
    assert "tool" not in own and own != SHIPPED_TEXT
    roles = ["system", "user", "assistant", "tool_less_role"]
    texts = ["", "Hi", "two\nlines ", "<|im_end|>", " ünï 日本 "]
    rng = random.Random(0)
    for _ in range(400):
        messages = [
            {"role": rng.choice(roles), "content": rng.choice(texts)} for _ in range(rng.randint(1, 5))
        ]
        for add_generation_prompt in (True, False):
            rendered = [
                tokenizer.apply_chat_template(
                    messages,
                    chat_template=template,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=False,
                )
                for template in (own, SHIPPED_TEXT)
            ]
            assert rendered[0] == rendered[1], messages


def test_the_shipped_template_shows_tools_and_calls_as_hermes_templates_do(tokenizer):
    assert served_tool_format(ModelSettings(), SHIPPED_TEXT) is HERMES
    conversation = [
        {"role": "system", "content": "Be brief."},
        {**ONE_EARLIER_CALL[0]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**CALL, "function": {**CALL["function"], "arguments": {"city": "Rome"}}}],
        },
        {"role": "tool", "tool_call_id": "call_rome", "content": "21"},
    ]
    text = tokenizer.apply_chat_template(
        conversation, tools=[WEATHER], chat_template=SHIPPED_TEXT, add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(WEATHER) in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        in text
    )
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n21\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_which_template_a_model_is_served_with(tmp_path):
    assert chat_template_text(ModelSettings()) == SHIPPED_TEXT  # the built-in default model
    assert chat_template_text(ModelSettings(chat_template="tokenizer")) is None
    assert chat_template_text(ModelSettings(model=str(tmp_path))) is None  # another model: its own
    (tmp_path / "mine.jinja").write_text("{{ messages[0]['content'] }}")
    chosen = ModelSettings(model=str(tmp_path), chat_template="mine.jinja", chat_templates_root=str(tmp_path))
    assert chat_template_text(chosen) == "{{ messages[0]['content'] }}"


def test_a_named_format_wins_over_the_templates_and_keeps_what_the_template_adds():
    assert served_tool_format(ModelSettings(), "{{ messages }}") is None
    assert served_tool_format(ModelSettings(tool_call_format="mistral"), SHIPPED_TEXT) is MISTRAL
    assert served_tool_format(ModelSettings(tool_call_format="hermes"), None) is HERMES
    single = "<|python_tag|> only supports single tool-call"
    kept = served_tool_format(ModelSettings(tool_call_format="llama3_json"), single)
    assert kept is not None and kept.name == "llama3_json" and not kept.parallel


# ---------------------------------------------------------------- refused before loading


@pytest.fixture
def no_serve(monkeypatch: pytest.MonkeyPatch) -> list:
    served: list = []
    monkeypatch.setattr(cli, "serve", lambda settings: served.append(settings) or 0)
    return served


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A templates root with a good template, beside a file and a folder outside it."""
    inside = tmp_path / "templates"
    (inside / "family").mkdir(parents=True)
    (inside / "family" / "good.jinja").write_text(SHIPPED_TEXT)
    (inside / "broken.jinja").write_text("{% for message in messages %}{{ message")
    (tmp_path / "outside.jinja").write_text(SHIPPED_TEXT)
    (inside / "escape.jinja").symlink_to(tmp_path / "outside.jinja")
    return inside


REFUSED = {
    "relative-outside": (["--chat-template", "../outside.jinja"], "lies outside chat_templates_root"),
    "absolute-outside": (["--chat-template", "{tmp}/outside.jinja"], "lies outside chat_templates_root"),
    "symlink-leading-out": (["--chat-template", "escape.jinja"], "lies outside chat_templates_root"),
    "missing-file": (["--chat-template", "family/absent.jinja"], "no such file in chat_templates_root"),
    "not-jinja": (["--chat-template", "broken.jinja"], "is not a valid Jinja template: line 1"),
    "root-not-a-directory": (
        ["--chat-template", "x.jinja", "--chat-templates-root", "{tmp}/outside.jinja"],
        "is not a directory",
    ),
}


@pytest.mark.parametrize(("flags", "words"), list(REFUSED.values()), ids=list(REFUSED))
def test_a_template_that_cannot_be_served_stops_the_start(root, no_serve, capsys, flags, words):
    flags = [flag.replace("{tmp}", str(root.parent)) for flag in flags]
    argv = ["serve", "--backend", "mock", "--port", str(free_port()), "--chat-templates-root", str(root)]
    assert cli.main([*argv, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"logprob-gateway: model '{MODEL}': chat_template") and words in err, err
    assert err.count("\n") == 1 and no_serve == []


def test_a_template_file_without_a_root_stops_the_start(root, no_serve, capsys):
    assert cli.main(["serve", "--backend", "mock", "--chat-template", str(root / "family/good.jinja")]) == 2
    err = capsys.readouterr().err
    assert "is no shipped template (smollm2-tools)" in err and "chat_templates_root, which is not set" in err
    assert no_serve == []


def test_a_template_inside_the_root_is_served(root, no_serve):
    argv = ["serve", "--backend", "mock", "--port", str(free_port()), "--chat-templates-root", str(root)]
    assert cli.main([*argv, "--chat-template", "family/good.jinja", "--tool-call-format", "hermes"]) == 0
    (settings,) = no_serve
    model = settings.models[0]
    assert (model.chat_template, model.tool_call_format) == ("family/good.jinja", "hermes")


def test_an_unknown_tool_call_format_stops_the_serving_process(tmp_path):
    config = tmp_path / "gateway.toml"
    config.write_text('[[models]]\nname = "m"\ntool_call_format = "xml"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr == (
        f"logprob-gateway: invalid configuration in {config}: model 'm': unknown tool_call_format 'xml'; "
        "choose one of: hermes, llama3_json, mistral\n"
    )


# ---------------------------------------------------------------- the default model, served


@pytest.mark.slow
def test_auto_on_the_default_model_answers_a_call_whose_arguments_validate(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=ONE_EARLIER_CALL, tools=[WEATHER, TIME], max_tokens=60, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and _valid(call)["city"] == "Paris"


@pytest.mark.slow
def test_auto_without_an_example_answers_text(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    answer = client.chat.completions.create(
        model=MODEL, messages=ask, tools=[WEATHER, TIME], max_tokens=6, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and choice.message.content and not choice.message.tool_calls


@pytest.mark.slow
def test_required_and_named_calls_still_validate_on_the_default_model(client):
    ask = [{"role": "user", "content": "What time is it in Tokyo?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        answer = client.chat.completions.create(
            model=MODEL, messages=ask, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=60, temperature=0
        )
        assert answer.choices[0].finish_reason == "tool_calls", choice
        calls = answer.choices[0].message.tool_calls
        assert calls and all(_valid(call) is not None for call in calls)
        assert choice == "required" or [call.function.name for call in calls] == ["get_time"]


@pytest.mark.slow
def test_chat_without_tools_sends_the_model_what_its_own_template_makes(http, tokenizer):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"}]
    own = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    body = http.post("/v1/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert body["tokens"] == tokenizer(own, add_special_tokens=False).input_ids
    files = http.get(f"/v1/models/{MODEL}/tokenizer").json()["files"]
    assert files["chat_template.jinja"] == SHIPPED_TEXT  # what clients rebuild is what is served


# ---------------------------------------------------------------- settings, served


def _output_text(answer: dict) -> str:
    return "".join(entry["token"] for entry in answer["choices"][0]["logprobs"]["content"])


def test_settings_choose_the_served_template_and_call_syntax(model_dir: Path, tmp_path: Path):
    """What the gateway makes of the settings (the tokenizer it serves, the syntax a grammar holds
    calls to), on the mock engine with the default model's tokenizer."""
    own = (model_dir / "chat_template.jinja").read_text()
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "own.jinja").write_text(own)
    settings = Settings(
        models=[
            ModelSettings(name="own", backend="mock", chat_template="tokenizer"),
            ModelSettings(
                name="from-file",
                model=str(model_dir),
                backend="mock",
                chat_template="smollm2/own.jinja",
                chat_templates_root=str(tmp_path),
                tool_call_format="hermes",
            ),
        ]
    )
    required = {"messages": ONE_EARLIER_CALL, "tools": [WEATHER], "max_tokens": 80, "logprobs": True}
    with mock_app_client(settings=settings) as (_, client):
        refused = client.post(
            "/v1/chat/completions", json={"model": "own", **required, "tool_choice": "auto"}
        )
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "tool_choice" and "tool_call_format" in error["message"]
        allowed = client.post(
            "/v1/chat/completions", json={"model": "from-file", **required, "max_tokens": 4}
        )
        assert allowed.status_code == 200, allowed.text
        # a forced call in each model's syntax: the gateway's JSON list, or the named Hermes format
        outputs = {}
        for name in ("own", "from-file"):
            answer = client.post(
                "/v1/chat/completions", json={"model": name, **required, "tool_choice": "required"}
            ).json()
            assert answer["choices"][0]["finish_reason"] == "tool_calls", answer
            outputs[name] = _output_text(answer)
            files = client.get(f"/v1/models/{name}/tokenizer").json()["files"]
            assert files["chat_template.jinja"] == own
        assert outputs["own"].startswith('[{"name":"get_weather"')
        assert outputs["from-file"].startswith('<tool_call>\n{"name": "get_weather"')
