"""The committed OpenAPI document is current, and schemathesis finds no contract violation in the
running server: no 5xx, documented statuses and content types, responses matching their schemas,
invalid data rejected with a 4xx."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gateway.launcher import start_gateway
from gateway.openapi import build_openapi
from tests.conftest import MODEL

SPEC = Path(__file__).parents[2] / "openapi" / "openapi.json"
CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "negative_data_rejection",
    ]
)
# Tight limits keep generation short, so hundreds of cases fit the time budget.
LIMITS = "[limits]\nmax_n = 2\nmax_prompts = 2\nmax_rows = 8\nmax_tokens = 8\nmax_top_logprobs = 5\n"


def test_committed_spec_is_current():
    assert json.loads(SPEC.read_text()) == build_openapi(), (
        "openapi/openapi.json is stale: regenerate it with `logprob-gateway openapi -o openapi/openapi.json`"
    )


def test_server_serves_the_committed_spec(http):
    assert http.get("/openapi.json").json() == json.loads(SPEC.read_text())


def run_schemathesis(base_url: str, max_examples: int, workdir: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{base_url}/openapi.json",
        "--checks",
        CHECKS,
        "--max-examples",
        str(max_examples),
        "--seed",
        "20261122",
        "--mode",
        "all",
        "--workers",
        "1",
        "--request-timeout",
        "60",
        "--suppress-health-check",
        "all",
    ]
    # schemathesis keeps its state in the working directory: keep it out of the checkout
    result = subprocess.run(command, capture_output=True, text=True, timeout=1500, cwd=workdir)
    assert result.returncode == 0, result.stdout[-12000:] + result.stderr[-3000:]


def contract_gateway(model_dir, tmp_path_factory, name: str, engine_lines: str):
    workdir = tmp_path_factory.mktemp(f"contract-{name}")
    config = workdir / "gateway.toml"
    config.write_text(
        f'[[models]]\nname = "{MODEL}"\nmodel = "{model_dir}"\n{engine_lines}\nmax_model_len = 256\n\n{LIMITS}'
    )
    return start_gateway(["--config", str(config)], workdir / "gateway.log")


@pytest.fixture(scope="module")
def mock_gateway(model_dir, tmp_path_factory):
    gateway = contract_gateway(model_dir, tmp_path_factory, "mock", 'backend = "mock"')
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def real_gateway(model_dir, tmp_path_factory):
    gateway = contract_gateway(model_dir, tmp_path_factory, "real", 'dtype = "float32"')
    yield gateway
    gateway.stop()


@pytest.mark.slow
def test_schemathesis_finds_nothing_on_the_mock_engine(mock_gateway, tmp_path):
    run_schemathesis(mock_gateway.base_url, 150, tmp_path)
    assert httpx.get(mock_gateway.base_url + "/health").status_code == 200


@pytest.mark.slow
def test_schemathesis_finds_nothing_on_the_real_model(real_gateway, tmp_path):
    run_schemathesis(real_gateway.base_url, 25, tmp_path)
    assert httpx.get(real_gateway.base_url + "/health").status_code == 200
