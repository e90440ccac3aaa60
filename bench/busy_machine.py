"""The gateway on a machine it shares: an SMC loop and 8 chat streams, with busy loops beside them
or not, per setting of `threads` (the engines' math on the CPU).

    python -m bench.busy_machine                       # threads = every CPU, then the default
    python -m bench.busy_machine --threads 2 1 --busy 0 2

For each `--threads` value (0: the default) a gateway of the real default model starts; for each
`--busy` count that many processes spin on the CPU while the client (this process, on the same
machine) runs an SMC loop through `AsyncGatewayLM` (16 particles, `--steps` steps, one batch call
per step) and then 8 concurrent chat streams of 30 tokens. Prints a Markdown table: SMC rows/s,
the streams' wall time and each stream's p50 time between tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from backends.cpu_threads import cpus_available
from bench.launcher import start_gateway

MODEL = "smollm2-135m"


def _spin() -> None:
    while True:
        pass


async def smc_rows_per_s(base: str, steps: int, seed: int) -> float:
    from logprob_gateway_client import AsyncGatewayLM

    rng = random.Random(seed)
    prompt = [rng.randrange(100, 40000) for _ in range(128)]
    tails: list[list[int]] = [[] for _ in range(16)]
    lm = AsyncGatewayLM(base, MODEL, server_cache=False)
    try:
        await lm.batch_next_token_logprobs([prompt])  # warm
        began = time.perf_counter()
        for _ in range(steps):
            await lm.batch_next_token_logprobs([prompt + tail for tail in tails])
            for tail in tails:
                tail.append(rng.randrange(100, 40000))
        return steps * len(tails) / (time.perf_counter() - began)
    finally:
        await lm.aclose()


async def streams(base: str, count: int) -> tuple[float, float]:
    """Wall time of `count` concurrent 30-token chat streams, and the p50 gap between tokens (s)."""
    gaps: list[float] = []

    async def one(client: httpx.AsyncClient, index: int) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Tell story number {index}."}],
            "max_tokens": 30,
            "temperature": 0,
            "stream": True,
        }
        last = None
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now

    began = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client, i) for i in range(count)))
    return time.perf_counter() - began, statistics.median(gaps) if gaps else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[cpus_available(), 0])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print("| threads | busy loops | SMC rows/s | 8 streams, wall (s) | p50 between tokens (ms) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as workdir:
        for threads in args.threads:
            gateway = start_gateway(
                ["--model", MODEL, "--dtype", "float32", "--threads", str(threads)],
                Path(workdir) / f"gateway-{threads}.log",
            )
            try:
                for busy in args.busy:
                    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
                    for spinner in spinners:
                        spinner.start()
                    try:
                        rows = asyncio.run(smc_rows_per_s(gateway.base_url, args.steps, seed=busy))
                        wall, gap = asyncio.run(streams(gateway.base_url, 8))
                    finally:
                        for spinner in spinners:
                            spinner.terminate()
                            spinner.join()
                    name = f"{threads}" if threads else f"default ({max(1, cpus_available() // 2)})"
                    print(f"| {name} | {busy} | {rows:.1f} | {wall:.1f} | {gap * 1e3:.0f} |", flush=True)
            finally:
                gateway.stop()


if __name__ == "__main__":
    main()
