"""GET /metrics after a mixed workload on the real model: counters move by exactly the right amounts,
label values stay bounded, and promtool accepts the exposition."""

from __future__ import annotations

import os
import shutil
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL

pytestmark = pytest.mark.slow


def scrape(http) -> dict[tuple[str, frozenset], float]:
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def delta(before, after, name, **labels) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_counters_follow_a_mixed_workload(http, client):
    before = scrape(http)
    completion = client.completions.create(model=MODEL, prompt="One two three", max_tokens=4, temperature=0)
    stream = list(
        client.completions.create(
            model=MODEL,
            prompt="Four five",
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
    )
    rows = [[504, 3575, 282, 9001], [504, 3575, 282, 9002], [504, 3575, 282, 9003]]
    dense = http.post(
        "/v1/next_token_logprobs",
        json={"model": MODEL, "input": rows},
        headers={"Accept": "application/msgpack"},
    )
    assert dense.status_code == 200
    again = http.post(
        "/v1/next_token_logprobs", json={"model": MODEL, "input": rows, "encoding_format": "base64"}
    )
    assert again.status_code == 200
    assert http.post("/v1/completions", json={"model": "no-such-model-x1", "prompt": "x"}).status_code == 404
    assert http.post("/v1/completions", json={"model": MODEL}).status_code == 400
    assert http.get("/v1/no-such-route").status_code == 404
    after = scrape(http)

    requests = "logprob_gateway_requests_total"
    ok = {"method": "POST", "model": MODEL, "adapter": "", "status": "200"}
    assert delta(before, after, requests, route="/v1/completions", **ok) == 2
    assert delta(before, after, requests, route="/v1/chat/completions", **ok) == 1
    assert delta(before, after, requests, route="/v1/next_token_logprobs", **ok) == 2
    assert (
        delta(
            before,
            after,
            requests,
            route="/v1/completions",
            method="POST",
            model="",
            adapter="",
            status="404",
        )
        == 1
    )
    assert (
        delta(
            before,
            after,
            requests,
            route="/v1/completions",
            method="POST",
            model="",
            adapter="",
            status="400",
        )
        == 1
    )
    assert (
        delta(before, after, requests, route="unmatched", method="GET", model="", adapter="", status="404")
        == 1
    )
    assert not any("no-such-model-x1" in str(labels) for _, labels in after)  # user input never a label

    usage = stream[-1].usage
    tokens = {"model": MODEL, "adapter": ""}
    assert delta(before, after, "logprob_gateway_prompt_tokens_total", endpoint="completions", **tokens) == (
        completion.usage.prompt_tokens + usage.prompt_tokens
    )
    assert (
        delta(before, after, "logprob_gateway_generation_tokens_total", endpoint="completions", **tokens)
        == (completion.usage.completion_tokens + usage.completion_tokens)
        == 7
    )
    assert delta(before, after, "logprob_gateway_prompt_tokens_total", endpoint="chat", **tokens) == (
        chat.usage.prompt_tokens
    )
    assert delta(before, after, "logprob_gateway_generation_tokens_total", endpoint="chat", **tokens) == 3
    assert delta(before, after, "logprob_gateway_time_to_first_token_seconds_count", model=MODEL) == 3
    assert delta(before, after, "logprob_gateway_inter_token_latency_seconds_count", model=MODEL) == 3 + 2 + 2

    assert delta(before, after, "logprob_gateway_dense_rows_total", encoding="msgpack", **tokens) == 3
    assert delta(before, after, "logprob_gateway_dense_rows_total", encoding="base64", **tokens) == 3
    assert delta(
        before, after, "logprob_gateway_dense_response_bytes_total", model=MODEL, encoding="msgpack"
    ) == len(dense.content)
    assert delta(before, after, "logprob_gateway_cache_lookups_total", result="miss") == 3
    assert delta(before, after, "logprob_gateway_cache_lookups_total", result="hit") == 3
    assert delta(before, after, "logprob_gateway_batch_rows_count", model=MODEL) == 1
    assert delta(before, after, "logprob_gateway_batch_rows_sum", model=MODEL) == 3
    assert delta(before, after, "logprob_gateway_engine_rows_total", model=MODEL) == 3
    assert after[("logprob_gateway_model_ready", frozenset({("model", MODEL)}))] == 1
    assert after[("logprob_gateway_model_load_duration_seconds", frozenset({("model", MODEL)}))] > 0


def test_promtool_accepts_the_exposition(http, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=1)
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing: .ci/run installs the Debian package prometheus")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    text = httpx.get(str(http.base_url) + "/metrics").text
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    # SGLang's load gauges keep SGLang's names, colon and all: SGLang's model gateway reads them so
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line and not (line.startswith("sglang:") and line.endswith("metric names should not contain ':'"))
    ]
    assert not problems and result.returncode in (0, 3), result.stdout + result.stderr


def test_dashboard_queries_only_existing_metrics(http):
    """Every metric the Grafana dashboard queries is one the gateway exposes."""
    import json
    import re
    from pathlib import Path

    dashboard = json.loads(
        (Path(__file__).parents[2] / "helm/logprob-gateway/dashboards/logprob-gateway.json").read_text()
    )
    exposed = set()
    for family in text_string_to_metric_families(http.get("/metrics").text):
        exposed.update(s.name for s in family.samples)
        exposed.add(family.name)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\blogprob_gateway_[a-z_]+", e)}
    assert len(dashboard["panels"]) >= 10 and used
    assert used <= exposed, used - exposed
