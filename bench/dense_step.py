"""The transformers engine's next-token call alone, step by step, as an SMC loop makes it.

P particles extend their rows by a random token per step and are resampled every 4 steps; no
sampler runs in between, so the table is the engine's own time per call (rows in host memory
included) as it ships, without compiling the decode lane, and without the lane, beside two
references in the same process: `static`, transformers' own static-shape decode (StaticCache,
the step compiled with CUDA graphs: the limit a fixed-shape step reaches) and `decode`, a plain
transformers decode (DynamicCache). Each way's column `÷ static` is its median over the static
reference's. `--ways` picks some; `--profile` prints torch's profile of a few steps of the engine
as it ships. On CUDA a last column gives each way's median over the bandwidth floor, measured in
the same process: every weight read once, the rows' keys and values read once, and the float32
rows copied into page-locked host memory (`bandwidth_floor_ms`).

    python -m bench.dense_step --random-model llama-1b --device cuda --dtype bfloat16 --particles 16 64 256
    python -m bench.dense_step ... --ways "as shipped" static      # the engine beside its limit
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from backends.builtin_models import resolve_model_dir
from backends.rows import PackedRows
from backends.transformers.engine import TransformersEngine, resolve_device, resolve_dtype
from backends.transformers.lane_shape import kv_layout
from backends.types import EngineConfig
from bench.smc import add_model_arguments, random_model_dir
from bench.smc_ways import PlainDecode, StaticDecode

ENGINE_WAYS = {  # engine options: the defaults (on CUDA: the decode lane, compiled), then without each
    "as shipped": {},
    "lane not compiled": {"decode_lane_compile": False},
    "no lane": {"decode_lane_rows": 0},
}
WAYS = ["static", *ENGINE_WAYS, "decode"]  # the static reference first: the others' ratios need it


def bandwidth_floor_ms(model, rows: int, length: int, repeats: int = 20) -> float:
    """What a dense call of `rows` rows of `length` tokens cannot go below on this device: each
    weight read once (a norm of every parameter), each row's keys and values read once, and the
    rows' float32 log-probabilities copied to page-locked host memory. The median of `repeats`."""
    import torch

    params = [p for p in model.parameters()]
    layers, kv_heads, head_dim = kv_layout(model)
    kv = torch.empty(
        2 * layers * rows * kv_heads * length * head_dim, dtype=params[0].dtype, device=params[0].device
    )
    vocab = model.get_output_embeddings().weight.shape[0]
    logprobs = torch.empty(rows, vocab, dtype=torch.float32, device=params[0].device)
    host = torch.empty(rows, vocab, dtype=torch.float32, pin_memory=True)
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch._foreach_norm(params)
        kv.sum()
        host.copy_(logprobs, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def engine_call(engine: TransformersEngine):
    """The engine's dense call on rows of token-id lists, packed as the gateway packs them."""

    async def call(rows: list[list[int]]) -> np.ndarray:
        return await engine.next_token_logprobs(PackedRows.of(rows), [None] * len(rows))

    return call


async def steps(call, prompt: list[int], particles: int, count: int, vocab: int, seed: int) -> list[float]:
    """Seconds of each call."""
    rng = np.random.default_rng(seed)
    rows = [list(prompt) for _ in range(particles)]
    seconds = []
    for step in range(count):
        unique = [list(r) for r in dict.fromkeys(map(tuple, rows))]
        started = time.perf_counter()
        await call(unique)
        seconds.append(time.perf_counter() - started)
        rows = [r + [int(t)] for r, t in zip(rows, rng.integers(0, vocab, particles), strict=True)]
        if step % 4 == 3:
            rows = [rows[i] for i in rng.choice(particles, particles)]
    return seconds


async def run(args: argparse.Namespace, tmp: Path) -> None:
    from transformers import AutoModelForCausalLM

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.random_model:
        model_dir = random_model_dir(args.random_model, dtype, device, tmp / "model", args.tokenizer)
    else:
        model_dir = resolve_model_dir(args.model)
    engines = {
        name: TransformersEngine.load(
            EngineConfig(model=str(model_dir), dtype=args.dtype, device=args.device, options=options)
        )
        for name, options in ENGINE_WAYS.items()
        if name in args.ways
    }
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    vocab = model.get_output_embeddings().weight.shape[0]
    max_len = args.prompt_tokens + args.steps + 8
    print(
        "| P | way | call ms median | p90 | min | ÷ static | ÷ floor |\n| ---: | --- | ---: | ---: | ---: | ---: | ---: |"
    )
    for p in args.particles:
        static = StaticDecode(model, p, max_len) if "static" in args.ways else None
        # the rows' mean length over the steps
        floor = (
            bandwidth_floor_ms(model, p, args.prompt_tokens + args.steps // 2)
            if device.type == "cuda"
            else None
        )
        if floor is not None:
            print(f"| {p} | bandwidth floor | {floor:.2f} | | | | 1.00 |", flush=True)
        medians = {}
        for name in [w for w in WAYS if w in args.ways]:
            times = []
            for r in range(args.repeats + 1):
                if name == "static":
                    assert static is not None
                    static.restart()
                    call = static
                else:
                    call = PlainDecode(model) if name == "decode" else engine_call(engines[name])
                prompt = [1 + (p * 7 + r * 13 + i) % 1000 for i in range(args.prompt_tokens)]
                got = await steps(call, prompt, p, args.steps, vocab, seed=r)
                if r:  # the first run warms up (shapes captured and compiled, blocks allocated)
                    times += got[1:]
            ms = sorted(t * 1e3 for t in times)
            medians[name] = statistics.median(ms)
            ratio = f"{medians[name] / medians['static']:.2f}" if "static" in medians else "–"
            over_floor = f"{medians[name] / floor:.2f}" if floor else "–"
            print(
                f"| {p} | {name} | {medians[name]:.2f} | {ms[int(0.9 * len(ms))]:.2f} | {ms[0]:.2f} | {ratio} | {over_floor} |",
                flush=True,
            )
    if args.profile and "as shipped" in engines:
        from torch.profiler import ProfilerActivity, profile

        name, engine = "as shipped", engines["as shipped"]
        prompt = list(range(1, args.prompt_tokens + 1))
        await steps(engine_call(engine), prompt, args.particles[-1], 8, vocab, seed=99)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        prof = profile(activities=activities)
        await engine._run(prof.__enter__)  # the engine's model calls run on its worker thread
        await steps(engine_call(engine), prompt + [7], args.particles[-1], 9, vocab, seed=99)
        await engine._run(prof.__exit__, None, None, None)
        print(f"profile of {name}, P = {args.particles[-1]}, 9 steps")
        print(prof.key_averages().table(sort_by=args.sort, row_limit=30))
    for engine in engines.values():
        await engine.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--particles", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--ways", nargs="+", default=WAYS, choices=WAYS)
    add_model_arguments(parser)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sort", default="self_cuda_time_total", help="the profile table's order")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    main()
