"""gateway.settings.load_settings and the `logprob-gateway serve` command line: layering, validation,
and one-line errors. No server is started and no model is loaded."""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.cpu_threads import compute_threads, cpus_available
from backends.registry import BACKEND_NAMES
from bench.launcher import free_port
from gateway import cli
from gateway.cli import SERVING_GC_THRESHOLD, tune_collector
from gateway.settings import (
    ENV_PREFIX,
    CacheSettings,
    ConfigError,
    ModelSettings,
    Settings,
    load_settings,
)
from tests.conftest import mock_app_client

REPO = Path(__file__).resolve().parents[2]

TWO_MODELS = """
host = "0.0.0.0"
port = 9000
log_level = "warning"

[[models]]
name = "small"
model = "smollm2-135m"
dtype = "float32"
device = "cpu"
max_model_len = 1024
options = {attn_implementation = "eager", compile = false}

[[models]]
model = "/models/tiny-llama/"
backend = "mock"
dtype = "bfloat16"
max_batch_rows = 8

[cache]
ttl_s = 60
"""


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI reads os.environ: no LOGPROB_GATEWAY_* variable of the machine may leak in."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


@pytest.fixture
def no_serve(monkeypatch: pytest.MonkeyPatch) -> list:
    """Replace cli.serve: records the settings it would serve instead of starting a server."""
    served: list = []
    monkeypatch.setattr(cli, "serve", lambda settings: served.append(settings) or 0)
    return served


