"""API keys, per-key limits, body size and stream limits, through a real gateway process (mock
engine: these are gateway-layer rules) and the official openai SDK."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import openai
import pytest

from bench.launcher import start_mock_gateway
from gateway.access import hash_key

ALICE, BOB, ADMIN = "sk-alice-0123456789", "sk-bob-9876543210", "admin-secret-42"
WRONG = "sk-wrong-key-555"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("access")
    keys = workdir / "api-keys"
    keys.write_text(f"# lab members\n{hash_key(ALICE, 'alice')}\n\n{hash_key(BOB, 'bob')}\n")
    settings = f"""
api_keys_file = "{keys}"
admin_key = "{hash_key(ADMIN)}"
metrics_public = false

[limits]
max_body_bytes = 65536
max_streams = 2
max_in_flight_per_key = 2
rows_per_minute_per_key = 100

"""
    gateway = start_mock_gateway(workdir, settings, slow_delay_s=0.2)
    yield gateway
    gateway.stop()


def call(gateway, method, path, key=None, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, gateway.base_url + path, headers=headers, timeout=30, **kwargs)


def assert_openai_error(response, status, error_type):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == error_type and error["message"]
    return error


def test_every_path_but_health_needs_a_key(secured):
    assert call(secured, "GET", "/health").status_code == 200
    for path in ("/v1/models", "/metrics", "/openapi.json", "/no/such/path"):
        error = assert_openai_error(call(secured, "GET", path), 401, "authentication_error")
        assert "no API key" in error["message"]
        assert call(secured, "GET", path).headers["www-authenticate"] == "Bearer"
        assert_openai_error(call(secured, "GET", path, WRONG), 401, "authentication_error")
    assert call(secured, "GET", "/v1/models", ALICE).json()["data"][0]["id"] == "mock"
    assert call(secured, "GET", "/metrics", BOB).status_code == 200
    assert call(secured, "GET", "/no/such/path", ALICE).status_code == 404  # a key first, then routing


def test_the_openai_sdk_sends_its_key(secured):
    good = openai.OpenAI(base_url=secured.base_url + "/v1", api_key=ALICE, max_retries=0)
    out = good.completions.create(model="mock", prompt="Hello", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    bad = openai.OpenAI(base_url=secured.base_url + "/v1", api_key=WRONG, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="mock", prompt="Hello", max_tokens=3)


def test_admin_endpoints_take_only_the_admin_key(secured):
    body = {"lora_name": "x", "lora_path": "x", "model": "mock"}
    assert_openai_error(
        call(secured, "POST", "/v1/load_lora_adapter", ALICE, json=body), 401, "authentication_error"
    )
    # The admin key opens the endpoint; this gateway then refuses run-time loads (no adapters_root).
    response = call(secured, "POST", "/v1/load_lora_adapter", ADMIN, json=body)
    assert response.status_code == 403 and "adapters_root" in response.json()["error"]["message"]


def test_oversized_bodies_get_413(secured):
    body = {"model": "mock", "input": [[1] * 20000]}  # ~60 KB of JSON... and then some
    body["input"].append([2] * 20000)
    error = assert_openai_error(
        call(secured, "POST", "/v1/next_token_logprobs", ALICE, json=body), 413, "invalid_request_error"
    )
    assert "large" in error["message"].lower()


def test_dense_rows_per_minute_are_budgeted_per_key(secured):
    rows = [[1, i] for i in range(60)]
    assert (
        call(
            secured, "POST", "/v1/next_token_logprobs", ALICE, json={"model": "mock", "input": rows}
        ).status_code
        == 200
    )
    spent = call(secured, "POST", "/v1/next_token_logprobs", ALICE, json={"model": "mock", "input": rows})
    assert_openai_error(spent, 429, "rate_limit_error")
    assert 1 <= int(spent.headers["retry-after"]) <= 60
    too_many = call(
        secured, "POST", "/v1/next_token_logprobs", BOB, json={"model": "mock", "input": rows * 2}
    )
    assert "split the request" in assert_openai_error(too_many, 429, "rate_limit_error")["message"]
    # Bob's budget is his own.
    assert (
        call(
            secured, "POST", "/v1/next_token_logprobs", BOB, json={"model": "mock", "input": rows}
        ).status_code
        == 200
    )


def test_requests_in_flight_are_limited_per_key(secured):
    async def burst():
        async with httpx.AsyncClient(base_url=secured.base_url, timeout=30) as client:

            async def one(key):
                body = {"model": "slow", "prompt": "Hi", "max_tokens": 5}
                return await client.post(
                    "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                )

            return await asyncio.gather(*[one(ALICE) for _ in range(3)], one(BOB))

    *alice, bob = asyncio.run(burst())
    assert sorted(r.status_code for r in alice) == [200, 200, 429]
    refused = next(r for r in alice if r.status_code == 429)
    assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert bob.status_code == 200


def test_open_streams_are_limited_and_given_back(secured):
    client = openai.OpenAI(base_url=secured.base_url + "/v1", api_key=ALICE, max_retries=0)
    other = openai.OpenAI(base_url=secured.base_url + "/v1", api_key=BOB, max_retries=0)
    first = client.completions.create(model="slow", prompt="Hi", max_tokens=50, stream=True)
    second = other.completions.create(model="slow", prompt="Hi", max_tokens=50, stream=True)
    next(iter(first)), next(iter(second))
    with pytest.raises(openai.RateLimitError):
        other.completions.create(model="slow", prompt="Hi", max_tokens=2, stream=True)
    first.close()  # the client goes away mid-stream: its slot comes back
    for _ in range(50):
        try:
            third = other.completions.create(model="mock", prompt="Hi", max_tokens=2, stream=True)
            break
        except openai.RateLimitError:
            asyncio.run(asyncio.sleep(0.1))
    assert "".join(c.choices[0].text for c in third if c.choices)
    second.close()


def test_keys_never_reach_logs_or_metrics(secured):
    call(secured, "GET", "/v1/models", WRONG)
    call(secured, "GET", "/v1/models", ALICE)
    # Wherever a client puts a key: the query string (refused, and beside a good header), a body.
    body = {"model": "mock", "prompt": "Hi", "max_tokens": 1}
    assert call(secured, "POST", f"/v1/completions?api_key={BOB}", json=body).status_code == 401
    assert call(secured, "GET", f"/v1/models?key={WRONG}&x=1").status_code == 401
    assert call(secured, "POST", f"/v1/completions?api_key={BOB}", ALICE, json=body).status_code == 200
    assert call(secured, "POST", "/v1/load_lora_adapter", ADMIN, json={"api_key": BOB}).status_code == 400
    metrics = call(secured, "GET", "/metrics", ALICE).text
    log = secured.log_path.read_text()
    for secret in (ALICE, BOB, ADMIN, WRONG):
        assert secret not in log and secret not in metrics
    assert 'status="401"' in metrics  # refused requests are counted, without their keys
    assert '"POST /v1/completions?[query string not logged] HTTP/1.1" 401' in log  # still an access line


def test_hash_key_reads_the_key_from_stdin():
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "hash-key", "--name", "carol"],
        input="sk-carol\n",
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == hash_key("sk-carol", "carol")
    assert out.stdout.startswith("carol:sha256:") and "sk-carol" not in out.stdout
