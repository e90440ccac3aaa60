"""The committed OpenAPI document is current, and schemathesis finds no contract violation in the
running server, in every phase it has (examples, coverage, fuzzing, and stateful sequences along the
document's links) and with every check it has: no 5xx; documented statuses, content types and
headers; responses matching their schemas; every request the document allows served, every request
it forbids refused with a 4xx; 405 with `Allow` for a method a path does not serve.

CONTRACT_EXAMPLES sets the examples per operation (default 20); docs/testing.md has the longer run.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar import Request, Response, get

from bench.launcher import start_gateway
from gateway.app import ROUTE_HANDLERS, create_app
from gateway.contract.constraints import GRAMMAR_FIELDS
from gateway.contract.document import build_openapi
from gateway.contract.operation import OPENAPI, TEXT, Operation
from gateway.contract.vocabulary import decimal_below
from gateway.settings import Settings
from tests.conftest import MODEL

SPEC = Path(__file__).parents[2] / "openapi" / "openapi.json"
EXAMPLES = int(os.environ.get("CONTRACT_EXAMPLES", "20"))
PHASES = "examples,coverage,fuzzing,stateful"
# Tight limits keep generation short, so hundreds of cases fit the time budget.
LIMITS = "[limits]\nmax_n = 2\nmax_prompts = 2\nmax_rows = 2\nmax_tokens = 8\nmax_top_logprobs = 5\n"
# The document cannot bound how many tokens a string makes: a context far beyond what generated
# prompts reach keeps "too long" out of the requests it allows.
MOCK_CONTEXT = 8192
REAL_CONTEXT = 2048
MODEL_REQUESTS = (
    "GenerateRequest",
    "CompletionRequest",
    "ChatCompletionRequest",
    "ResponsesRequest",
    "NextTokenLogprobsRequest",
    "TokenizeRequest",
    "DetokenizeRequest",
)


def test_committed_spec_is_current():
    assert json.loads(SPEC.read_text()) == build_openapi(ROUTE_HANDLERS), (
        "openapi/openapi.json is stale: regenerate it with `logprob-gateway openapi -o openapi/openapi.json`"
    )


def test_the_document_describes_every_route_the_app_serves():
    """One declaration per endpoint: the app's routes and the document's operations are the same
    handlers' paths and methods."""
    app = create_app(Settings())
    served = {
        (route.path_format, method.lower())
        for route in app.routes
        for method in route.methods
        if method not in ("HEAD", "OPTIONS")  # the framework's
    }
    documented = {
        (path, method)
        for path, operations in build_openapi(ROUTE_HANDLERS)["paths"].items()
        for method in operations
    }
    assert served == documented


@get(
    "/v1/example/{model:str}",
    summary="An example",
    tags=["Example"],
    opt={OPENAPI: Operation({"text/plain": TEXT})},
)
async def example_handler(request: Request, model: str) -> Response:
    """Says what the example does."""
    return Response(content="", media_type="text/plain")


def test_a_handler_is_documented_from_its_decorator_and_docstring():
    document = build_openapi([*ROUTE_HANDLERS, example_handler])
    operation = document["paths"]["/v1/example/{model}"]["get"]
    assert operation["summary"] == "An example"
    assert operation["description"] == "Says what the example does."
    assert operation["tags"] == ["Example"]
    assert operation["responses"]["200"]["content"] == {"text/plain": {"schema": TEXT}}
    assert operation["parameters"][0]["name"] == "model"
    # a model-naming path: the model list links to it
    assert "get_v1_example_model" in document["paths"]["/v1/models"]["get"]["responses"]["200"]["links"]
    with pytest.raises(TypeError, match="declares no"):
        build_openapi([get("/undeclared")(example_handler.fn)])


def test_server_serves_the_committed_spec_bounded_by_its_vocabulary(http):
    """The running server's document is the committed one, with every token id and every
    `logit_bias` key bounded by its model's vocabulary."""
    vocab = http.get(f"/v1/models/{MODEL}").json()["vocab_size"]
    served = http.get("/openapi.json").json()
    assert served == build_openapi(ROUTE_HANDLERS, vocab_size=vocab)
    schemas = served["components"]["schemas"]
    ids = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert (ids["minimum"], ids["maximum"]) == (0, vocab - 1)
    prompt_ids = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"][2]["items"]
    assert prompt_ids["maximum"] == vocab - 1
    for holder in ("CompletionRequest", "ChatCompletionRequest", "SglangSamplingParams"):
        keys = re.compile(schemas[holder]["properties"]["logit_bias"]["anyOf"][0]["propertyNames"]["pattern"])
        assert keys.fullmatch(str(vocab - 1)) and keys.fullmatch("007")
        assert not keys.fullmatch(str(vocab)) and not keys.fullmatch("-1")
    # and the server refuses what the document forbids
    over = http.post("/v1/detokenize", json={"model": MODEL, "tokens": [vocab]})
    assert over.status_code == 400
    over = http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "logit_bias": {str(vocab): 1}})
    assert over.status_code == 400


