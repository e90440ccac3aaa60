"""Dense rows out of SGLang, two ways side by side, against the transformers engine on one GPU.

    python -m bench.sglang_rows --random-model llama-1b --device cuda --dtype bfloat16 \
        --particles 64 256 --steps 8 --repeats 3          # on a GPU machine with sglang

Every step, each of P particles appends a seeded random token to its prefix (a 32-token prompt
shared by all), and the next-token row of every prefix is asked for, so SGLang's radix cache
reuses each particle's earlier prefix. The ways:

  sorted      the SGLang engine's fallback for servers without the processor
              (backends/sglang/engine.py): one request per row with top_logprobs_num = vocabulary, the
              sorted distribution scattered back
  processor   the SGLang engine's own way: one request per row with max_new_tokens = 1 and the
              custom logit processor of backends/sglang/processor.py, which in SGLang's scheduler
              takes the log_softmax of the batch's logits to the host once and hands each request
              its row in `customized_info` (SGLang returns it in meta_info)
  processor-batch  the same, a step's rows as one batch request (one GenerateReqInput)
  processor-file   one request per row through bench/sglang_processor.py, the rows written into
              a file in /dev/shm that both processes map (a slot per request), only a flag back
              through SGLang
  transformers  our transformers engine, the same rows (the pace to reach)

Prints rows/s per P (median of --repeats), each way's ratio to transformers, and the largest
|difference| of each SGLang way's rows from the transformers engine's (finite entries).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import torch

from backends.sglang.engine import SglangEngine
from backends.transformers.engine import TransformersEngine, resolve_device, resolve_dtype
from backends.types import EngineConfig
from bench.sglang_processor import FileRowsProcessor
from bench.smc import add_model_arguments, random_model_dir
from bench.smc_ways import SGLANG_ARGS

Rows = Callable[[list[list[int]]], Awaitable[np.ndarray]]


def sorted_rows(engine: SglangEngine) -> Rows:
    """Rows the way the engine asks a server without the processor: the same engine, sorted."""
    view = copy.copy(engine)  # shares the transport; only the way of asking differs
    view.dense_rows = "sorted"
    return view.next_token_logprobs


def processor_file_rows(engine: SglangEngine, directory: Path) -> Rows:
    """Rows through the custom logit processor, written into a file in shared memory that both
    processes map: one request per row, only a flag back through SGLang."""
    processor = FileRowsProcessor.to_str()
    path = directory / "rows"

    async def one(row: list[int], slot: int) -> None:
        sampling = {
            "max_new_tokens": 1,
            "temperature": 0.0,
            "custom_params": {"file": str(path), "slot": slot},
        }
        await engine.transport.generate(
            {"input_ids": row, "sampling_params": sampling, "custom_logit_processor": processor}
        )

    async def rows(prefixes: list[list[int]]) -> np.ndarray:
        nbytes = len(prefixes) * engine.info.vocab_size * 4
        if not path.exists() or path.stat().st_size < nbytes:
            with path.open("wb") as f:
                f.truncate(nbytes)
        await asyncio.gather(*(one(p, i) for i, p in enumerate(prefixes)))
        mapped = np.memmap(path, dtype=np.float32, mode="r").reshape(-1, engine.info.vocab_size)
        return np.array(mapped[: len(prefixes)])

    return rows


def processor_batch_rows(engine: SglangEngine) -> Rows:
    """Rows through the custom logit processor, a step's rows as one batch request of SGLang's."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    manager = engine.transport.engine.tokenizer_manager

    async def rows(prefixes: list[list[int]]) -> np.ndarray:
        requests = [engine.processor_request(prefix, None) for prefix in prefixes]
        request = GenerateReqInput(
            input_ids=[r["input_ids"] for r in requests],
            sampling_params=[r["sampling_params"] for r in requests],
            custom_logit_processor=[r["custom_logit_processor"] for r in requests],
            stream=False,
        )
        outs = await manager.generate_request(request, None).__anext__()
        return np.stack([np.frombuffer(out["meta_info"]["dense"][0], dtype="<f4") for out in outs])

    return rows


async def run_way(
    rows: Rows, prompt: list[int], particles: int, steps: int, seed: int
) -> tuple[float, np.ndarray]:
    """rows/s over `steps` steps, and the last step's rows."""
    rng = np.random.default_rng(seed)
    prefixes = [list(prompt) for _ in range(particles)]
    started = time.perf_counter()
    last = np.empty(0)
    for _ in range(steps):
        for prefix in prefixes:
            prefix.append(int(rng.integers(100, 40000)))
        last = await rows(prefixes)
    return particles * steps / (time.perf_counter() - started), last


async def compare(
    ways: dict[str, Rows], args: argparse.Namespace, before_repeat: Callable[[int], None] | None = None
) -> None:
    """Print rows/s per P of every way (one of them "transformers", the reference), and the largest
    |difference| of each way's last rows from the reference's. `before_repeat(P)` runs before
    each repeat, the first of which (fewer steps) only warms up."""
    rng = np.random.default_rng(args.seed)
    print("| particles | way | rows/s | min-max | vs transformers | max abs diff vs transformers |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for particles in args.particles:
        speeds: dict[str, list[float]] = {name: [] for name in ways}
        diffs: dict[str, float] = {name: 0.0 for name in ways}
        for repeat in range(args.repeats + 1):  # the first run warms up (compiles, graphs)
            if before_repeat is not None:
                before_repeat(particles)
            prompt = [int(t) for t in rng.integers(100, 40000, size=32)]
            last: dict[str, np.ndarray] = {}
            for name, rows in ways.items():
                steps = args.steps if repeat else 2
                speed, last[name] = await run_way(rows, prompt, particles, steps, args.seed + repeat)
                if repeat:
                    speeds[name].append(speed)
            for name, got in last.items():
                finite = np.isfinite(last["transformers"]) & np.isfinite(got)
                diffs[name] = max(diffs[name], float(np.abs(got - last["transformers"])[finite].max()))
        reference = statistics.median(speeds["transformers"])
        for name, values in speeds.items():
            median = statistics.median(values)
            print(
                f"| {particles} | {name} | {median:,.0f} | {min(values):,.0f}-{max(values):,.0f} "
                f"| {median / reference:.3f}x | {diffs[name]:.3g} |"
            )


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """What `compare` reads: --particles, --steps, --repeats, --seed, and the model's arguments."""
    parser.add_argument("--particles", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    add_model_arguments(parser)


async def main_async(args: argparse.Namespace) -> None:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        model_dir = (
            random_model_dir(args.random_model, dtype, device, Path(tmp), args.tokenizer)
            if args.random_model
            else Path(args.model)
        )
        options = {"mode": "engine", **SGLANG_ARGS}
        sglang = await asyncio.to_thread(
            SglangEngine.load, EngineConfig(model=str(model_dir), dtype=args.dtype, options=options)
        )
        transformers = await asyncio.to_thread(
            TransformersEngine.load, EngineConfig(model=str(model_dir), dtype=args.dtype, device=args.device)
        )
        ways: dict[str, Rows] = {
            "sorted": sorted_rows(sglang),
            "processor": sglang.next_token_logprobs,
            "processor-batch": processor_batch_rows(sglang),
            "processor-file": processor_file_rows(sglang, Path(shm)),
            "transformers": transformers.next_token_logprobs,
        }
        if args.skip_sorted:
            del ways["sorted"]
        await compare(ways, args)
        await sglang.aclose()
        await transformers.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_compare_arguments(parser)
    parser.add_argument("--skip-sorted", action="store_true", help="leave out today's way (slow at large P)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
