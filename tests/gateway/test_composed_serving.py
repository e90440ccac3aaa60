"""A model made of two engines (`dense_backend`), served: each route reaches the engine it should
(two mock engines with different "weights", so every number says where it came from), its stats
show its dense engine's shared passes (a transformers one), a model whose engines were left apart
answers 503 until new weights load, and compositions that cannot be are refused at start with
status 2. The real engines: test_composed_vllm.py."""

from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

from gateway.settings import ConfigError, ModelSettings, Settings, load_settings
from tests.conftest import mock_app_client
from tests.gateway.test_serve_checks import QUICK_S, serve

IDS = [504, 3575, 282, 4649, 314]
ADMIN = {"Authorization": "Bearer admin-secret"}


def composed_settings(weights_root=None) -> Settings:
    return Settings(
        admin_key="admin-secret",
        models=[ModelSettings(name="mock", backend="mock", dense_backend="mock", weights_root=weights_root)],
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The app and its client; the dense engine's rows differ from the generation engine's."""
    other = tmp_path_factory.mktemp("other-weights")
    (other / "config.json").write_text("{}")
    with mock_app_client(settings=composed_settings()) as (app, client):
        engine = app.state.registry.models["mock"].engine
        asyncio.run(engine.dense.weights.load(str(other)))  # a mock's weights: no event loop of its own
        yield client, engine.generation, engine.dense


def test_dense_rows_come_from_the_dense_engine(served):
    client, generation, dense = served
    answer = client.post("/v1/next_token_logprobs", json={"model": "mock", "input": [IDS, IDS[:2]]})
    assert answer.status_code == 200, answer.text
    got = np.array([d["logprobs"] for d in answer.json()["data"]], np.float32)
    np.testing.assert_array_equal(got, [dense.logits(IDS), dense.logits(IDS[:2])])
    assert not np.array_equal(got[0], generation.logits(IDS))


def test_echo_scores_come_from_the_dense_engine_and_generate_nothing(served):
    client, generation, dense = served
    calls = generation.calls
    body = {"model": "mock", "prompt": IDS, "max_tokens": 0, "echo": True, "logprobs": 1}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    got = answer.json()["choices"][0]["logprobs"]["token_logprobs"]
    want = [float(dense.logits(IDS[:i])[IDS[i]]) for i in range(1, len(IDS))]
    assert got[0] is None and np.allclose(got[1:], want, atol=1e-6)
    assert generation.calls == calls


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_sglang_prefill_only_scores_come_from_the_dense_engine(served, temperature):
    """SGLang's scoring call (max_new_tokens 0, logprob_start_len): the prompt's scores and the
    would-be next token, all from the dense engine's rows; the generation engine is not asked."""
    client, generation, dense = served
    calls = generation.calls
    body = {
        "input_ids": IDS,
        "sampling_params": {"max_new_tokens": 0, "temperature": temperature, "sampling_seed": 3},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    answer = client.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    meta = answer.json()["meta_info"]
    want = [float(dense.logits(IDS[:i])[IDS[i]]) for i in range(1, len(IDS))]
    assert np.allclose([e[0] for e in meta["input_token_logprobs"][1:]], want, atol=1e-6)
    (logprob, token, _) = meta["output_token_logprobs"][0]
    row = dense.logits(IDS).astype(np.float64)
    if temperature == 0.0:
        assert token == int(np.argmax(row))
    scaled = row / temperature if temperature else row
    scaled -= np.log(np.exp(scaled - scaled.max()).sum()) + scaled.max()
    assert logprob == pytest.approx(scaled[token], abs=1e-5)  # at the temperature, as SGLang reports
    assert generation.calls == calls


@pytest.mark.slow
def test_the_stats_of_a_composed_model_show_its_dense_engines_passes():
    """The passes are those of the engine whose scheduler runs them: a transformers dense engine
    (its own scheduler), not the mock generation engine (none)."""
    settings = Settings(models=[ModelSettings(name="mock", backend="mock", dense_backend="transformers")])
    with mock_app_client(settings=settings) as (app, client):
        engine = app.state.registry.models["mock"].engine
        assert engine.generation.status().pass_stats is None
        answer = client.post("/v1/next_token_logprobs", json={"model": "mock", "input": [IDS, IDS[:2]]})
        assert answer.status_code == 200, answer.text
        stats = client.get("/v1/models/mock/stats").json()["engine_passes"]
        dense = engine.dense.status().pass_stats
        assert stats == {
            "passes": dense.passes,
            "submissions": dense.submissions,
            "rows": dense.rows,
            "largest": dense.largest,
        }
        assert stats["passes"] >= 1 and stats["rows"] >= 2  # the call's two rows, in its passes


def test_generated_tokens_come_from_the_generation_engine(served):
    client, generation, dense = served
    body = {"model": "mock", "prompt": IDS, "max_tokens": 4, "temperature": 0, "logprobs": 0}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    got = answer.json()["choices"][0]["logprobs"]["token_logprobs"]
    prefix, want = list(IDS), []
    for _ in range(4):
        row = generation.logits(prefix)
        want.append(float(row.max()))
        prefix.append(int(np.argmax(row)))
    assert np.allclose(got, want, atol=1e-6)
    assert float(dense.logits(IDS).max()) != pytest.approx(want[0], abs=1e-6)


def test_engines_left_apart_answer_503_until_weights_load_into_both(tmp_path):
    for name in ("old", "new", "fixed"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"name": name}))
        save_file({"w": np.full(2, len(name), np.float32)}, tmp_path / name / "model.safetensors")
    with mock_app_client(settings=composed_settings(str(tmp_path))) as (app, client):
        engine = app.state.registry.models["mock"].engine
        old, dense_load = engine.dense.info.path, engine.dense.weights.load

        async def broken(path: str) -> None:
            raise RuntimeError("the engine core died")

        async def only_new(path: str) -> None:
            if path == old:
                raise OSError("the old checkpoint is gone")
            await dense_load(path)

        engine.generation.weights.load, engine.dense.weights.load = broken, only_new
        update = client.post("/update_weights_from_disk", json={"model_path": "new"}, headers=ADMIN)
        assert update.status_code == 503, update.text
        dense = client.post("/v1/next_token_logprobs", json={"model": "mock", "input": [IDS]})
        completion = client.post("/v1/completions", json={"model": "mock", "prompt": IDS, "max_tokens": 2})
        for answer in (dense, completion):
            assert answer.status_code == 503, answer.text
            assert "hold different weights" in answer.json()["error"]["message"]
        assert client.get("/health").status_code == 503
        del engine.generation.weights.load
        fixed = client.post("/update_weights_from_disk", json={"model_path": "fixed"}, headers=ADMIN)
        assert fixed.status_code == 200, fixed.text
        assert client.get("/health").status_code == 200
        dense = client.post("/v1/next_token_logprobs", json={"model": "mock", "input": [IDS]})
        assert dense.status_code == 200, dense.text


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('dense_backend = "vllm"', "dense_backend 'vllm' cannot compute a composed model's dense rows"),
        (
            'dense_backend = "tgi"',
            "unknown dense_backend 'tgi'; choose one of: self, transformers, mock, mlx",
        ),
        ("dense_options = {a = 1}", "dense_options without a dense_backend"),
    ],
)
def test_compositions_that_cannot_be_are_refused_in_the_settings(line, message, tmp_path):
    config = tmp_path / "gateway.toml"
    config.write_text(f'[[models]]\nbackend = "mock"\n{line}\n')
    with pytest.raises(ConfigError, match=message):
        load_settings(config, environ={})


