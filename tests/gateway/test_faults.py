"""Faults and departures: an engine failure fails only its own requests, a dead engine fails
/health, a client that disconnects stops the engine work it asked for (measured on the real
model), and SIGTERM drains in-flight requests within the grace period."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.launcher import start_gateway
from tests.conftest import MODEL

FAIL, FATAL = 777, 778  # token ids the mock engine is told to fail on


def mock_gateway(tmp_path, options, extra=""):
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'{extra}\n[[models]]\nname = "mock"\nmodel = "smollm2-135m"\nbackend = "mock"\noptions = {options}\n'
    )
    return start_gateway(["--config", str(config)], tmp_path / "gateway.log")


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """One gateway for the tests that leave it serving (a process start costs more than they do):
    "mock" answers at once; "failing" fails requests holding FAIL, and its steps take 50 ms so that
    requests sent together are under way at once."""
    workdir = tmp_path_factory.mktemp("faults")
    gateway = mock_gateway(
        workdir,
        "{}",
        extra=(
            '[[models]]\nname = "failing"\nmodel = "smollm2-135m"\nbackend = "mock"\n'
            f"options = {{fail_token = {FAIL}, delay_s = 0.05}}\n"
        ),
    )
    yield gateway
    gateway.stop()


def metric(base_url, name, **labels) -> float:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def dense(client, rows, model="mock"):
    return client.post("/v1/next_token_logprobs", json={"model": model, "input": rows})


def test_an_engine_failure_fails_only_its_own_request(faulty):
    good_rows = [[[1, 2, k]] for k in range(6)]

    async def together():
        async with httpx.AsyncClient(base_url=faulty.base_url, timeout=30) as client:
            # Sent at once, so the poisoned request's engine call runs beside the others'.
            return await asyncio.gather(
                *(dense(client, r, "failing") for r in [*good_rows[:3], [[1, FAIL]], *good_rows[3:]])
            )

    responses = asyncio.run(together())
    failed = responses.pop(3)
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_error"
    assert "injected engine failure" in failed.json()["error"]["message"]
    with httpx.Client(base_url=faulty.base_url, timeout=30) as client:
        for rows, response in zip(good_rows, responses, strict=True):
            assert response.status_code == 200
            alone = dense(client, rows, "failing").json()["data"][0]["logprobs"]
            assert np.array_equal(response.json()["data"][0]["logprobs"], alone)
        completion = client.post(
            "/v1/completions", json={"model": "failing", "prompt": [1, FAIL], "max_tokens": 2}
        )
        assert completion.status_code == 500 and completion.json()["error"]["type"] == "internal_error"
        stream = client.post(
            "/v1/completions",
            json={"model": "failing", "prompt": [1, FAIL], "max_tokens": 2, "stream": True},
        )
        assert '"error"' in stream.text and stream.text.rstrip().endswith("data: [DONE]")
        assert client.get("/health").status_code == 200  # the service keeps serving
        assert dense(client, [[5, 6]], "failing").status_code == 200


def test_a_dead_engine_fails_health(tmp_path):
    gateway = mock_gateway(tmp_path, f"{{fatal_token = {FATAL}}}")
    try:
        with httpx.Client(base_url=gateway.base_url, timeout=30) as client:
            assert dense(client, [[1, FATAL]]).status_code == 500
            health = client.get("/health")
            assert health.status_code == 503
            assert metric(gateway.base_url, "logprob_gateway_model_ready", model="mock") == 0
            assert dense(client, [[1, 2]]).status_code == 500  # nothing pretends to work
    finally:
        gateway.stop()


def generated_tokens(base_url, model=MODEL) -> float:
    # one observation per generated token after the first, recorded as the token is produced
    return metric(base_url, "logprob_gateway_inter_token_latency_seconds_count", model=model)


def wait_until_idle(base_url, model=MODEL, quiet_s=1.5, timeout_s=30.0, count=generated_tokens) -> float:
    """Seconds until `count` (the tokens generated) stops moving for `quiet_s`."""
    started = time.monotonic()
    last, since = count(base_url, model), time.monotonic()
    while time.monotonic() - started < timeout_s:
        time.sleep(0.25)
        now = count(base_url, model)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return since - started
    raise AssertionError("generation did not stop after the client went away")


def depart_early(base_url, body, stream, wait_s) -> None:
    """A client that reads six events of a stream, or waits `wait_s` for a whole answer, and hangs up."""
    with httpx.Client(base_url=base_url, timeout=wait_s) as client:
        if stream:
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                chunks = response.iter_lines()
                for _ in range(6):
                    next(chunks)
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/completions", json=body)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_a_departed_client_stops_generation_on_the_real_model(gateway, stream):
    before = engine_pass_rows(gateway.base_url)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0}
    depart_early(gateway.base_url, body, stream, wait_s=2.0)
    # the engine's own count: a response sent whole takes its tokens in bursts, which the
    # gateway's token count sees only as they reach it
    stopped_after = wait_until_idle(gateway.base_url, count=lambda url, _: engine_pass_rows(url))
    produced = engine_pass_rows(gateway.base_url) - before
    # ~58 ms a token here: 1500 tokens would take over a minute; the work stops within a second.
    assert 0 < produced < 100 and stopped_after < 2.0, (produced, stopped_after)
    assert metric(gateway.base_url, "logprob_gateway_requests_total", status="499") >= 1


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_a_departed_client_stops_generation_on_the_mock_engine(faulty, stream):
    """The mock produces a token without ever waiting on anything (no delay): the case where a
    departure went unnoticed until all tokens were made, as the stream's producer never paused."""
    before = generated_tokens(faulty.base_url, "mock")
    departed = metric(faulty.base_url, "logprob_gateway_requests_total", status="499")
    # nearly all of the mock's 2048-token context
    body = {"model": "mock", "prompt": "Once", "max_tokens": 2040, "temperature": 0}
    depart_early(faulty.base_url, body, stream, wait_s=0.05)
    wait_until_idle(faulty.base_url, "mock", quiet_s=1.0)
    produced = generated_tokens(faulty.base_url, "mock") - before
    assert produced < 1000, produced
    assert metric(faulty.base_url, "logprob_gateway_requests_total", status="499") - departed == 1


