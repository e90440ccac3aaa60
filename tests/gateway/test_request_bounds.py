"""Bounds on what one request may cost or leave behind, through a real gateway process serving the
real model with API keys and an admin key: the logprob entries of an answer (counted before any
work), free text bounded at decode and kept out of the log, /flush_cache behind the admin key,
and OpenAI's rules for `stream_options` and a body's Content-Type."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import msgspec
import numpy as np
import openai
import pytest

from bench.launcher import start_gateway
from gateway.access import hash_key
from tests.conftest import MODEL, memory_kib, mock_app_client, start_real_gateway

pytestmark = pytest.mark.slow

ALICE, ADMIN = "sk-alice-bounds-0123", "admin-bounds-secret-42"
MARKER = "zq-caller-text-7731"  # a caller's identifier that must never reach the log
BODY_LIMIT = 4 * 2**20
MiB = 2**20


@pytest.fixture(scope="module")
def bounded(model_dir, scaled_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("bounds")
    settings = f'api_keys = ["{hash_key(ALICE, "alice")}"]\nadmin_key = "{ADMIN}"\n\n[limits]\nmax_body_bytes = {BODY_LIMIT}'
    process = start_real_gateway(model_dir, workdir, settings, f'weights_root = "{scaled_dir.parent}"')
    yield process
    process.stop()


def call(gateway, method, path, key=ALICE, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers.update(kwargs.pop("headers", {}))
    return httpx.request(method, gateway.base_url + path, headers=headers, timeout=300, **kwargs)


def error_of(response, status, param=None):
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error


def peak_rss_reset(pid: int) -> int:
    """The process's resident set now, after resetting its peak (VmHWM) to it."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return memory_kib(pid, "VmRSS") * 1024


def peak_rss(pid: int) -> int:
    return memory_kib(pid, "VmHWM") * 1024


# -- item: the answer's size, bounded before any work -------------------------------------------


def test_generate_asking_every_id_at_every_position_is_refused_before_any_work(bounded):
    # 1,000 positions x 49,152 named ids: a 1.6 GB answer when served
    body = {
        "input_ids": list(range(1, 1001)),
        "return_logprob": True,
        "logprob_start_len": 0,
        "token_ids_logprob": list(range(49152)),
        "sampling_params": {"max_new_tokens": 1},
    }
    before = peak_rss_reset(bounded.process.pid)
    error = error_of(call(bounded, "POST", "/generate", json=body), 400, "token_ids_logprob")
    assert "/v1/next_token_logprobs" in error["message"] and "logprob_start_len" in error["message"]
    assert peak_rss(bounded.process.pid) < before + 64 * MiB


def test_a_large_answer_within_the_cap_is_served(bounded, reference):
    # every id at 22 positions: ~1.08 M entries (few positions: each is a dense row of its prefix)
    ids = reference.tokenizer("The capital of France is Paris. " * 4)["input_ids"][:22]
    wanted = list(range(49152))
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "logprob_start_len": 0,
        "token_ids_logprob": wanted,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }
    response = call(bounded, "POST", "/generate", json=body)
    assert response.status_code == 200, response.text[:500]
    meta = response.json()["meta_info"]
    rows = meta["input_token_ids_logprobs"]
    assert len(rows) == len(ids) and rows[0] is None
    assert all(len(row) == len(wanted) for row in rows[1:])
    expected = reference.logprobs(ids)  # row t: the token after ids[: t + 1]
    for position in (1, 11, len(ids) - 1):
        got = [triple[0] for triple in rows[position]]
        np.testing.assert_allclose(got, expected[position - 1, wanted], atol=1e-4)
    assert len(meta["output_token_ids_logprobs"][0]) == len(wanted)


def test_completions_echo_with_top_logprobs_over_many_prompts_is_refused(bounded):
    client = openai.OpenAI(base_url=bounded.base_url + "/v1", api_key=ALICE, max_retries=0)
    prompts = [[1 + i] * 2000 for i in range(64)]  # 64 x 16 choices x 2,016 positions x 22 entries
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=20, n=16, max_tokens=16)
    assert refused.value.body["param"] == "logprobs"
    assert "logprob entries" in refused.value.body["message"]
    small = client.completions.create(model=MODEL, prompt=[[1, 2, 3]], echo=True, logprobs=20, max_tokens=1)
    assert len(small.choices[0].logprobs.top_logprobs) == 4


# -- item: OpenAI's rules for stream_options and a body's Content-Type ---------------------------

STREAM_OPTIONS_MESSAGE = "The 'stream_options' parameter is only allowed when 'stream' is enabled."


