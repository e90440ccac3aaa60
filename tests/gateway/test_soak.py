"""Soak: bench/load.py's mix for 30 s against a real gateway serving the tiny random model (the
default model's tokenizer and vocabulary, so rows and texts have their real sizes; a token costs a
few ms, so 30 s carry some 2,300 dense requests where a minute of the real model carried ~300).

Nothing unexpected (no 5xx, no transport error, every bad request its 4xx, every body well
formed), nothing stuck, the server drained afterwards (no request in flight, no dense request
queued) and its memory flat. A second, fast test shows that the runner's detectors fire.
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import msgspec
import pytest

from bench import load
from bench.launcher import start_gateway
from tests.conftest import MODEL

SOAK_S = 30.0
WARMUP_S = 10.0
# With the real model, warmed up, this gateway sat at ~1.15 GB; over a 60-s run its 10-s RSS
# medians moved by at most 35 MB (a 300-s run drifted ~20 MB after its first 20 s), and the output
# cache is capped at 16 MiB below. 100 MB is about three times that; leaking one dense response
# body (~1 MB) per four dense requests of the ~300 sent then crossed it.
RSS_GROWTH_MB = 100.0


@pytest.fixture(scope="module")
def soak_gateway(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("soak")
    config = workdir / "gateway.toml"
    config.write_text(
        f'[[models]]\nname = "{MODEL}"\nmodel = "{tiny_model_dir}"\ndtype = "float32"\n'
        # a small prefix K/V budget too: it fills and evicts early, so growth after that is a leak
        f"options = {{prefix_cache_bytes = {16 * 2**20}}}\n\n"
        f"[cache]\nmemory_bytes = {16 * 2**20}\n"  # small: evictions happen during the run
    )
    gateway = start_gateway(["--config", str(config)], workdir / "gateway.log")
    yield gateway
    gateway.stop()


def assert_clean(report, min_each: int = 0) -> None:
    detail = "\n".join([report.table(), report.summary(), *report.problems()])
    assert report.unexpected == 0, detail
    assert report.stuck == 0, detail
    for name, kind in report.kinds.items():
        assert sum(kind.statuses.values()) >= min_each, f"{name} barely ran:\n{detail}"


@pytest.mark.slow
async def test_thirty_seconds_of_mixed_load_leave_no_error_stuck_request_or_growth(soak_gateway):
    pid = soak_gateway.process.pid
    # Warm-up outside the measured window: first batches grow the allocator's pools once.
    assert_clean(await load.run_load(soak_gateway.base_url, MODEL, duration_s=WARMUP_S, workers=6, pid=pid))
    report = await load.run_load(
        soak_gateway.base_url, MODEL, duration_s=SOAK_S, workers=6, timeout_s=30.0, pid=pid, seed=1
    )
    print("\n" + report.table() + "\n" + report.summary())
    assert_clean(report, min_each=10)
    assert report.cache_hits > 0, report.summary()

    state = load.drained(soak_gateway.base_url)
    assert state.in_flight == 0, state
    assert state.queued == 0, state
    assert state.server_errors == 0, state

    assert len(report.rss_mb) >= SOAK_S * 0.8, report.rss_mb  # sampled about every second
    assert report.rss_growth_mb < RSS_GROWTH_MB, report.summary()
    assert soak_gateway.process.poll() is None, soak_gateway.log_tail()


# -- the detectors fire ----------------------------------------------------------------------------


async def broken_server(request: httpx.Request) -> httpx.Response:
    """A gateway gone wrong: dense rows not normalised, completions 500, streams that never end,
    bad requests accepted; tokenize alone is right."""
    path = request.url.path
    if path.startswith("/v1/models/"):
        return httpx.Response(200, json={"vocab_size": 16})
    if path == "/v1/tokenize":
        return httpx.Response(200, json={"count": 2, "max_model_len": 64, "tokens": [1, 2]})
    if path == "/v1/chat/completions":
        await asyncio.sleep(3600)
    if path == "/v1/next_token_logprobs":
        # dense_repeat asks for float32 rows in MessagePack; bad requests come as JSON
        binary = request.headers["content-type"] == "application/msgpack"
        rows = (msgspec.msgpack.decode if binary else json.loads)(request.content)["input"]
        body = {
            "object": "list",
            "dtype": "float32",
            "data": [{"index": i, "logprobs": bytes(64)} for i in range(len(rows))],  # 16 zeros: sum 16
            "usage": {"prompt_tokens": sum(map(len, rows)), "total_tokens": 0, "cache_hits": 0},
        }
        return httpx.Response(
            200, content=msgspec.msgpack.encode(body), headers={"content-type": "application/msgpack"}
        )
    return httpx.Response(
        500, json={"error": {"message": "boom", "type": "internal_error", "param": None, "code": None}}
    )


async def test_the_runner_counts_errors_malformed_rows_and_stuck_requests():
    weights = {"dense_repeat": 1, "completion": 1, "chat_stream": 1, "tokenize": 1, "bad": 1}
    report = await load.run_load(
        "http://gateway.test",
        "m",
        duration_s=1.5,
        workers=4,
        timeout_s=0.3,
        pid=os.getpid(),
        weights=weights,
        transport=httpx.MockTransport(broken_server),
    )
    kinds = report.kinds
    assert kinds["tokenize"].unexpected == 0 and kinds["tokenize"].stuck == 0
    assert set(kinds["tokenize"].statuses) == {200}
    assert kinds["dense_repeat"].unexpected > 0 and set(kinds["dense_repeat"].statuses) == {200}
    assert "float32 row is not normalised" in kinds["dense_repeat"].problems[0]
    assert kinds["completion"].unexpected > 0 and set(kinds["completion"].statuses) == {500}
    assert kinds["chat_stream"].stuck > 0 and kinds["chat_stream"].unexpected == 0
    assert kinds["bad"].unexpected == sum(kinds["bad"].statuses.values()) > 0  # every one got a 500
    assert report.unexpected > 0 and report.stuck > 0
    assert report.rss_mb and report.rss_growth_mb is not None
    assert "| all |" in report.table() and f"{report.stuck} stuck" in report.summary()
