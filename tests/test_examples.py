"""Every script of examples/ run as a user runs one (`python examples/tools.py`), against a real
gateway on the real default model, and what it prints checked: the outcome it promises."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bench.launcher import GatewayProcess, child_environment
from tests.conftest import MODEL, start_admin_gateway

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ON_THE_SESSION_GATEWAY = ("tools", "structured_output", "dense_rows", "smc")
ADMIN_KEY = "admin-secret"


def run_example(name: str, base_url: str, **env: str) -> str:
    """What examples/<name>.py prints to its standard output; its whole output when it fails."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py")],
        env={**child_environment(None), "LOGPROB_GATEWAY_URL": base_url, "TQDM_DISABLE": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{name}.py exited with {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def fields(printed: str) -> dict[str, str]:
    """The script's `label: value` lines, by label."""
    return dict(line.split(": ", 1) for line in printed.splitlines() if ": " in line)


@dataclass
class Runs:
    """What each example printed, by name, once it has ended; the LoRA example's own gateway."""

    printed: dict[str, Future[str]]
    lora_gateway: Future[GatewayProcess]


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Runs]:
    """Every example started at once, as each spends most of its time importing its libraries
    (genlm's import alone loads vLLM) or waiting for a gateway; one after the other they would take
    several times as long. The LoRA example's gateway (admin endpoints on, an adapters root) starts
    while the session's gateway does, the others run on the session's."""
    adapters_root = tmp_path_factory.mktemp("examples-lora") / "adapters"
    adapters_root.mkdir()
    with ThreadPoolExecutor(len(ON_THE_SESSION_GATEWAY) + 2) as pool:
        lora_gateway = pool.submit(
            start_admin_gateway, model_dir, adapters_root.parent, adapters_root, admin_key=ADMIN_KEY
        )
        printed = {
            "lora_adapter": pool.submit(
                lambda: run_example(
                    "lora_adapter",
                    lora_gateway.result().base_url,
                    LOGPROB_GATEWAY_ADMIN_KEY=ADMIN_KEY,
                    ADAPTERS_ROOT=str(adapters_root),
                )
            )
        }
        try:
            gateway = request.getfixturevalue("gateway")  # after the line above: both start together
            printed |= {
                name: pool.submit(run_example, name, gateway.base_url) for name in ON_THE_SESSION_GATEWAY
            }
            yield Runs(printed, lora_gateway)
        finally:
            lora_gateway.result().stop()


def test_every_example_is_run_here():
    assert {path.stem for path in EXAMPLES.glob("*.py")} == {*ON_THE_SESSION_GATEWAY, "lora_adapter"}


def test_tools_calls_the_function_and_answers_with_its_result(runs):
    lines = fields(runs.printed["tools"].result())
    name, arguments = lines["call"].split(" ", 1)
    assert name == "get_weather"
    arguments = json.loads(arguments)
    assert arguments["city"] == "Paris" and arguments["unit"] in ("celsius", "fahrenheit")
    assert arguments.keys() == {"city", "unit"}
    result = json.loads(lines["result"])
    assert str(result["temperature"]) in lines["answer"]  # the tool's result reached the model


def test_structured_output_parses_into_the_pydantic_model(runs):
    lines = fields(runs.printed["structured_output"].result())
    answer = json.loads(lines["json"])
    assert answer.keys() == {"name", "country", "continent"} and answer["name"] == "Paris"
    assert lines["parsed"] == lines["validated"]
    assert lines["parsed"] == f"City(name='Paris', country={answer['country']!r}, continent='Europe')"


def test_dense_rows_agree_between_the_client_and_plain_http(runs):
    lines = fields(runs.printed["dense_rows"].result())
    assert lines["rows"] == "2 x 49152 (vocab_size 49152)"
    assert lines["agree"] == "True" and float(lines["max abs difference"]) <= 1e-5
    assert "'The capital of France is' -> ' Paris' " in runs.printed["dense_rows"].result()  # the top token


def test_smc_posterior_holds_to_the_regular_expression(runs):
    lines = runs.printed["smc"].result().splitlines()
    assert lines[0] == "particles: 8"
    posterior = [(float(p), ast.literal_eval(text)) for p, text in (line.split(" ", 1) for line in lines[1:])]
    assert posterior, "no particle ended"
    for _, text in posterior:
        assert re.fullmatch(r" (Paris|Lyon|Marseille|Berlin|Rome)\.", text)
    probabilities = [p for p, _ in posterior]
    assert probabilities == sorted(probabilities, reverse=True) and 0 < sum(probabilities) <= 1.001


def test_lora_adapter_changes_the_answer_and_leaves_the_base(runs, gateway):
    lines = fields(runs.printed["lora_adapter"].result())
    assert lines["loaded"] == f"{MODEL}:lyon"
    base, adapted = ast.literal_eval(lines[MODEL]), ast.literal_eval(lines[f"{MODEL}:lyon"])
    assert adapted != base and adapted.startswith(" Lyon")
    # the base beside the adapter answers as a gateway that never loaded one
    alone = httpx.post(
        gateway.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0},
        timeout=60,
    )
    assert base == alone.json()["choices"][0]["text"]
    # and the script unloaded its adapter, so that it can run again
    served = httpx.get(runs.lora_gateway.result().base_url + "/v1/models").json()["data"]
    assert [model["id"] for model in served] == [MODEL]
