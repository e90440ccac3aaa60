"""LoRA adapters selected by model name, with real PEFT adapters (tests/conftest.py), checked against a
direct transformers + PEFT forward pass of the same adapter."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from tests.conftest import MODEL, PROMPTS, last_row, load_peft_models

pytestmark = pytest.mark.slow
ADMIN = {"Authorization": "Bearer admin-secret"}


@pytest.fixture(scope="module")
def peft_reference(lora_adapters, model_dir):
    return load_peft_models(model_dir, lora_adapters[1])


def ref_greedy(model, ids, n):
    tokens = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids=tokens,
            attention_mask=torch.ones_like(tokens),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
        )
    return out[0, len(ids) :].tolist()


def dense(gateway, model, rows):
    r = httpx.post(
        gateway.base_url + "/v1/next_token_logprobs", json={"model": model, "input": rows}, timeout=60
    )
    assert r.status_code == 200, r.text
    return np.array([d["logprobs"] for d in r.json()["data"]], dtype=np.float32), r.json()["usage"][
        "cache_hits"
    ]


def complete(gateway, model, prompt, n=6):
    r = httpx.post(
        gateway.base_url + "/v1/completions",
        timeout=60,
        json={"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def admin(gateway, path, body, headers=ADMIN):
    return httpx.post(gateway.base_url + path, json=body, headers=headers, timeout=60)


def test_models_lists_adapters(lora_gateway, lora_adapters):
    data = httpx.get(lora_gateway.base_url + "/v1/models").json()["data"]
    by_id = {m["id"]: m for m in data}
    assert set(by_id) == {MODEL, f"{MODEL}:a"}
    assert by_id[f"{MODEL}:a"]["parent"] == MODEL and by_id[f"{MODEL}:a"]["root"] == str(
        lora_adapters[1]["a"]
    )


def test_dense_rows_and_greedy_text_equal_peft_forward(lora_gateway, peft_reference, reference):
    rows = [reference.tokenizer(p).input_ids for p in PROMPTS]
    base, _ = dense(lora_gateway, MODEL, rows)
    with_a, _ = dense(lora_gateway, f"{MODEL}:a", rows)
    for i, ids in enumerate(rows):
        assert np.max(np.abs(base[i] - reference.logprobs(ids)[-1])) <= 1e-4
        assert np.max(np.abs(with_a[i] - last_row(peft_reference["a"], ids))) <= 1e-4
    assert np.max(np.abs(with_a - base)) > 0.5  # the adapter really changes the model
    ids = rows[0]
    assert complete(lora_gateway, f"{MODEL}:a", PROMPTS[0]) == reference.tokenizer.decode(
        ref_greedy(peft_reference["a"], ids, 6)
    )
    assert complete(lora_gateway, MODEL, PROMPTS[0]) == reference.tokenizer.decode(reference.greedy(ids, 6))


def test_lora_path_names_the_adapter_on_openai_routes(lora_gateway, peft_reference, reference):
    """SGLang's `lora_path` beside the base's name, as a router that knows base names forwards it:
    the adapter's greedy text, on completions and chat; one that contradicts the model's adapter
    is a 400, an unknown one a 404."""
    ids = reference.tokenizer(PROMPTS[0]).input_ids
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "lora_path": "a"}
    r = httpx.post(lora_gateway.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference.tokenizer.decode(
        ref_greedy(peft_reference["a"], ids, 6)
    )
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
    named, beside = (
        httpx.post(lora_gateway.base_url + "/v1/chat/completions", json={**chat, **fields}, timeout=60)
        for fields in ({"model": f"{MODEL}:a"}, {"model": MODEL, "lora_path": "a"})
    )
    assert named.json()["choices"][0]["message"] == beside.json()["choices"][0]["message"]
    for fields, status in (({"model": f"{MODEL}:a", "lora_path": "b"}, 400), ({"lora_path": "nope"}, 404)):
        r = httpx.post(lora_gateway.base_url + "/v1/completions", json={**body, **fields}, timeout=60)
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == ("lora_path" if status == 400 else "model")


def test_runtime_load_mixed_concurrent_traffic_and_unload(lora_gateway, peft_reference, reference):
    r = admin(lora_gateway, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "b"})
    assert r.status_code == 200 and r.json()["id"] == f"{MODEL}:b"
    rows = [reference.tokenizer(p).input_ids for p in PROMPTS]
    names = [MODEL, f"{MODEL}:a", f"{MODEL}:b"]
    sequential = {n: dense(lora_gateway, n, rows)[0] for n in names}
    texts = {n: complete(lora_gateway, n, PROMPTS[1], 4) for n in names}
    for i, ids in enumerate(rows):
        assert np.max(np.abs(sequential[f"{MODEL}:b"][i] - last_row(peft_reference["b"], ids))) <= 1e-4

    async def mixed():
        async with httpx.AsyncClient(base_url=lora_gateway.base_url, timeout=120) as client:

            async def one(name, k):
                prefix = rows[k % len(rows)] + [k]  # fresh rows, so the engine computes them together
                r = await client.post("/v1/next_token_logprobs", json={"model": name, "input": [prefix]})
                return name, prefix, np.array(r.json()["data"][0]["logprobs"], dtype=np.float32)

            async def text(name):
                r = await client.post(
                    "/v1/completions",
                    json={"model": name, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0},
                )
                return name, r.json()["choices"][0]["text"]

            dense_results = asyncio.gather(*(one(names[k % 3], k) for k in range(24)))
            text_results = asyncio.gather(*(text(n) for n in names))
            return await dense_results, await text_results

    dense_results, text_results = asyncio.run(mixed())
    models = {MODEL: reference.model, f"{MODEL}:a": peft_reference["a"], f"{MODEL}:b": peft_reference["b"]}
    for name, prefix, row in dense_results:
        assert np.max(np.abs(row - last_row(models[name], prefix))) <= 1e-4
    assert dict(text_results) == texts

    r = admin(lora_gateway, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert r.status_code == 200 and r.json()["status"] == "unloaded"
    gone = httpx.post(
        lora_gateway.base_url + "/v1/next_token_logprobs", json={"model": f"{MODEL}:b", "input": [[1]]}
    )
    assert gone.status_code == 404
    assert f"{MODEL}:a" in gone.json()["error"]["message"]  # lists what is available
    again, _ = dense(lora_gateway, MODEL, rows)
    assert np.max(np.abs(again - sequential[MODEL])) <= 1e-4  # the base is untouched


def test_adapters_never_share_cache_entries(lora_gateway, reference):
    rows = [reference.tokenizer("Cache per adapter").input_ids]
    base, _ = dense(lora_gateway, MODEL, rows)
    with_a, hits = dense(lora_gateway, f"{MODEL}:a", rows)
    assert hits == 0 and np.max(np.abs(with_a - base)) > 0.5
    _, hits = dense(lora_gateway, f"{MODEL}:a", rows)
    assert hits == 1


@pytest.mark.hostile
def test_a_name_reloaded_from_other_weights_serves_their_rows_not_the_cached_ones(lora_gateway, reference):
    # "a" and "b" share one LoRA config and its tensors' shapes: only their values differ.
    rows = [reference.tokenizer("One name, two checkpoints").input_ids]
    with_a, _ = dense(lora_gateway, f"{MODEL}:a", rows)
    try:
        assert (
            admin(lora_gateway, "/v1/load_lora_adapter", {"lora_name": "e", "lora_path": "b"}).status_code
            == 200
        )
        with_b, _ = dense(lora_gateway, f"{MODEL}:e", rows)  # cached under "e"
        assert admin(lora_gateway, "/v1/unload_lora_adapter", {"lora_name": "e"}).status_code == 200
        assert (
            admin(lora_gateway, "/v1/load_lora_adapter", {"lora_name": "e", "lora_path": "a"}).status_code
            == 200
        )
        again, _ = dense(lora_gateway, f"{MODEL}:e", rows)
    finally:
        admin(lora_gateway, "/v1/unload_lora_adapter", {"lora_name": "e"})
    assert np.max(np.abs(with_b - with_a)) > 0.1
    assert np.max(np.abs(again - with_a)) <= 1e-4, "b's row, cached under the same name, came back"


@pytest.mark.parametrize(
    ("body", "headers", "status", "needle"),
    [
        ({"lora_name": "c", "lora_path": "a"}, {}, 401, "admin key"),
        ({"lora_name": "c", "lora_path": "a"}, {"Authorization": "Bearer wrong"}, 401, "admin key"),
        ({"lora_name": "c", "lora_path": "../outside"}, ADMIN, 403, "adapters root"),
        ({"lora_name": "c", "lora_path": "/etc"}, ADMIN, 403, "adapters root"),
        ({"lora_name": "c", "lora_path": "link"}, ADMIN, 403, "adapters root"),
        ({"lora_name": "c", "lora_path": "too_big"}, ADMIN, 400, "rank"),
        ({"lora_name": "c", "lora_path": "pickled"}, ADMIN, 400, "safetensors"),
        ({"lora_name": "c", "lora_path": "mismatched"}, ADMIN, 400, "does not fit"),
        ({"lora_name": "c", "lora_path": "missing"}, ADMIN, 400, "adapter_config.json"),
        ({"lora_name": "a", "lora_path": "b"}, ADMIN, 400, "already loaded"),
        ({"lora_name": "bad name!", "lora_path": "b"}, ADMIN, 400, "adapter name"),
        ({"lora_name": "c\n", "lora_path": "b"}, ADMIN, 400, "adapter name"),
        # paths the filesystem itself rejects
        ({"lora_name": "c", "lora_path": "b\x00"}, ADMIN, 400, "not a usable path"),
        ({"lora_name": "c", "lora_path": "x" * 300}, ADMIN, 400, "File name too long"),
        ({"lora_name": "c", "lora_path": "a/" * 2500}, ADMIN, 400, "length <= 4096"),  # refused at decode
        ({"lora_name": "c", "lora_path": "loop"}, ADMIN, 400, "symbolic links"),
        # files of an adapter inside the root that lead outside it
        ({"lora_name": "c", "lora_path": "leaky-adapter_model.safetensors"}, ADMIN, 403, "outside"),
        ({"lora_name": "c", "lora_path": "leaky-adapter_config.json"}, ADMIN, 403, "outside"),
    ],
)
def test_bad_admin_requests_leave_the_service_unchanged(lora_gateway, body, headers, status, needle):
    before = httpx.get(lora_gateway.base_url + "/v1/models").json()["data"]
    r = admin(lora_gateway, "/v1/load_lora_adapter", body, headers)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    assert httpx.get(lora_gateway.base_url + "/v1/models").json()["data"] == before
    assert httpx.get(lora_gateway.base_url + "/health").status_code == 200


def test_a_path_through_another_process_root_is_refused(lora_gateway):
    """/proc/1/root is unreadable in some containers even to root (PermissionError while
    resolving) and leads to "/" elsewhere (outside the root): refused either way."""
    before = httpx.get(lora_gateway.base_url + "/v1/models").json()["data"]
    r = admin(lora_gateway, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "/proc/1/root/etc"})
    assert r.status_code in (400, 403), r.text
    assert r.json()["error"]["param"] == "lora_path"
    assert httpx.get(lora_gateway.base_url + "/v1/models").json()["data"] == before


def test_admin_endpoints_are_off_without_an_admin_key(http):
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "a"})
    assert r.status_code == 403 and "disabled" in r.json()["error"]["message"]
    assert http.post("/v1/completions", json={"model": f"{MODEL}:nope", "prompt": "x"}).status_code == 404


@pytest.mark.hostile
def test_an_unload_waits_for_the_stream_that_uses_the_adapter(lora_gateway, lora_adapters):
    """A stream on "u" under way when "u" is unloaded runs to its end; the unload answers after
    it, and a request that names "u" meanwhile is a 404."""
    assert (
        admin(lora_gateway, "/v1/load_lora_adapter", {"lora_name": "u", "lora_path": "b"}).status_code == 200
    )
    body = {
        "model": f"{MODEL}:u",
        "prompt": "1, 2, 3, 4,",
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
    }
    unloaded: dict[str, object] = {}

    def unload() -> None:
        answer = admin(lora_gateway, "/v1/unload_lora_adapter", {"lora_name": "u"})
        unloaded.update(status=answer.status_code, at=time.monotonic())

    events = []
    with httpx.stream("POST", lora_gateway.base_url + "/v1/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        events.append(next(line for line in lines if line.startswith("data: ")))
        unloading = threading.Thread(target=unload)
        unloading.start()
        time.sleep(0.3)
        meanwhile = httpx.post(
            lora_gateway.base_url + "/v1/completions", json={**body, "stream": False}, timeout=60
        )
        events.extend(line for line in lines if line.startswith("data: "))
        ended = time.monotonic()
    unloading.join()
    assert meanwhile.status_code == 404, meanwhile.text
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event[6:]) for event in events[:-1]]
    assert not any("error" in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert unloaded["status"] == 200 and unloaded["at"] >= ended - 0.05
    assert "non-existing adapter" not in lora_gateway.log_path.read_text()


@pytest.mark.hostile
def test_an_unload_outlasted_by_its_streams_is_refused_and_keeps_the_adapter(model_dir, lora_adapters):
    """The mock engine, slow: a 400-step stream outlasts the unload's bound (429, still served)."""
    from gateway.settings import Limits, ModelSettings, Settings
    from tests.conftest import mock_app_client

    model = ModelSettings(
        name="mock",
        model=str(model_dir),
        backend="mock",
        options={"delay_s": 0.02},
        adapters={"u": str(lora_adapters[1]["a"])},
    )
    settings = Settings(admin_key="admin-secret", models=[model], limits=Limits(weights_update_wait_s=0.5))
    with mock_app_client(settings=settings) as (_, client):
        done: dict[str, int] = {}

        def stream() -> None:
            body = {"model": "mock:u", "prompt": "hi", "max_tokens": 400, "stream": True}
            done["stream"] = client.post("/v1/completions", json=body).status_code

        streaming = threading.Thread(target=stream)
        streaming.start()
        time.sleep(0.5)
        answer = client.post("/v1/unload_lora_adapter", json={"lora_name": "u"}, headers=ADMIN)
        assert answer.status_code == 429 and "weights_update_wait_s" in answer.json()["error"]["message"]
        assert answer.headers["retry-after"]
        assert (
            client.post("/v1/next_token_logprobs", json={"model": "mock:u", "input": [[5]]}).status_code
            == 200
        )
        streaming.join()
        assert done["stream"] == 200
        assert (
            client.post("/v1/unload_lora_adapter", json={"lora_name": "u"}, headers=ADMIN).status_code == 200
        )
