"""Where one SMC step's next-token call spends its time: in process, and through the gateway.

    python -m bench.step_parts                                  # SmolLM2-135M, CPU, P=16
    python -m bench.step_parts --random-model llama-1b --device cuda --dtype bfloat16 --particles 16 64 256
    python -m bench.step_parts --mock-vocab 16384 --particles 16 64 256  # the gateway's own part alone

Runs bench/smc.py's loop with our engine in process and through one gateway on this machine, in
turns: `gateway` is AsyncGatewayLM as it comes (shared memory, then the gateway's local socket),
`gateway-http` the same client with the local socket off (shared memory over HTTP). Default
configuration (--no-cache: the output cache off). Prints the median ms per step of each part: the
step's call end to end, the engine call (in process; in the gateway from its Server-Timing), the
server's parse, cache and the way to the engine, encode (the copy into the client's memory), what is left of
the exchange (transport and the rest of the server), and the client's own work around it. Each
part is the median over the steps that extend every row by a token: not the first (the prompt)
nor those right after a resampling, which repeat rows and pay a gather of them.

`--mock-vocab N` runs the mock engine (backends/mock.py) with a vocabulary of N instead of a model,
offering host memory as a GPU engine does: rows written into the client's memory by the engine,
the cache's own copy beside them. With a small N the rows cost little to compute or copy, so
what is left is the gateway's own per-call and per-row work, on any machine. (The client asks
answers under 1 MiB in the body, not in its memory: 16384 is the smallest N that keeps P = 16 on
shared memory and the local socket.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from backends.builtin_models import resolve_model_dir
from backends.mock import MockEngine
from backends.transformers.engine import TransformersEngine, resolve_device, resolve_dtype
from backends.types import EngineConfig
from bench import smc, smc_ways
from logprob_gateway_client import AsyncGatewayLM

RESAMPLE_EVERY = 4


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


async def run(args: argparse.Namespace, tmp: Path) -> dict[int, dict[str, dict[str, float]]]:
    """Per P, per way, the median ms of each part."""
    device = resolve_device(args.device)
    if args.random_model:
        model_dir = smc.random_model_dir(
            args.random_model, resolve_dtype(args.dtype, device), device, tmp / "model", args.tokenizer
        )
    else:
        model_dir = resolve_model_dir(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def prompt_ids(text: str) -> list[int]:  # within the mock's vocabulary too, --prompt-tokens long
        ids = tokenizer(text).input_ids
        if args.prompt_tokens:
            ids = (ids * -(-args.prompt_tokens // len(ids)))[-args.prompt_tokens :]  # the text last
        return [i % (args.mock_vocab or len(tokenizer)) for i in ids]

    results: dict[int, dict[str, dict[str, float]]] = {}
    async with contextlib.AsyncExitStack() as stack:
        if args.mock_vocab:
            # a cache that a few dozen steps fill, as 256 MiB of a real vocabulary's rows do
            args.cache_bytes = args.cache_bytes or 48 * max(args.particles) * args.mock_vocab * 4
            args.engine_option = [("vocab_size", args.mock_vocab), ("host_memory", "true")]
            engine = MockEngine.load(EngineConfig(model=str(model_dir), options=dict(args.engine_option)))
        else:
            engine = TransformersEngine.load(
                EngineConfig(model=str(model_dir), dtype=args.dtype, device=args.device)
            )
        stack.push_async_callback(engine.aclose)
        engine.next_token_logprobs = inner_engine = Stopwatch(engine.next_token_logprobs)
        mode = "gateway-nocache" if args.no_cache else "gateway"
        backend = "mock" if args.mock_vocab else None
        gateway = smc_ways.start_bench_gateway(
            mode, model_dir, args, tmp, stack, args.cache_bytes, backend, args.gateway_module
        )
        ways = {
            "engine": (smc_ways.engine_rows(engine), lambda call: {"call": call, "engine": inner_engine.last})
        }
        for way, local_socket in (("gateway", True), ("gateway-http", False)):
            lm = AsyncGatewayLM(gateway.base_url, "smc", local_socket=local_socket)
            stack.push_async_callback(lm.aclose)
            # The exchange alone (the local socket or HTTP): the client's private call, timed from outside.
            lm._post_dense = exchange = Stopwatch(lm._post_dense)  # type: ignore[method-assign]
            ways[way] = (smc_ways.batch_rows(lm), partial(gateway_parts, lm, exchange))
        for next_rows, _ in ways.values():  # connections, segments, kernels
            await smc.smc(next_rows, prompt_ids("warm up"), max(args.particles), 4, 2, 0)
        for p in args.particles:
            parts: dict[str, dict[str, list[float]]] = {way: {} for way in ways}
            # The output cache filled with blocks of this step's size: a served gateway's steady state
            for next_rows, _ in ways.values():
                warm = prompt_ids(f"warm up {p}")
                fill = smc.cache_fill_steps(p, engine.info.vocab_size, args.cache_bytes)
                await smc.smc(next_rows, warm, p, fill, 4, 1)

            def timed_step(way, next_rows, parts_of, parts=parts):
                taken = 0

                async def step(rows: list[list[int]]) -> object:
                    nonlocal taken
                    started = time.perf_counter()
                    out = await next_rows(rows)
                    call = time.perf_counter() - started
                    # The first step (the prompt) and those right after a resampling (every 4)
                    # repeat rows and pay a gather of them: not timed here.
                    if taken % RESAMPLE_EVERY:
                        for name, seconds in parts_of(call).items():
                            parts[way].setdefault(name, []).append(seconds * 1e3)
                    taken += 1
                    return out

                return step

            # The ways take turns, so a slow spell of the machine falls on all alike.
            for r in range(args.repeats):
                for way, (next_rows, parts_of) in ways.items():
                    prompt = prompt_ids(f"{way} run {p}.{r}")
                    await smc.smc(
                        timed_step(way, next_rows, parts_of), prompt, p, args.steps, RESAMPLE_EVERY, r
                    )
            results[p] = {
                way: {name: statistics.median(values) for name, values in named.items()}
                for way, named in parts.items()
            }
    return results


def gateway_parts(lm: AsyncGatewayLM, exchange: Stopwatch, call: float) -> dict[str, float]:
    server = {name: ms / 1e3 for name, ms in smc_ways.server_timing(lm).items()}
    return {
        "call": call,
        "engine": server["engine"],
        "parse": server["parse"],
        "cache and the way to the engine": server["rows"] - server["engine"],
        "encode": server["encode"],
        "transport and the rest of the server": exchange.last
        - server["parse"]
        - server["rows"]
        - server["encode"],
        "client": call - exchange.last,
    }


def arguments(description: str = __doc__) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--particles", type=int, nargs="+", default=[16])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=4)
    smc.add_model_arguments(parser)
    parser.add_argument("--no-cache", action="store_true", help="the gateway's output cache off")
    parser.add_argument("--cache-bytes", type=int, help="the size of the gateway's in-process output cache")
    parser.add_argument("--mock-vocab", type=int, help="the mock engine with this vocabulary, not a model")
    parser.add_argument(
        "--prompt-tokens", type=int, help="prompts of this many tokens (the text repeated), not a few"
    )
    args = parser.parse_args()
    args.gateway_arg = []  # smc_ways.start_bench_gateway's extra `serve` flags: none
    args.engine_option = []  # nor engine options
    args.gateway_module = "gateway.cli"  # the gateway's command line (server_stages: a stamped one)
    return args


def report(args: argparse.Namespace, results: dict[int, dict[str, dict[str, float]]]) -> None:
    print(f"\n### One step of distinct rows, median ms per part ({args.repeats} x {args.steps} steps)\n")
    columns = [(p, way) for p in results for way in results[p]]
    print("| part | " + " | ".join(f"P={p} {way}" for p, way in columns) + " |")
    print("| --- |" + " ---: |" * len(columns))
    names = list(dict.fromkeys(name for p, way in columns for name in results[p][way]))
    for name in names:
        cells = (results[p][way].get(name) for p, way in columns)
        print(f"| {name} | " + " | ".join("" if c is None else f"{c:.2f}" for c in cells) + " |")
    # What the issue of a call's cost measures: the call through the gateway less the same
    # engine's call in process, and less the engine call inside the gateway.
    for p in results:
        engine_call = results[p]["engine"]["call"]
        for way in ("gateway", "gateway-http"):
            own = results[p][way]
            print(
                f"P={p} {way}: {own['call'] - engine_call:.2f} ms over the engine's call in process, "
                f"{own['call'] - own['engine']:.2f} ms over its own engine call"
            )


def main() -> None:
    args = arguments()
    with tempfile.TemporaryDirectory() as tmp:
        results = asyncio.run(run(args, Path(tmp)))
    report(args, results)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
