"""What `logprob-gateway serve` tells the operator at its terminal (gateway/server/console.py): its
version, one line once it is ready, and what Ctrl-C does; on a real serving process."""

from __future__ import annotations

import importlib.metadata
import re
import signal
import threading
import time

import httpx
import pytest

from bench.launcher import start_mock_gateway
from gateway import cli

SLOW_STEP_S = 5.0  # each step of the "slow" model: a request is in flight when Ctrl-C comes


def test_serve_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["serve", "--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out == f"logprob-gateway {importlib.metadata.version('logprob-gateway')}\n"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    gateway = start_mock_gateway(tmp_path_factory.mktemp("console"), "", SLOW_STEP_S)
    yield gateway
    gateway.stop()


def _log_lines(gateway) -> list[str]:
    return gateway.log_path.read_text(errors="replace").splitlines()


def test_one_line_says_ready_once_the_models_are_loaded_and_the_server_listens(gateway):
    deadline = time.monotonic() + 10
    while not any("ready: serving" in line for line in _log_lines(gateway)):
        assert time.monotonic() < deadline, "\n".join(_log_lines(gateway))
        time.sleep(0.1)
    lines = _log_lines(gateway)
    ready = [i for i, line in enumerate(lines) if "ready: serving" in line]
    assert len(ready) == 1
    assert lines[ready[0]].endswith(f"ready: serving mock, slow on {gateway.base_url}")
    listening = next(i for i, line in enumerate(lines) if "Uvicorn running on" in line)
    loaded = [i for i, line in enumerate(lines) if re.search(r"model '(mock|slow)' ready in", line)]
    assert len(loaded) == 2 and max(loaded) < ready[0] and listening < ready[0]


def test_a_second_ctrl_c_ends_the_requests_in_flight_at_once_without_tracebacks(gateway):
    answers: list[httpx.Response] = []
    body = {"model": "slow", "prompt": "a", "max_tokens": 3}
    client = threading.Thread(
        target=lambda: answers.append(httpx.post(gateway.base_url + "/v1/completions", json=body, timeout=60))
    )
    client.start()
    time.sleep(1.0)  # the request is in its first step
    gateway.process.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert gateway.process.poll() is None  # draining: the request (15 s) may still finish
    second = time.monotonic()
    gateway.process.send_signal(signal.SIGINT)
    gateway.process.wait(timeout=20)
    exited_in = time.monotonic() - second
    client.join(timeout=10)
    log = gateway.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "ERROR" not in log, log[-4000:]
    assert "Ctrl-C: draining 1 requests in flight, for at most 30 s; Ctrl-C again forces the exit" in log
    assert "Ctrl-C again: forcing the exit, ending 1 requests in flight now" in log
    assert exited_in < 10, exited_in  # not the 15 s the request had left, nor the 30 s grace period
    assert answers[0].status_code == 503
    assert answers[0].json()["error"]["code"] == "server_shutting_down"