def write(tmp_path: Path, text: str, name: str = "gateway.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------- load_settings


def test_defaults():
    settings = load_settings(environ={})
    assert settings.host == "127.0.0.1"
    assert settings.port == 8000
    assert settings.log_level == "info"
    assert settings.admin_key is None
    assert len(settings.models) == 1
    model = settings.models[0]
    assert model.served_name == "smollm2-135m"
    assert model.model == "smollm2-135m"
    assert model.backend == "transformers"
    assert (model.dtype, model.device, model.max_model_len) == ("auto", "auto", None)
    assert model.adapters == {} and model.options == {}
    assert settings.limits.max_n == 16 and settings.limits.max_stop == 4
    assert settings.limits.max_top_logprobs == 20
    assert settings.cache.enabled is True and settings.cache.redis_url is None


def test_file_with_two_models(tmp_path):
    settings = load_settings(write(tmp_path, TWO_MODELS), environ={})
    assert (settings.host, settings.port, settings.log_level) == ("0.0.0.0", 9000, "warning")
    assert [m.served_name for m in settings.models] == ["small", "tiny-llama"]
    small, tiny = settings.models
    assert (small.model, small.backend, small.dtype, small.device) == (
        "smollm2-135m",
        "transformers",
        "float32",
        "cpu",
    )
    assert small.max_model_len == 1024
    assert small.options == {"attn_implementation": "eager", "compile": False}
    assert small.engine_config().options == {"attn_implementation": "eager", "compile": False}
    assert small.engine_config().max_model_len == 1024
    assert (tiny.model, tiny.backend, tiny.dtype, tiny.device) == (
        "/models/tiny-llama/",
        "mock",
        "bfloat16",
        "auto",
    )
    assert tiny.max_batch_rows == 8 and tiny.options == {}
    assert settings.cache.ttl_s == 60


def test_config_file_from_environment(tmp_path):
    path = write(tmp_path, TWO_MODELS)
    settings = load_settings(environ={"LOGPROB_GATEWAY_CONFIG": str(path)})
    assert [m.served_name for m in settings.models] == ["small", "tiny-llama"]


def test_precedence_file_then_environment_then_overrides(tmp_path):
    path = write(tmp_path, TWO_MODELS)
    environ = {
        "LOGPROB_GATEWAY_PORT": "9100",
        "LOGPROB_GATEWAY_HOST": "10.0.0.1",
        "LOGPROB_GATEWAY_LOG_LEVEL": "debug",
        "LOGPROB_GATEWAY_REDIS_URL": "redis://env:6379/0",
        "LOGPROB_GATEWAY_ADMIN_KEY": "secret",
    }
    from_env = load_settings(path, environ=environ)
    assert from_env.port == 9100  # environment beats the file, converted from its string
    assert from_env.host == "10.0.0.1"
    assert from_env.log_level == "debug"
    assert from_env.admin_key == "secret"
    assert from_env.cache.redis_url == "redis://env:6379/0"
    assert from_env.cache.ttl_s == 60  # the file's other cache fields stay
    assert [m.served_name for m in from_env.models] == ["small", "tiny-llama"]

    flags = {"port": 9200, "log_level": "error", "host": None, "redis_url": "redis://flag:6379/1"}
    final = load_settings(path, flags, environ=environ)
    assert final.port == 9200  # overrides beat the environment
    assert final.log_level == "error"
    assert final.host == "10.0.0.1"  # a None override is ignored
    assert final.cache.redis_url == "redis://flag:6379/1"
    assert final.admin_key == "secret"

    file_only = load_settings(path, environ={})
    assert (file_only.port, file_only.host, file_only.log_level) == (9000, "0.0.0.0", "warning")


def test_environment_cache_switch_and_model_fields():
    settings = load_settings(
        environ={
            "LOGPROB_GATEWAY_CACHE": "false",
            "LOGPROB_GATEWAY_MAX_MODEL_LEN": "512",
            "LOGPROB_GATEWAY_DTYPE": "float16",
        }
    )
    assert settings.cache.enabled is False
    assert len(settings.models) == 1
    assert settings.models[0].max_model_len == 512
    assert settings.models[0].dtype == "float16"
    assert settings.models[0].served_name == "smollm2-135m"


def test_model_override_replaces_the_file_models(tmp_path):
    path = write(tmp_path, TWO_MODELS)
    settings = load_settings(path, {"model": "/weights/other-model", "dtype": "float16"}, environ={})
    assert len(settings.models) == 1
    model = settings.models[0]
    assert model.served_name == "other-model"
    assert (model.model, model.backend, model.dtype) == ("/weights/other-model", "transformers", "float16")
    assert model.options == {}  # nothing of the file's models survives
    assert settings.port == 9000  # the file's other settings do


def test_model_from_environment_replaces_the_file_models(tmp_path):
    path = write(tmp_path, TWO_MODELS)
    environ = {"LOGPROB_GATEWAY_MODEL": "/weights/env-model", "LOGPROB_GATEWAY_SERVED_MODEL_NAME": "envy"}
    settings = load_settings(path, environ=environ)
    assert [(m.served_name, m.model) for m in settings.models] == [("envy", "/weights/env-model")]


def test_backend_alone_applies_to_every_configured_model(tmp_path):
    path = write(tmp_path, TWO_MODELS)
    settings = load_settings(path, {"backend": "mock"}, environ={})
    assert [m.served_name for m in settings.models] == ["small", "tiny-llama"]
    assert [m.backend for m in settings.models] == ["mock", "mock"]
    assert [m.dtype for m in settings.models] == ["float32", "bfloat16"]  # the rest stays
    assert settings.models[0].options == {"attn_implementation": "eager", "compile": False}

    default = load_settings(overrides={"backend": "mock"}, environ={})
    assert [(m.served_name, m.backend) for m in default.models] == [("smollm2-135m", "mock")]


def test_weights_root_from_a_flag_or_the_environment_applies_to_every_model(tmp_path):
    path = write(tmp_path, TWO_MODELS)
    assert [m.weights_root for m in load_settings(path, environ={}).models] == [None, None]
    from_env = load_settings(path, environ={"LOGPROB_GATEWAY_WEIGHTS_ROOT": "/checkpoints"})
    assert [m.weights_root for m in from_env.models] == ["/checkpoints", "/checkpoints"]
    args = cli.build_parser().parse_args(["serve", "--config", str(path), "--weights-root", "/ckpt"])
    assert [m.weights_root for m in cli.settings_from_args(args).models] == ["/ckpt", "/ckpt"]


def test_chat_template_settings_from_a_flag_the_environment_or_the_file(tmp_path):
    path = write(
        tmp_path, TWO_MODELS.replace('backend = "mock"', 'backend = "mock"\ntool_call_format = "mistral"')
    )
    from_file = load_settings(path, environ={}).models
    assert [(m.chat_template, m.chat_templates_root, m.tool_call_format) for m in from_file] == [
        (None, None, None),
        (None, None, "mistral"),
    ]
    environ = {
        "LOGPROB_GATEWAY_CHAT_TEMPLATE": "family/chat.jinja",
        "LOGPROB_GATEWAY_CHAT_TEMPLATES_ROOT": "/templates",
        "LOGPROB_GATEWAY_TOOL_CALL_FORMAT": "hermes",
    }
    for model in load_settings(path, environ=environ).models:
        assert (model.chat_template, model.chat_templates_root, model.tool_call_format) == (
            "family/chat.jinja",
            "/templates",
            "hermes",
        )
    flags = ["--chat-template", "smollm2-tools", "--tool-call-format", "llama3_json"]
    args = cli.build_parser().parse_args(["serve", "--model", "smollm2-135m", *flags])
    (model,) = cli.settings_from_args(args).models
    assert (model.chat_template, model.tool_call_format) == ("smollm2-tools", "llama3_json")
    with pytest.raises(ConfigError, match="unknown tool_call_format 'json'; choose one of: hermes, "):
        load_settings(environ={"LOGPROB_GATEWAY_TOOL_CALL_FORMAT": "json"})


BAD_FILES = {
    "duplicate-names": (
        '[[models]]\nname = "a"\n\n[[models]]\nname = "a"\nmodel = "/x/y"\n',
        "model names must be unique; repeated: a",
    ),
    "duplicate-derived-names": (
        '[[models]]\nmodel = "/one/m"\n\n[[models]]\nmodel = "/two/m"\n',
        "model names must be unique; repeated: m",
    ),
    "unknown-backend": (
        '[[models]]\nname = "a"\nbackend = "tensorrt"\n',
        "model 'a': unknown backend 'tensorrt'; choose one of: " + ", ".join(BACKEND_NAMES),
    ),
    "colon-in-name": (
        '[[models]]\nname = "base:lora"\n',
        "model name 'base:lora' must not contain ':' (it selects adapters)",
    ),
    "bad-dtype": ('[[models]]\ndtype = "float64"\n', "Invalid enum value 'float64' - at `$.models[0].dtype`"),
    "unknown-top-level-key": ('colour = "blue"\n', "Object contains unknown field `colour`"),
    "unknown-model-key": (
        "[[models]]\ntemprature = 0.5\n",
        "Object contains unknown field `temprature` - at `$.models[0]`",
    ),
    "removed-batch-window": (  # gone with the gateway's own batching: the engine's scheduler batches
        "[[models]]\nbatch_window_ms = 2.0\n",
        "Object contains unknown field `batch_window_ms` - at `$.models[0]`",
    ),
    "unknown-tool-call-format": (
        '[[models]]\nname = "a"\ntool_call_format = "xml"\n',
        "model 'a': unknown tool_call_format 'xml'; choose one of: hermes, llama3_json, mistral",
    ),
    "empty-chat-template": (
        '[[models]]\nname = "a"\nchat_template = ""\n',
        "model 'a': chat_template is empty; leave it out for the default",
    ),
    "empty-chat-templates-root": (
        '[[models]]\nname = "a"\nchat_templates_root = ""\n',
        "model 'a': chat_templates_root is empty; leave it out for the default",
    ),
    "port-out-of-range": ("port = 70000\n", "Expected `int` <= 65535 - at `$.port`"),
    "no-models": ("models = []\n", "at least one model must be configured"),
    "models-not-a-list": ('models = "smollm2-135m"\n', "Expected `array`, got `str` - at `$.models`"),
}


@pytest.mark.parametrize(("text", "message"), list(BAD_FILES.values()), ids=list(BAD_FILES))
def test_invalid_file_is_a_one_line_config_error(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ={})
    assert str(caught.value) == f"invalid configuration in {path}: {message}"


def test_invalid_toml(tmp_path):
    path = write(tmp_path, 'port = \n[[models]\nname = "a"\n')
    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ={})
    text = str(caught.value)
    assert text.startswith(f"config file {path} is not valid TOML: ")
    assert "line 1" in text
    assert "\n" not in text


