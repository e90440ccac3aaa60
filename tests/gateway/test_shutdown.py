"""SIGTERM while the real model streams: readiness turns 503 at once, and streams still running at
the end of the grace period end in the error shape, then `data: [DONE]`, with complete bodies
(OpenAI's completions and chat, and SGLang's /generate), no traceback, and exit status 0."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import msgspec
import pytest

from bench.launcher import start_gateway
from tests.conftest import MODEL

NO_END = {"0": -100, "1": -100, "2": -100}  # SmolLM2's end-of-text tokens: streams outlast the grace
GRACE_S = 3


def _streams() -> list[tuple[str, dict]]:
    completion = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "stream": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}], "stream": True}
    generate = {
        "text": "Once upon a time",
        "stream": True,
        "sampling_params": {"max_new_tokens": 1500, "logit_bias": NO_END},
    }
    return [
        *[("/v1/completions", {**completion, "logit_bias": NO_END}) for _ in range(4)],
        *[("/v1/chat/completions", {**chat, "max_tokens": 1500, "logit_bias": NO_END}) for _ in range(2)],
        *[("/generate", generate) for _ in range(2)],
    ]


def _read_stream(base_url: str, path: str, body: dict, out: dict, first: threading.Event) -> None:
    out["body"] = b""
    try:
        with httpx.stream("POST", base_url + path, json=body, timeout=120) as response:
            out["status"] = response.status_code
            for chunk in response.iter_raw():
                out["body"] += chunk
                first.set()
        out["complete"] = True  # the chunked body ended with its last chunk
    except httpx.HTTPError as exc:
        out["complete"] = False
        out["error"] = repr(exc)
    finally:
        first.set()


@pytest.mark.slow
def test_sigterm_ends_streams_with_an_error_event_and_done(model_dir, tmp_path):
    config = tmp_path / "gateway.toml"
    config.write_text(f'shutdown_grace_s = {GRACE_S}\n[[models]]\nmodel = "{model_dir}"\nname = "{MODEL}"\n')
    gateway = start_gateway(["--config", str(config)], tmp_path / "gateway.log")
    try:
        results: list[dict] = []
        threads = []
        for path, body in _streams():
            out: dict = {}
            first = threading.Event()
            thread = threading.Thread(target=_read_stream, args=(gateway.base_url, path, body, out, first))
            thread.start()
            results.append(out)
            threads.append((thread, first))
        for _, first in threads:
            assert first.wait(120), "a stream sent nothing"
        gateway.process.send_signal(signal.SIGTERM)
        # uvicorn acts on the signal at its next tick (every 0.1 s): until then /health is 200
        deadline = time.monotonic() + 5
        while (health := httpx.get(gateway.base_url + "/health", timeout=10)).status_code == 200:
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        refused = httpx.post(gateway.base_url + "/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        while_draining = [s["body"].count(b"data: ") for s in results]
        for thread, _ in threads:
            thread.join(60)
        exit_status = gateway.process.wait(timeout=60)
    finally:
        if gateway.process.poll() is None:
            gateway.stop()
    assert health.status_code == 503 and health.json()["status"] == "shutting_down"
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "server_shutting_down"
    for result, (path, _), before in zip(results, _streams(), while_draining, strict=True):
        assert result["status"] == 200, path
        assert result["complete"], f"{path}: {result.get('error')}"
        events = [e for e in result["body"].split(b"\n\n") if e]
        assert len(events) > before + 2, f"{path}: the stream did not go on during the grace period"
        assert events[-1] == b"data: [DONE]", path
        error = msgspec.json.decode(events[-2].removeprefix(b"data: "))["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable", path
    log = gateway.log_path.read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log
    assert exit_status == 0
