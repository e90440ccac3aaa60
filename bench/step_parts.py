"""Where one SMC step's next-token call spends its time: in process, and through the gateway.

    python bench/step_parts.py                                  # SmolLM2-135M, CPU, P=16
    python bench/step_parts.py --random-model llama-1b --device cuda --dtype bfloat16 --particles 256

Runs bench/smc.py's loop with our engine in process and through a gateway on this machine, in turns
(default configuration, shared memory; --no-cache: its output cache off), and prints the median
ms per step of each part: the engine's own call, the gateway call end to end, the server's parts
from its Server-Timing header (parse, rows, encode: the copy into the client's memory), what is
left of the HTTP exchange, and the client's own work around it. Each part is the median over the
steps whose rows are distinct: those right after a resampling repeat rows and pay a gather of them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smc as bench  # noqa: E402
import smc_ways  # noqa: E402

from backends.builtin_models import resolve_model_dir  # noqa: E402
from backends.transformers import TransformersEngine, resolve_device, resolve_dtype  # noqa: E402
from backends.types import EngineConfig  # noqa: E402
from logprob_gateway_client import AsyncGatewayLM  # noqa: E402


class Stopwatch:
    """Wraps an async call and keeps the duration of its last run."""

    def __init__(self, call):
        self.call = call
        self.last = 0.0

    async def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return await self.call(*args, **kwargs)
        finally:
            self.last = time.perf_counter() - started


async def run(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, float], int]:
    """The median ms of each part, and over how many steps of the gateway way."""
    device = resolve_device(args.device)
    if args.random_model:
        model_dir = bench.random_model_dir(
            args.random_model, resolve_dtype(args.dtype, device), device, tmp / "model", args.tokenizer
        )
    else:
        model_dir = resolve_model_dir(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    async with contextlib.AsyncExitStack() as stack:
        engine = TransformersEngine.load(
            EngineConfig(model=str(model_dir), dtype=args.dtype, device=args.device)
        )
        stack.push_async_callback(engine.aclose)
        engine.next_token_logprobs = inner_engine = Stopwatch(engine.next_token_logprobs)
        mode = "gateway-nocache" if args.no_cache else "gateway"
        gateway = smc_ways.start_bench_gateway(mode, model_dir, args, tmp, stack, args.cache_bytes)
        lm = AsyncGatewayLM(gateway.base_url, "smc")
        stack.push_async_callback(lm.aclose)
        # The HTTP exchange alone: the client's private transport call, timed from outside.
        lm._post_dense = exchange = Stopwatch(lm._post_dense)  # type: ignore[method-assign]
        parts: dict[str, list[float]] = {}  # ms of each part, per step

        def engine_parts(call: float) -> dict[str, float]:
            return {"engine: next_token_logprobs": inner_engine.last, "engine: the step's call": call}

        def gateway_parts(call: float) -> dict[str, float]:
            server = smc_ways.server_timing(lm)
            server = {f"server: {name}": server[name] / 1e3 for name in ("parse", "rows", "encode")}
            return {
                "gateway: the step's call": call,
                **server,
                "HTTP and the rest of the server": exchange.last - sum(server.values()),
                "client": call - exchange.last,
            }

        ways = {
            "engine": (smc_ways.engine_rows(engine), engine_parts),
            "gateway": (smc_ways.batch_rows(lm), gateway_parts),
        }
        for next_rows, _ in ways.values():
            await bench.smc(next_rows, tokenizer("warm up").input_ids, args.particles, 4, 2, 0)

        def timed_step(next_rows, parts_of):
            async def step(rows: list[list[int]]) -> object:
                started = time.perf_counter()
                out = await next_rows(rows)
                call = time.perf_counter() - started
                # Steps right after a resampling repeat rows and pay a gather: timed apart, not here.
                if len(set(map(tuple, rows))) == len(rows):
                    for name, seconds in parts_of(call).items():
                        parts.setdefault(name, []).append(seconds * 1e3)
                return out

            return step

        # The ways take turns, so a slow spell of the machine falls on both alike.
        for r in range(args.repeats):
            for way, (next_rows, parts_of) in ways.items():
                prompt = tokenizer(f"{way} run {r}").input_ids
                await bench.smc(timed_step(next_rows, parts_of), prompt, args.particles, args.steps, 4, r)
    medians = {name: statistics.median(values) for name, values in parts.items()}
    return medians, len(parts.get("client", []))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=4)
    bench.add_model_arguments(parser)
    parser.add_argument("--no-cache", action="store_true", help="the gateway's output cache off")
    parser.add_argument("--cache-bytes", type=int, help="the size of the gateway's in-process output cache")
    args = parser.parse_args()
    args.gateway_arg = []  # smc_ways.start_bench_gateway's extra `serve` flags: none
    with tempfile.TemporaryDirectory() as tmp:
        result, steps = asyncio.run(run(args, Path(tmp)))
    print(f"\n### One {args.particles}-row step of distinct rows, median ms per part over {steps} steps\n")
    print("| part | ms |\n| --- | ---: |")
    for name, ms in result.items():
        print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
