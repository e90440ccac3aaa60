"""Concurrent greedy generation, target beside target: aggregate tokens/s and per-stream latency.

    python bench/generation.py                                  # SmolLM2-135M, CPU, float32, 1 and 8 streams
    python bench/generation.py --streams 1 8 32 64 --device cuda --dtype bfloat16 --model DIR
    python bench/generation.py --backend mlx                     # the MLX engine (CPU build on Linux)
    python bench/generation.py --random-model llama-1b --device cuda --dtype bfloat16 --tokenizer DIR \
        --streams 1 8 64 --max-tokens 128 --targets gateway-transformers gateway-sglang-engine \
        gateway-sglang-server sglang-server transformers-generate   # the SGLang comparison, on a GPU

Targets (bench/generation_targets.py): `gateway-B` our gateway with backend B (transformers, vllm,
mlx), `gateway-sglang-engine` / `gateway-sglang-server` our SGLang engine in either mode,
`sglang-server` / `vllm-server` that engine's own server started here, `transformers-generate`
transformers' batched `generate` in this process. Without --targets: `gateway-<--backend>`.

Every target gets the same requests: N streams each send one greedy completion (`--max-tokens`,
default 48; every stream its own prompt, logprobs=1, no stop sequences) through the `openai` SDK at
once (transformers-generate: one batch of the N prompts); a stream's latency is its request's wall
time. The targets run one after another, each started once for all stream counts and stopped
before the next starts (one GPU). Each count runs `--repeats` times after one warm-up round.

Prints one Markdown table on stdout, progress on stderr: per target and stream count the median
aggregate tok/s, its ratio to `--reference` (default: the first target) at the same count, the
latency p50 and p95 over all streams of all repeats, and what batching must not change: how many
streams' texts equal those of the same request sent alone to that target, and the largest
difference of a token logprob among those. A target that cannot start (SGLang without CUDA, say)
is reported on stderr and left out. --random-model builds randomly initialised weights of a named
shape (bench/smc.py) in a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.builtin_models import resolve_model_dir  # noqa: E402
from backends.transformers import resolve_device, resolve_dtype  # noqa: E402
from bench.generation_targets import TARGETS, Completion, Setup, Target, TargetUnavailable, start_target  # noqa: E402
from bench.smc import add_model_arguments, random_model_dir  # noqa: E402

TOPICS = [
    "the sea",
    "a mountain",
    "the city at night",
    "a library",
    "winter",
    "a garden",
    "trains",
    "the moon",
]


def prompt(i: int) -> str:
    return f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i}):"


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class Row:
    target: str
    streams: int
    rate: float  # median aggregate tokens/s
    latency_p50: float
    latency_p95: float
    equal: int  # streams whose text equals the request's alone
    compared: int
    worst_diff: float  # largest |token logprob difference| of the equal ones


def agreement(done: list[Completion], alone: list[Completion]) -> tuple[int, float]:
    """How many of `done` have their request's text alone, and their largest logprob difference."""
    equal, worst = 0, 0.0
    for got, single in zip(done, alone, strict=True):
        if got.text != single.text:
            continue
        equal += 1
        pairs = zip(got.token_logprobs, single.token_logprobs, strict=True)
        worst = max([worst, *(abs(a - b) for a, b in pairs)])
    return equal, worst


async def measure(
    name: str, target: Target, counts: list[int], max_tokens: int, repeats: int, rows: list[Row]
) -> None:
    """Appends a row per stream count to `rows` as it is measured."""
    progress(f"{name}: {max(counts)} requests alone")
    alone = [(await target.round([prompt(i)], max_tokens))[0] for i in range(max(counts))]
    for count in counts:
        progress(f"{name}: {count} streams")
        prompts = [prompt(i) for i in range(count)]
        await target.round(prompts, max_tokens)  # warm-up
        rates, latencies, equal, worst = [], [], 0, 0.0
        for _ in range(repeats):
            started = time.perf_counter()
            done = await target.round(prompts, max_tokens)
            rates.append(sum(c.tokens for c in done) / (time.perf_counter() - started))
            latencies.extend(c.latency_s for c in done)
            same, diff = agreement(done, alone[:count])
            equal, worst = equal + same, max(worst, diff)
        p50, p95 = np.percentile(latencies, [50, 95])
        rows.append(Row(name, count, statistics.median(rates), p50, p95, equal, count * repeats, worst))
        progress(f"{name}: {count} streams, {rows[-1].rate:.1f} tok/s")  # kept if the run is cut short


async def run_targets(args: argparse.Namespace, setup: Setup) -> list[Row]:
    rows: list[Row] = []
    for name in args.targets:
        progress(f"{name}: starting")
        async with contextlib.AsyncExitStack() as stack:  # stops the target before the next starts
            try:
                target = await start_target(name, setup, stack)
            except TargetUnavailable as exc:
                progress(f"{name}: skipped, {exc}")
                continue
            try:
                await measure(name, target, args.streams, args.max_tokens, args.repeats, rows)
            except (
                openai.OpenAIError,
                RuntimeError,
            ) as exc:  # a crash or out of memory: the others still run
                progress(f"{name}: failed after {sum(r.target == name for r in rows)} stream counts: {exc!r}")
        progress(f"{name}: stopped")
    return rows


def print_table(rows: list[Row], reference: str, max_tokens: int, repeats: int) -> None:
    base = {row.streams: row.rate for row in rows if row.target == reference}
    print(f"### Concurrent greedy completions of {max_tokens} tokens, median of {repeats}\n")
    print(
        f"| target | streams | aggregate tok/s | vs {reference} | latency p50 s | latency p95 s "
        "| texts equal alone | max logprob diff |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    order = {name: i for i, name in enumerate(dict.fromkeys(row.target for row in rows))}
    for row in sorted(rows, key=lambda r: (r.streams, order[r.target])):
        ratio = f"{row.rate / base[row.streams]:.2f}x" if row.streams in base else "-"
        print(
            f"| {row.target} | {row.streams} | {row.rate:.1f} | {ratio} | {row.latency_p50:.2f} "
            f"| {row.latency_p95:.2f} | {row.equal}/{row.compared} | {row.worst_diff:.1e} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--targets", nargs="+", choices=TARGETS, help="default: gateway-<--backend>")
    parser.add_argument("--backend", default="transformers", choices=["transformers", "vllm", "mlx"])
    parser.add_argument("--reference", choices=TARGETS, help="the target ratios are to (default: the first)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--logs", type=Path, help="keep the targets' logs here (default: removed at the end)")
    args = parser.parse_args()
    args.targets = list(dict.fromkeys(args.targets or [f"gateway-{args.backend}"]))
    reference = args.reference or args.targets[0]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.random_model:
            device = resolve_device(args.device)
            progress(f"building random {args.random_model} weights")
            dtype = resolve_dtype(args.dtype, device)
            model_dir = random_model_dir(args.random_model, dtype, device, tmp / "model", args.tokenizer)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the servers get the memory the weights were built in
        else:
            model_dir = resolve_model_dir(args.model)
        logs = args.logs or tmp
        logs.mkdir(parents=True, exist_ok=True)
        setup = Setup(model_dir, args.dtype, args.device, logs, logs_kept=args.logs is not None)
        rows = asyncio.run(run_targets(args, setup))
    if not rows:
        sys.exit("no target ran")
    if all(row.target != reference for row in rows):
        progress(f"{reference} did not run: no ratios")
    print_table(rows, reference, args.max_tokens, args.repeats)


if __name__ == "__main__":
    main()