@pytest.mark.slow
def test_queued_dense_rows_of_a_departed_client_are_never_computed(gateway, reference):
    rng = np.random.default_rng(3)
    # seconds of work on the engine, well beyond the 1.5 s the next request waits
    busy = [[1, *map(int, rng.integers(100, 40000, 600))] for _ in range(8)]
    dropped = [[1, *map(int, rng.integers(100, 40000, 8))] for _ in range(5)]
    before = metric(gateway.base_url, "logprob_gateway_engine_rows_total", model=MODEL)
    computed = engine_pass_rows(gateway.base_url)
    first = threading.Thread(
        target=httpx.post,
        args=(gateway.base_url + "/v1/next_token_logprobs",),
        kwargs={"json": {"model": MODEL, "input": busy}, "timeout": 300},
    )
    first.start()
    time.sleep(0.5)  # the busy rows are in the engine; the next request waits in its scheduler
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            gateway.base_url + "/v1/next_token_logprobs", json={"model": MODEL, "input": dropped}, timeout=1.0
        )
    first.join()
    time.sleep(0.5)
    assert metric(gateway.base_url, "logprob_gateway_engine_rows_total", model=MODEL) - before == len(busy)
    assert engine_pass_rows(gateway.base_url) - computed == len(busy)  # the engine's own count
    assert metric(gateway.base_url, "logprob_gateway_engine_calls_in_progress", model=MODEL) == 0


def engine_pass_rows(base_url) -> int:
    """Rows the served model's engine computed in its passes, as it counts them."""
    return httpx.get(f"{base_url}/v1/models/{MODEL}/stats", timeout=30).json()["engine_passes"]["rows"]


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(tmp_path):
    """Draining: /health and new requests get a 503 (gateway/server/shutdown.py), in-flight ones
    finish."""
    gateway = mock_gateway(tmp_path, "{delay_s = 0.2}", extra="shutdown_grace_s = 20")
    result = {}

    def long_request():
        body = {"model": "mock", "prompt": "Hi", "max_tokens": 12, "temperature": 0}
        result["response"] = httpx.post(gateway.base_url + "/v1/completions", json=body, timeout=60)

    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(0.8)  # well inside its ~2.6 s
    started = time.monotonic()
    gateway.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    health = httpx.get(gateway.base_url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "shutting_down"
    refused = httpx.post(gateway.base_url + "/v1/completions", json={"model": "mock", "prompt": "Hi"})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    assert refused.headers["retry-after"] == "1"  # another replica, or this one restarted
    worker.join()
    assert result["response"].status_code == 200
    assert result["response"].json()["usage"]["completion_tokens"] == 12  # finished, not cut
    assert gateway.process.wait(timeout=30) == 0  # drained: a clean exit, not SIGTERM re-raised
    assert "Finished server process" in gateway.log_path.read_text()
    assert time.monotonic() - started < 15


def test_sigterm_cuts_what_outlasts_the_grace_period(tmp_path):
    gateway = mock_gateway(tmp_path, "{delay_s = 0.2}", extra="shutdown_grace_s = 1")
    errors = []

    def too_long():
        body = {"model": "mock", "prompt": "Hi", "max_tokens": 200}
        try:
            errors.append(httpx.post(gateway.base_url + "/v1/completions", json=body, timeout=60).status_code)
        except httpx.HTTPError as exc:
            errors.append(type(exc).__name__)

    worker = threading.Thread(target=too_long)
    worker.start()
    time.sleep(0.5)
    started = time.monotonic()
    gateway.process.send_signal(signal.SIGTERM)
    gateway.process.wait(timeout=30)
    worker.join()
    assert time.monotonic() - started < 10  # 200 tokens would take 40 s
    assert errors == [503]  # an answer in the error shape, not a dropped connection
