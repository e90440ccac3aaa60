"""New weights into a composed model (SGLang generating, the transformers engine dense, one GPU),
way beside way: each engine reading the checkpoint from disk, and the dense engine's tensors
handed to SGLang over CUDA IPC (`update_weights_from_tensor`), beside a plain device copy of the
same bytes (the floor of any hand-over on one GPU).

    python -m bench.weight_handover --random-model llama-1b --tokenizer DIR --device cuda \
        --dtype bfloat16 --repeats 3

The composed engine runs in this process, as the gateway runs it. Two checkpoints of one shape
(random weights, two seeds) alternate, so every load changes every weight. Ways, each timed to its
answer (a load from disk includes reading the files):

  dense from disk       the transformers engine's `weights.load(dir)`
  sglang from disk      SGLang's `update_weights_from_disk` (`weights.load(dir)`)
  hand-over             the dense engine's tensors (`own_tensors.named()`) into SGLang
                        (`device_tensors.load`): what a trainer's collective update adds
  composed load         the composed model's `weights.load(dir)`: dense from disk, then hand-over
  device copy           every dense parameter copied into a buffer of its own on the GPU

Then what the hand-over must not change: greedy completions of a few prompts after a hand-over of
the second checkpoint, against the same prompts after SGLang loaded it from disk.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from backends.composed.capabilities import hand_over
from backends.composed.engine import ComposedEngine
from backends.registry import composed_config
from backends.types import EngineConfig, SamplingParams
from bench.sglang_check import engine_options
from bench.smc import add_model_arguments, random_model_dir

PROMPTS = [[1, 2, 3, 4], [100, 200, 300], [7] * 12, [42, 43]]


async def greedy(engine: ComposedEngine, tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0)

    async def one(ids: list[int]) -> list[int]:
        return [step.token_id async for step in engine.generate(ids, params)]

    return list(await asyncio.gather(*(one(ids) for ids in PROMPTS)))


async def timed(work: Callable[[], Awaitable[object]]) -> float:
    started = time.perf_counter()
    await work()
    torch.cuda.synchronize()
    return time.perf_counter() - started


async def device_copy(engine: ComposedEngine) -> Callable[[], Awaitable[None]]:
    tensors = [t for _, t in await engine.dense.weights.own_tensors.named()]
    buffers = [torch.empty_like(t) for t in tensors]

    async def copy() -> None:
        for buffer, tensor in zip(buffers, tensors, strict=True):
            buffer.copy_(tensor)

    return copy


async def run(args: argparse.Namespace, dirs: list[Path]) -> None:
    options = {k: v for k, v in engine_options("engine").items() if k != "mem_fraction_static"}
    config = EngineConfig(model=str(dirs[0]), dtype=args.dtype, device=args.device, options=options)
    config = composed_config(config, "sglang", "transformers", {})
    engine = await asyncio.to_thread(ComposedEngine.load, config)
    try:
        tensors = await engine.dense.weights.own_tensors.named()
        size = sum(t.numel() * t.element_size() for _, t in tensors)
        generation, dense = engine.generation.weights, engine.dense.weights
        assert generation is not None and dense is not None and engine.weights is not None
        ways: dict[str, Callable[[Path], Awaitable[object]]] = {
            "dense from disk": lambda d: dense.load(str(d)),
            "sglang from disk": lambda d: generation.load(str(d)),
            "hand-over": lambda d: hand_over(dense.own_tensors, generation.device_tensors),
            "composed load": lambda d: engine.weights.load(str(d)),
        }
        copy = await device_copy(engine)
        times: dict[str, list[float]] = {name: [] for name in [*ways, "device copy"]}
        await copy()  # warm-up
        for repeat in range(args.repeats + 1):  # the first round warms up
            for name, way in ways.items():
                seconds = await timed(lambda way=way, d=dirs[repeat % 2]: way(d))
                if repeat:
                    times[name].append(seconds)
            if repeat:
                times["device copy"].append(await timed(copy))
        print(f"### New weights into a composed model: {len(tensors)} tensors, {size / 2**30:.2f} GiB\n")
        print("| way | median s | GB/s |")
        print("| --- | ---: | ---: |")
        for name, seconds in times.items():
            median = statistics.median(seconds)
            print(f"| {name} | {median:.4f} | {size / median / 1e9:.1f} |")
        await engine.weights.load(str(dirs[1]))  # by hand-over
        handed = await greedy(engine, args.tokens)
        await generation.load(str(dirs[1]))  # the same weights, read by SGLang itself
        read = await greedy(engine, args.tokens)
        equal = sum(a == b for a, b in zip(handed, read, strict=True))
        print(f"\nGreedy completions of {args.tokens} tokens equal after a hand-over and after a")
        print(f"load from disk of the same weights: {equal}/{len(PROMPTS)}")
    finally:
        await engine.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt in the check")
    args = parser.parse_args()
    if not args.random_model:
        parser.error("--random-model: the bench builds two checkpoints of one shape")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [
            random_model_dir(
                args.random_model, dtype, device, Path(tmp) / f"seed-{seed}", args.tokenizer, seed
            )
            for seed in (0, 1)
        ]
        torch.cuda.empty_cache()
        asyncio.run(run(args, dirs))


if __name__ == "__main__":
    main()
