"""The SGLang engine against transformers' forward pass of the same weights, through the gateway.

    python -m bench.sglang_check --random-model llama-1b --device cuda --dtype bfloat16 \
        --modes engine server --record sglang_real_shapes.json      # on a GPU machine with sglang

For each SGLang mode (`engine`: sglang.Engine inside the gateway; `server`: a `sglang.launch_server`
child the gateway manages) a gateway serves the model with `--backend sglang`, and a handful of
prompts go through it: dense rows (the client's batch_next_token_logprobs), prompt scores
(/v1/completions with echo and max_tokens 0) and greedy completions. Each is compared with
transformers in the same dtype: top-10 ids of each row (in order, and up to near ties: those
closer than 0.1 nat may swap), max |difference| over the reference's top 100, prompt scores, and greedy text (where it differs, the reference's margin between its token
and SGLang's at the first difference: random weights have near ties).

--record also starts SGLang's server directly and writes the shape of its answers to the requests
the engine sends (dense row, prompt scores, generation, streamed chunks, refusals): the stand-in
server of the tests is checked against that file (tests/backends/test_sglang.py).

SGLang runs with the Triton attention backend, the PyTorch sampler and no grammar backend, so the
set scripts/stage.sh packs is enough.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from backends.builtin_models import resolve_model_dir
from backends.transformers.engine import resolve_device, resolve_dtype
from backends.types import EngineConfig, SamplingParams
from bench.launcher import start_gateway
from bench.smc import add_model_arguments, random_model_dir
from bench.smc_ways import SGLANG_ARGS
from logprob_gateway_client import AsyncGatewayLM

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4,",
    "The quick brown fox",
]
GREEDY_TOKENS = 12
TIE_NAT = 0.1  # bfloat16 engines differ by this much; random weights have many tokens closer


def top10_agree(row: np.ndarray, other: np.ndarray, tolerance: float) -> bool:
    """Each of `row`'s ten best ids is among `other`'s best up to `tolerance`: the same top 10, but
    for the order of tokens nearer each other than the two computations differ."""
    tenth = np.sort(other)[-10]
    return bool(np.all(other[np.argsort(-row)[:10]] >= tenth - tolerance))


def launch_args() -> list[str]:
    """SGLANG_ARGS as `sglang.launch_server` options."""
    return [part for key, value in SGLANG_ARGS.items() for part in (f"--{key.replace('_', '-')}", str(value))]


def engine_options(mode: str) -> dict[str, Any]:
    return {"mode": mode, **SGLANG_ARGS} if mode == "engine" else {"mode": mode, "launch_args": launch_args()}


def toml_value(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, bool) else str(value).lower()


class Reference:
    """transformers on the same weights, dtype and device."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.device = device

    def logprobs(self, ids: list[int]) -> np.ndarray:
        with torch.inference_mode():
            logits = self.model(torch.tensor([ids], device=self.device)).logits[0].float()
            return torch.log_softmax(logits, dim=-1).cpu().numpy()

    def greedy(self, ids: list[int]) -> list[int]:
        with torch.inference_mode():
            tokens = torch.tensor([ids], device=self.device)
            out = self.model.generate(
                tokens,
                attention_mask=torch.ones_like(tokens),
                max_new_tokens=GREEDY_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        return out[0, len(ids) :].tolist()


async def check_gateway(base_url: str, reference: Reference) -> dict[str, Any]:
    """Dense rows, prompt scores and greedy text of every prompt, against the reference."""
    prompts = [reference.tokenizer(text).input_ids for text in PROMPTS]
    expected = [reference.logprobs(ids) for ids in prompts]
    lm = AsyncGatewayLM(base_url, "m")
    try:
        rows = np.asarray(await lm.batch_next_token_logprobs(prompts))
    finally:
        await lm.aclose()
    top10_equal, top10_within, dense_delta = 0, 0, 0.0
    for row, want in zip(rows, expected, strict=True):
        last = want[-1]
        top10_equal += np.array_equal(np.argsort(-row)[:10], np.argsort(-last)[:10])
        top10_within += top10_agree(row, last, TIE_NAT) and top10_agree(last, row, TIE_NAT)
        top100 = np.argsort(-last)[:100]
        dense_delta = max(dense_delta, float(np.max(np.abs(row[top100] - last[top100]))))
    score_delta, greedy_equal, differences = 0.0, 0, []
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        for ids, want in zip(prompts, expected, strict=True):
            body = {"model": "m", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}
            answer = (await client.post("/v1/completions", json=body)).raise_for_status().json()
            scores = np.array(answer["choices"][0]["logprobs"]["token_logprobs"][1:], dtype=np.float32)
            chosen = want[np.arange(len(ids) - 1), ids[1:]]
            score_delta = max(score_delta, float(np.max(np.abs(scores - chosen))))
            body = {"model": "m", "prompt": ids, "max_tokens": GREEDY_TOKENS, "temperature": 0, "logprobs": 1}
            answer = (await client.post("/v1/completions", json=body)).raise_for_status().json()
            text = answer["choices"][0]["text"]
            greedy = reference.greedy(ids)
            if text == reference.tokenizer.decode(greedy):
                greedy_equal += 1
                continue
            # The first token where they part, and the reference's margin between the two choices.
            got = reference.tokenizer(text, add_special_tokens=False).input_ids
            at = next((i for i, (a, b) in enumerate(zip(got, greedy, strict=False)) if a != b), None)
            if at is not None:
                row = reference.logprobs(ids + greedy[:at])[-1]
                differences.append(f"token {at}: margin {row[greedy[at]] - row[got[at]]:.4f} nat")
            else:
                differences.append(f"{text!r} vs {reference.tokenizer.decode(greedy)!r}")
    return {
        "top10_equal": f"{top10_equal}/{len(prompts)}",
        f"top10_within_{TIE_NAT}": f"{top10_within}/{len(prompts)}",
        "dense_max_delta_top100": dense_delta,
        "prompt_score_max_delta": score_delta,
        "greedy_equal": f"{greedy_equal}/{len(prompts)}",
        "greedy_differences": differences,
    }


def gateway_config(mode: str, model_dir: Path, dtype: str, tmp: Path) -> Path:
    options = ", ".join(f"{key} = {toml_value(value)}" for key, value in engine_options(mode).items())
    toml = tmp / f"sglang-{mode}.toml"
    toml.write_text(
        f'[[models]]\nname = "m"\nmodel = "{model_dir}"\nbackend = "sglang"\ndtype = "{dtype}"\n'
        f"options = {{{options}}}\n"
    )
    return toml


def shape(value: Any) -> Any:
    """The structure of a JSON answer: keys, types, and the lengths of short lists."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in sorted(value.items())}
    if isinstance(value, list):
        if len(value) <= 3:
            return [shape(item) for item in value]
        return {"list of": len(value), "first": shape(value[0])}
    return type(value).__name__


def recorded_requests(engine: Any, ids: list[int]) -> dict[str, dict[str, Any]]:
    """The requests the engine sends, as it builds them, plus two that SGLang refuses."""
    generation = engine.generate_request(
        ids, SamplingParams(max_tokens=3, temperature=0.0, top_logprobs=2), None
    )
    return {
        "dense": engine.processor_request(ids, None),
        "dense_sorted": engine.sorted_request(ids, None),
        "prompt_top2": engine.prompt_request(ids, 2, None),
        "prompt_top0": engine.prompt_request(ids, 0, None),
        "generate": {**generation, "stream": False},
        "generate_stream": {**generation, "stream": True},
        "too_long": {
            **engine.prompt_request(ids, 0, None),
            "input_ids": [1] * (engine.info.max_model_len + 10),
        },
        "unknown_adapter": {**engine.prompt_request(ids, 0, None), "lora_path": "no-such-adapter"},
    }


def answer_shapes(base_url: str, requests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    shapes = {}
    with httpx.Client(base_url=base_url, timeout=600) as client:
        for name, body in requests.items():
            if body.get("stream"):
                with client.stream("POST", "/generate", json=body) as response:
                    lines = [line[5:].strip() for line in response.iter_lines() if line.startswith("data:")]
                chunks = [json.loads(line) for line in lines if line != "[DONE]"]
                shapes[name] = {
                    "status": response.status_code,
                    "chunks": [shape(chunk) for chunk in chunks],
                    "done": lines[-1:] == ["[DONE]"],
                }
            else:
                response = client.post("/generate", json=body)
                try:
                    body_shape = shape(response.json())
                except ValueError:
                    body_shape = "not JSON"
                shapes[name] = {"status": response.status_code, "body": body_shape}
    return shapes


def record(model_dir: Path, dtype: str, path: Path) -> None:
    from backends.sglang.engine import SglangEngine

    config = EngineConfig(
        model=str(model_dir), dtype=dtype, max_lora_rank=8, options=engine_options("server")
    )
    engine = SglangEngine.load(config)
    try:
        ids = engine.info.tokenizer(PROMPTS[0]).input_ids
        shapes = answer_shapes(engine.transport.base_url, recorded_requests(engine, ids))
    finally:
        asyncio.run(engine.aclose())
    path.write_text(
        json.dumps({"sglang": "0.5.17", "prompt": PROMPTS[0], "answers": shapes}, indent=1) + "\n"
    )
    print(f"shapes of SGLang's answers written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--modes", nargs="+", default=["engine", "server"], choices=["engine", "server"])
    parser.add_argument("--record", type=Path, help="write the shapes of SGLang's own answers here")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.random_model:
            dtype = resolve_dtype(args.dtype, device)
            model_dir = random_model_dir(args.random_model, dtype, device, tmp / "model", args.tokenizer)
        else:
            model_dir = resolve_model_dir(args.model)
        reference = Reference(model_dir, resolve_dtype(args.dtype, device), device)
        results = {}
        for mode in args.modes:
            with contextlib.ExitStack() as stack:
                toml = gateway_config(mode, model_dir, args.dtype, tmp)
                try:  # one mode failing still leaves the other's answer
                    gateway = start_gateway(["--config", str(toml)], tmp / f"gateway-{mode}.log", timeout=900)
                except RuntimeError as exc:
                    print(f"{mode}: the gateway did not start: {exc}", flush=True)
                    continue
                stack.callback(gateway.stop)
                results[mode] = asyncio.run(check_gateway(gateway.base_url, reference))
            print(f"{mode}: {results[mode]}", flush=True)
        if args.record:
            record(model_dir, args.dtype, args.record)
    if not results:
        sys.exit("no mode ran")
    keys = [key for key in next(iter(results.values())) if key != "greedy_differences"]
    print("\n| mode | " + " | ".join(keys) + " |\n|" + " --- |" * (len(keys) + 1))
    for mode, result in results.items():
        cells = [f"{result[k]:.4f}" if isinstance(result[k], float) else str(result[k]) for k in keys]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