def test_the_document_says_which_paths_need_a_key():
    """/health always, /metrics unless `metrics_public = false`, and nothing else goes without a
    key, in the document as in the guard."""

    def keyless(document):
        return {
            p for p, ops in document["paths"].items() if all(op.get("security") == [] for op in ops.values())
        }

    assert keyless(build_openapi(ROUTE_HANDLERS, Settings(api_keys=["sha256:" + "0" * 64]))) == {
        "/health",
        "/metrics",
    }
    closed = build_openapi(ROUTE_HANDLERS, Settings(api_keys=["sha256:" + "0" * 64], metrics_public=False))
    assert keyless(closed) == {"/health"}
    assert "401" in closed["paths"]["/metrics"]["get"]["responses"]
    assert "401" in closed["paths"]["/health_generate"]["get"]["responses"]


@pytest.mark.parametrize("limit", [1, 7, 10, 11, 100, 101, 49152, 151936])
def test_decimal_below_matches_exactly_the_numbers_below(limit):
    pattern = re.compile("0*" + decimal_below(limit))
    assert [k for k in range(2 * limit + 20) if bool(pattern.fullmatch(str(k))) != (k < limit)] == []


def vanishing_characters(base_url: str, model: str) -> set[str]:
    """The ASCII characters the model's byte-level tokenizer has no token for: a string of only
    those tokenizes to nothing (SmolLM2's has none for six control characters)."""
    vocabulary = httpx.get(f"{base_url}/v1/models/{model}/vocabulary", timeout=60).json()
    single_bytes = {raw[0] for raw in map(base64.b64decode, vocabulary["tokens"]) if len(raw) == 1}
    return {chr(b) for b in range(128) if b not in single_bytes}


def _require_a_token(schema: Any, vanishing: set[str]) -> None:
    """Texts (strings of at least one character) must hold a character the tokenizer keeps."""
    if isinstance(schema, dict):
        if vanishing and schema.get("type") == "string" and schema.get("minLength") == 1:
            schema["pattern"] = "[^" + "".join(f"\\x{ord(c):02x}" for c in sorted(vanishing)) + "]"
        for value in schema.values():
            _require_a_token(value, vanishing)
    elif isinstance(schema, list):
        for value in schema:
            _require_a_token(value, vanishing)


def deployment_document(
    document: dict[str, Any], models: list[dict[str, Any]], vanishing: set[str]
) -> dict[str, Any]:
    """The served document (token ids already bounded by the vocabulary) narrowed by what only the
    running model knows (GET /v1/models and its vocabulary): its name, texts it has a token for. So
    generated requests reach the routes' checks instead of stopping at "model not found", and the
    document stays exact."""
    names = [m["id"] for m in models]
    schemas = document["components"]["schemas"]
    for name in MODEL_REQUESTS:
        properties = schemas[name]["properties"]
        properties["model"]["enum"] = names
        for field in ("prompt", "input", "tokens", "text", "input_ids"):
            if field in properties:
                _require_a_token(properties[field], vanishing)
    # The packed dense input relates its fields as JSON Schema cannot (the ids' bytes are four
    # times the sum of the lengths): test_packed_rows.py covers it
    dense_input = schemas["NextTokenLogprobsRequest"]["properties"]["input"]
    dense_input["anyOf"] = [option for option in dense_input["anyOf"] if "$ref" not in option]
    # Whether a grammar compiles (a JSON schema, a regex, a tool's parameters) only the grammar
    # engine knows, as only the tokenizer knows a text's tokens: those fields, and the document's
    # rules about them, are left out here; test_structured_outputs.py, test_grammar.py and
    # test_bad_requests.py cover them.
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        schema = schemas[name]
        for field in GRAMMAR_FIELDS:
            schema["properties"].pop(field, None)
        schema["allOf"] = [
            rule for rule in schema["allOf"] if not any(f in json.dumps(rule) for f in GRAMMAR_FIELDS)
        ]
    # /v1/responses' grammar fields: its tools, tool_choice and text.format
    responses = schemas["ResponsesRequest"]
    for field in ("text", "tools", "tool_choice"):
        responses["properties"].pop(field)
    responses["allOf"] = [rule for rule in responses["allOf"] if "tool" not in json.dumps(rule)]
    # SGLang's /generate relates fields JSON Schema cannot (a list per prompt, logprob_start_len
    # within the prompt, n the same in every sampling_params): test_fuzz.py and
    # test_sglang_native.py cover it instead
    del document["paths"]["/generate"]
    for operations in document["paths"].values():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                if parameter["name"] == "model":
                    parameter["schema"]["enum"] = names
    return document