def tokenizer_with_another_eos(model_dir, path):
    path.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, path / name)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    return path


@pytest.mark.parametrize("mismatch", ["tokenizer", "vocab_size"])
def test_engines_that_do_not_match_stop_the_server_with_status_2(mismatch, model_dir, tmp_path):
    """Found once both engines have loaded (their `info`), then said as a refused setting is."""
    from bench.launcher import free_port

    if mismatch == "tokenizer":
        options = f'{{tokenizer = "{tokenizer_with_another_eos(model_dir, tmp_path / "tokenizer")}"}}'
        expected = "their tokenizers' special tokens differ at 'eos_token'"
    else:
        options, expected = "{vocab_size = 49280}", "their vocabulary sizes differ"
    config = tmp_path / "gateway.toml"
    config.write_text(f'[[models]]\nbackend = "mock"\ndense_backend = "mock"\ndense_options = {options}\n')
    result, _ = serve("--port", str(free_port()), "--config", str(config), timeout=120)
    assert result.returncode == 2, result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("logprob-gateway:")]
    assert len(said) == 1 and "Traceback" not in result.stderr, result.stderr
    assert said[0].startswith("logprob-gateway: model 'smollm2-135m': the generation and dense engines")
    assert expected in said[0]


def test_a_dense_backend_that_cannot_compute_rows_fails_at_once(tmp_path):
    config = tmp_path / "gateway.toml"
    config.write_text('[[models]]\nbackend = "mock"\ndense_backend = "sglang"\n')
    result, elapsed = serve("--port", "0", "--config", str(config))
    assert result.returncode == 2 and elapsed < QUICK_S, result.stderr
    assert result.stderr.count("\n") == 1 and "dense_backend 'sglang' cannot compute" in result.stderr