def test_missing_file(tmp_path):
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match="^config file not found: .*absent.toml$"):
        load_settings(path, environ={})
    with pytest.raises(ConfigError, match="^config file not found: /nowhere.toml$"):
        load_settings(environ={"LOGPROB_GATEWAY_CONFIG": "/nowhere.toml"})


def test_invalid_environment_value():
    with pytest.raises(ConfigError) as caught:
        load_settings(environ={"LOGPROB_GATEWAY_PORT": "eighty"})
    assert str(caught.value) == "invalid configuration: Expected `int`, got `str` - at `$.port`"


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        ('models = "x"\n', {"backend": "mock"}, "Expected `array`, got `str` - at `$.models`"),
        ("models = [1]\n", {"dtype": "float32"}, "Expected `object`, got `int` - at `$.models[0]`"),
        ("cache = 5\n", {"redis_url": "redis://r:6379/0"}, "Expected `object`, got `int` - at `$.cache`"),
    ],
    ids=["models-string-with-backend", "models-of-ints-with-dtype", "cache-int-with-redis-url"],
)
def test_malformed_table_with_overrides_is_a_config_error(tmp_path, text, overrides, message):
    """An override merged into a malformed table must not crash with a TypeError."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_settings(path, overrides, environ={})
    assert str(caught.value) == f"invalid configuration in {path}: {message}"


def test_override_creating_duplicate_names(tmp_path):
    path = write(tmp_path, TWO_MODELS)
    with pytest.raises(ConfigError, match="model names must be unique; repeated: same$"):
        load_settings(path, {"name": "same"}, environ={})


# ---------------------------------------------------------------- the command line


def test_parser_reads_every_flag_into_settings():
    args = cli.build_parser().parse_args(
        [
            "serve",
            "--host", "0.0.0.0",
            "--port", "9001",
            "--model", "/weights/my-model",
            "--backend", "vllm",
            "--dense-backend", "mock",
            "--served-model-name", "mine",
            "--dtype", "bfloat16",
            "--device", "cpu",
            "--max-model-len", "1024",
            "--log-level", "debug",
            "--redis-url", "redis://cache:6379/0",
        ]
    )  # fmt: skip
    assert args.command == "serve" and args.config is None
    settings = cli.settings_from_args(args)
    assert (settings.host, settings.port, settings.log_level) == ("0.0.0.0", 9001, "debug")
    assert len(settings.models) == 1
    model = settings.models[0]
    assert model.served_name == "mine"
    assert (
        model.model,
        model.backend,
        model.dense_backend,
        model.dtype,
        model.device,
        model.max_model_len,
    ) == (
        "/weights/my-model",
        "vllm",
        "mock",
        "bfloat16",
        "cpu",
        1024,
    )
    assert settings.cache.redis_url == "redis://cache:6379/0"
    assert settings.cache.enabled is True


def test_parser_defaults_and_no_cache():
    args = cli.build_parser().parse_args(["serve", "--no-cache"])
    settings = cli.settings_from_args(args)
    assert settings.cache.enabled is False
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)
    assert [m.served_name for m in settings.models] == ["smollm2-135m"]


def test_flags_beat_environment_and_file(tmp_path, monkeypatch):
    path = write(tmp_path, TWO_MODELS)
    monkeypatch.setenv("LOGPROB_GATEWAY_PORT", "9100")
    monkeypatch.setenv("LOGPROB_GATEWAY_LOG_LEVEL", "debug")
    args = cli.build_parser().parse_args(
        ["serve", "--config", str(path), "--port", "9300", "--backend", "mock"]
    )
    settings = cli.settings_from_args(args)
    assert settings.port == 9300
    assert settings.log_level == "debug"
    assert [(m.served_name, m.backend) for m in settings.models] == [
        ("small", "mock"),
        ("tiny-llama", "mock"),
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--backend", "tensorrt"],
        ["serve", "--dense-backend", "vllm"],
        ["serve", "--dtype", "float64"],
        ["serve", "--port", "http"],
        ["serve", "--log-level", "loud"],
        ["serve", "--tool-call-format", "xml"],
        ["serve", "--max-model-len", "long"],
        [],
    ],
)
def test_parser_rejects_bad_flags(argv, capsys):
    with pytest.raises(SystemExit) as caught:
        cli.build_parser().parse_args(argv)
    assert caught.value.code == 2
    assert "logprob-gateway" in capsys.readouterr().err


def test_main_with_bad_config_returns_2_without_serving(tmp_path, capsys, no_serve):
    bad = write(tmp_path, '[[models]]\nname = "a"\nbackend = "tensorrt"\n')
    assert cli.main(["serve", "--config", str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"logprob-gateway: invalid configuration in {bad}: "
        "model 'a': unknown backend 'tensorrt'; choose one of: " + ", ".join(BACKEND_NAMES) + "\n"
    )
    assert no_serve == []


def test_main_with_missing_config_returns_2(tmp_path, capsys, no_serve):
    missing = tmp_path / "missing.toml"
    assert cli.main(["serve", "--config", str(missing)]) == 2
    assert capsys.readouterr().err == f"logprob-gateway: config file not found: {missing}\n"
    assert no_serve == []


def test_main_with_invalid_toml_returns_2(tmp_path, capsys, no_serve):
    bad = write(tmp_path, "port = = 1\n")
    assert cli.main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"logprob-gateway: config file {bad} is not valid TOML: ")
    assert err.count("\n") == 1 and err.endswith("\n")
    assert no_serve == []


def test_main_with_malformed_models_and_backend_flag_returns_2(tmp_path, capsys, no_serve):
    bad = write(tmp_path, 'models = "smollm2-135m"\n')
    assert cli.main(["serve", "--config", str(bad), "--backend", "mock"]) == 2
    assert capsys.readouterr().err == (
        f"logprob-gateway: invalid configuration in {bad}: Expected `array`, got `str` - at `$.models`\n"
    )
    assert no_serve == []


def test_main_with_good_config_serves_its_settings(tmp_path, capsys, no_serve):
    tiny_llama = tmp_path / "models" / "tiny-llama"
    tiny_llama.mkdir(parents=True)
    (tiny_llama / "config.json").write_text("{}")  # what is checked before loading
    path = write(tmp_path, TWO_MODELS.replace("/models/tiny-llama/", f"{tiny_llama}/"))
    assert cli.main(["serve", "--config", str(path), "--port", str(free_port())]) == 0
    assert capsys.readouterr().err == ""
    assert len(no_serve) == 1
    settings = no_serve[0]
    assert [m.served_name for m in settings.models] == ["small", "tiny-llama"]


def test_module_entry_point_exits_2_on_missing_config():
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", "/nonexistent.toml"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr == "logprob-gateway: config file not found: /nonexistent.toml\n"
    assert result.stdout == ""


def test_the_engines_threads_are_the_setting_else_omp_num_threads_else_half_the_cpus():
    half = max(1, cpus_available() // 2)
    assert compute_threads(3, {"OMP_NUM_THREADS": "8"}) == 3
    assert compute_threads(0, {"OMP_NUM_THREADS": "5"}) == 5
    assert compute_threads(0, {}) == compute_threads(0, {"OMP_NUM_THREADS": "junk"}) == half
    assert cli.settings_from_args(cli.build_parser().parse_args(["serve", "--threads", "3"])).threads == 3
    assert load_settings(environ={"LOGPROB_GATEWAY_THREADS": "2"}).threads == 2
    assert Settings().threads == 0
    # what `serve` does before loading, in a process of its own: torch's pool, and the variable
    # that engine processes started later read
    code = (
        "import os, torch; from backends.cpu_threads import use_compute_threads; "
        "print(use_compute_threads(0), torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(half)] * 3


def test_a_serving_process_freezes_what_loading_made_and_collects_less_often_an_embedded_app_does_neither():
    before, threshold = gc.get_freeze_count(), gc.get_threshold()
    assert threshold[0] < SERVING_GC_THRESHOLD
    with mock_app_client():
        pass
    assert gc.get_freeze_count() == before and gc.get_threshold() == threshold
    try:
        with mock_app_client(on_loaded=tune_collector):  # what `logprob-gateway serve` passes
            pass
        assert gc.get_freeze_count() > before
        assert gc.get_threshold() == (SERVING_GC_THRESHOLD, *threshold[1:])
    finally:
        gc.unfreeze()  # this test process goes on creating and dropping apps
        gc.set_threshold(*threshold)


# ---------------------------------------------------------------- --help and --version


def _serve_parser():
    commands = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def test_help_describes_the_gateway_not_the_module(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    assert "OpenAI-compatible HTTP gateway" in out
    assert "`logprob-gateway" not in out  # no docstring in the help


def test_every_serve_flag_has_help_and_the_settings_default():
    settings, model, cache = Settings(), ModelSettings(), CacheSettings()
    assert model.max_model_len is None and cache.redis_url is None  # said in words below
    expected = {
        "--host": settings.host,
        "--port": settings.port,
        "--model": model.model,
        "--backend": model.backend,
        "--dtype": model.dtype,
        "--device": model.device,
        "--log-level": settings.log_level,
        "--max-model-len": "the model's own",
        "--served-model-name": "from --model",
        "--redis-url": "an in-process LRU",
    }
    helps = {a.option_strings[-1]: a.help for a in _serve_parser()._actions if a.option_strings}
    for flag, default in expected.items():
        assert helps[flag].endswith(f"(default: {default})"), (flag, helps[flag])
    assert all(helps.values()), [flag for flag, text in helps.items() if not text]


def test_config_help_points_at_the_configuration_docs():
    config = next(a for a in _serve_parser()._actions if "--config" in a.option_strings)
    assert "docs/configuration.md" in config.help
    assert (REPO / "docs" / "configuration.md").is_file()


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out == f"logprob-gateway {importlib.metadata.version('logprob-gateway')}\n"