def test_stream_options_without_stream_is_refused_as_openai_does(bounded):
    client = openai.OpenAI(base_url=bounded.base_url + "/v1", api_key=ALICE, max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=1, stream=False, stream_options={"include_usage": True}
        )
    assert refused.value.body["message"] == STREAM_OPTIONS_MESSAGE
    assert refused.value.body["param"] == "stream_options"
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, stream_options={"include_usage": True}
        )
    assert refused.value.body["message"] == STREAM_OPTIONS_MESSAGE
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage is not None


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1}),
        ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}),
    ],
)
def test_a_body_that_is_neither_json_nor_msgpack_is_a_415(bounded, path, body):
    raw = json.dumps(body).encode()
    for media_type in ("application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x"):
        response = call(bounded, "POST", path, content=raw, headers={"Content-Type": media_type})
        error = error_of(response, 415)
        assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    for headers in ({"Content-Type": "application/json; charset=utf-8"}, {}):
        assert call(bounded, "POST", path, content=raw, headers=headers).status_code == 200
    packed = msgspec.msgpack.encode(body)
    assert call(
        bounded, "POST", path, content=packed, headers={"Content-Type": "application/msgpack"}
    ).is_success


# -- item: /flush_cache ----------------------------------------------------------------------------


def test_flush_cache_needs_the_admin_key_and_reads_a_bounded_body(bounded):
    rows = {"model": MODEL, "input": [[1, 2, 3, 4, 5]]}
    call(bounded, "POST", "/v1/next_token_logprobs", json=rows)
    hits = lambda: call(bounded, "POST", "/v1/next_token_logprobs", json=rows).json()["usage"]["cache_hits"]  # noqa: E731
    assert hits() == 1
    error_of(call(bounded, "POST", "/flush_cache"), 401)  # an ordinary key
    error_of(call(bounded, "GET", "/flush_cache", key="admin-wrong"), 401)
    error_of(call(bounded, "POST", "/flush_cache", key=None), 401)
    assert hits() == 1  # nothing was flushed
    big = b"x" * (BODY_LIMIT + MiB)
    error_of(call(bounded, "POST", "/flush_cache", key=ADMIN, content=big), 413)
    assert hits() == 1
    flushed = call(bounded, "POST", "/flush_cache", key=ADMIN)
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
    assert hits() == 0  # computed again
    assert hits() == 1


def test_flush_cache_is_forbidden_without_an_admin_key_configured():
    with mock_app_client() as (_, client):
        response = client.post("/flush_cache")
    assert response.status_code == 403 and response.json()["error"]["type"] == "permission_error"


def test_open_flush_cache_opens_it_to_every_key(monkeypatch, tmp_path):
    monkeypatch.setenv("LOGPROB_GATEWAY_OPEN_FLUSH_CACHE", "true")
    monkeypatch.setenv("LOGPROB_GATEWAY_API_KEYS", hash_key(ALICE, "alice"))
    gateway = start_gateway(["--backend", "mock"], tmp_path / "gateway.log")
    try:
        assert call(gateway, "POST", "/flush_cache").status_code == 200
        assert call(gateway, "POST", "/flush_cache", key="sk-not-a-key").status_code == 401
    finally:
        gateway.stop()


# -- item: free text bounded at decode, and never logged -----------------------------------------


def test_free_text_fields_are_bounded_at_decode(bounded):
    long = "v" * (5 * MiB // 2)  # 2.5 MB: under the body limit
    admin = {"key": ADMIN}
    cases = [
        (
            "/update_weights_from_disk",
            {"model_path": "/nowhere", "weight_version": long},
            "weight_version",
            admin,
        ),
        (
            "/update_weights_from_distributed",
            {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "weight_version": long},
            "weight_version",
            admin,
        ),
        ("/destroy_weights_update_group", {"group_name": long}, "group_name", admin),
        ("/v1/load_lora_adapter", {"lora_name": long, "lora_path": "a"}, "lora_name", admin),
        ("/generate", {"text": "Hi", "rid": long}, "rid", {}),
        ("/generate", {"text": "Hi", "sampling_params": {"stop": [long]}}, "sampling_params.stop[0]", {}),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "user": long}, "user", {}),
        ("/v1/completions", {"model": long, "prompt": "Hi"}, "model", {}),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi", "name": long}]},
            "messages[0].name",
            {},
        ),
    ]
    for path, body, param, key in cases:
        error = error_of(call(bounded, "POST", path, json=body, **key), 400, param)
        assert long not in error["message"]


def test_caller_identifiers_never_reach_the_log(bounded, scaled_dir):
    assert call(bounded, "GET", f"/v1/models/{MARKER}").status_code == 404
    assert call(bounded, "GET", f"/v1/models/{MARKER}/vocabulary").status_code == 404
    assert call(bounded, "GET", f"/{MARKER}").status_code == 404
    destroyed = call(bounded, "POST", "/destroy_weights_update_group", key=ADMIN, json={"group_name": MARKER})
    assert destroyed.status_code < 500
    version = f"v-{MARKER}"
    update = {"model_path": str(scaled_dir), "weight_version": version}
    updated = call(bounded, "POST", "/update_weights_from_disk", key=ADMIN, json=update)
    assert updated.status_code == 200, updated.text
    generated = call(
        bounded, "POST", "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}}
    )
    assert generated.json()["meta_info"]["weight_version"] == version
    log = bounded.log_path.read_text()
    assert MARKER not in log and str(scaled_dir) not in log
    assert '"GET /v1/models/{model} HTTP/1.1" 404' in log  # the line is there, without the name
    assert '"GET /v1/models/{model}/vocabulary HTTP/1.1" 404' in log
    assert "new weights loaded" in log