def fewer_coverage_cases(document: dict[str, Any]) -> dict[str, Any]:
    """The document with its `oneOf` rules of exclusive options written as `anyOf`: the same rules
    (no value matches two options), from which schemathesis' coverage phase derives a quarter of
    the cases (it tries values matching two options of a `oneOf`); for the real model's run, where
    every generated completion runs the model."""
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        for rule in document["components"]["schemas"][name]["allOf"]:
            if "oneOf" in rule:
                rule["anyOf"] = rule.pop("oneOf")
    return document


def run_schemathesis(base_url: str, max_examples: int, workdir: Path, fewer_cases: bool = False) -> str:
    """Every phase and every check against the server at `base_url`; returns the report."""
    document = httpx.get(f"{base_url}/openapi.json").json()
    models = httpx.get(f"{base_url}/v1/models").json()["data"]
    vanishing = set().union(*(vanishing_characters(base_url, m["id"]) for m in models))
    spec = workdir / "openapi.json"
    document = deployment_document(document, models, vanishing)
    spec.write_text(json.dumps(fewer_coverage_cases(document) if fewer_cases else document))
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        str(spec),
        "--url",
        base_url,
        "--phases",
        PHASES,
        "--checks",
        "all",
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
        "--report",
        "ndjson",
        "--report-dir",
        str(workdir / "report"),
    ]
    began = time.monotonic()
    # schemathesis keeps its state in the working directory: keep it out of the checkout
    result = subprocess.run(command, capture_output=True, text=True, timeout=3600, cwd=workdir)
    report = f"{result.stdout}\n{result.stderr}\n({time.monotonic() - began:.0f} s)"
    assert result.returncode == 0, result.stdout[-12000:] + result.stderr[-3000:]
    documented = {
        f"{method.upper()} {path}"
        for path, operations in json.loads(spec.read_text())["paths"].items()
        for method in operations
    }
    fuzzed = fuzzed_operations(next((workdir / "report").glob("*.ndjson")))
    assert documented - fuzzed == set(), "operations schemathesis never sent a generated request to"
    return report


def fuzzed_operations(ndjson: Path) -> set[str]:
    """The operations ("POST /v1/completions") that got at least one request generated from their
    schema (the fuzzing phase) in a schemathesis report."""
    fuzzed = set()
    for line in ndjson.read_text().splitlines():
        scenario = json.loads(line).get("ScenarioFinished")
        if scenario is None or scenario["phase"] != "fuzzing":
            continue
        recorder = scenario["recorder"]
        for case_id, case in recorder.get("cases", {}).items():
            if case_id in recorder.get("interactions", {}):
                fuzzed.add(f"{case['value']['method']} {case['value']['path']}")
    return fuzzed


def contract_gateway(model_dir, tmp_path_factory, name: str, engine_lines: str, context: int):
    workdir = tmp_path_factory.mktemp(f"contract-{name}")
    config = workdir / "gateway.toml"
    config.write_text(
        f'[[models]]\nname = "{MODEL}"\nmodel = "{model_dir}"\n{engine_lines}\n'
        f"max_model_len = {context}\n\n{LIMITS}"
    )
    return start_gateway(["--config", str(config)], workdir / "gateway.log")


@pytest.fixture(scope="module")
def mock_gateway(model_dir, tmp_path_factory):
    gateway = contract_gateway(model_dir, tmp_path_factory, "mock", 'backend = "mock"', MOCK_CONTEXT)
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def real_gateway(model_dir, tmp_path_factory):
    gateway = contract_gateway(model_dir, tmp_path_factory, "real", 'dtype = "float32"', REAL_CONTEXT)
    yield gateway
    gateway.stop()


@pytest.mark.slow
def test_schemathesis_finds_nothing_on_the_mock_engine(mock_gateway, tmp_path):
    report = run_schemathesis(mock_gateway.base_url, EXAMPLES, tmp_path)
    print(report[-3000:])  # the summary, for `pytest -s`
    assert httpx.get(mock_gateway.base_url + "/health").status_code == 200


@pytest.mark.slow
def test_schemathesis_finds_nothing_on_the_real_model(real_gateway, tmp_path):
    report = run_schemathesis(real_gateway.base_url, max(5, EXAMPLES // 4), tmp_path, fewer_cases=True)
    print(report[-3000:])
    assert httpx.get(real_gateway.base_url + "/health").status_code == 200
