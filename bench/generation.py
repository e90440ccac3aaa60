"""Concurrent generation through a real gateway: aggregate tokens/s and per-stream latency.

    python bench/generation.py                                  # SmolLM2-135M, CPU, float32, 1 and 8 streams
    python bench/generation.py --streams 1 8 32 64 --device cuda --dtype bfloat16 --model DIR
    python bench/generation.py --backend mlx                     # the MLX engine (CPU build on Linux)

N streams each send one greedy completion (`--max-tokens`, default 48; every stream its own prompt,
stop sequences off so each makes all its tokens) through the `openai` SDK at once; a stream's
latency is its request's wall time. Each count runs `--repeats` times, after one warm-up round;
the table shows medians. It also reports what batching must not change: how many streams' texts
equal those of the same request sent alone, and the largest difference of a token logprob.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.launcher import start_gateway  # noqa: E402

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


async def one(client: openai.AsyncOpenAI, model: str, i: int, max_tokens: int) -> tuple[float, object]:
    started = time.perf_counter()
    answer = await client.completions.create(
        model=model, prompt=prompt(i), max_tokens=max_tokens, temperature=0, logprobs=1
    )
    return time.perf_counter() - started, answer.choices[0]


async def round_of(client: openai.AsyncOpenAI, model: str, streams: int, max_tokens: int):
    started = time.perf_counter()
    results = await asyncio.gather(*(one(client, model, i, max_tokens) for i in range(streams)))
    wall = time.perf_counter() - started
    tokens = sum(len(choice.logprobs.tokens) for _, choice in results)
    return tokens / wall, [latency for latency, _ in results], [choice for _, choice in results]


async def run(base_url: str, model: str, counts: list[int], max_tokens: int, repeats: int) -> None:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    alone = [(await one(client, model, i, max_tokens))[1] for i in range(max(counts))]
    rows, same, compared, worst_diff = [], 0, 0, 0.0
    for count in counts:
        await round_of(client, model, count, max_tokens)  # warm-up
        rates, latencies = [], []
        for _ in range(repeats):
            rate, latency, choices = await round_of(client, model, count, max_tokens)
            rates.append(rate)
            latencies.extend(latency)
            for choice, single in zip(choices, alone, strict=False):
                compared += 1
                if choice.text != single.text:
                    continue
                same += 1
                pairs = zip(choice.logprobs.token_logprobs, single.logprobs.token_logprobs, strict=True)
                worst_diff = max([worst_diff, *(abs(a - b) for a, b in pairs)])
        rows.append((count, statistics.median(rates), statistics.median(latencies), max(latencies)))
    base = rows[0][1]
    print(f"\n### Concurrent greedy completions of {max_tokens} tokens, median of {repeats}\n")
    print("| streams | aggregate tok/s | vs 1 stream | per-stream tok/s | latency median s | latency max s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for count, rate, median, worst in rows:
        print(
            f"| {count} | {rate:.1f} | {rate / base:.2f}x | {rate / count:.1f} | {median:.2f} | {worst:.2f} |"
        )
    print(
        f"\n{same} of {compared} streams' texts equal to their request alone; token logprobs of those within {worst_diff:.1e}."
    )
    await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--backend", default="transformers")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        gateway = start_gateway(
            [
                "--model",
                args.model,
                "--served-model-name",
                "bench",
                "--device",
                args.device,
                "--dtype",
                args.dtype,
            ],
            Path(tmp) / "gateway.log",
        )
        try:
            asyncio.run(run(gateway.base_url, "bench", args.streams, args.max_tokens, args.repeats))
        finally:
            gateway.stop()


if __name__ == "__main__":
    main()
