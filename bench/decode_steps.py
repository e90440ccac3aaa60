"""Concurrent greedy streams in the transformers engine, in process: steps ahead on the device or not.

    python -m bench.decode_steps --random-model llama-1b --tokenizer DIR --device cuda --dtype bfloat16 \
        --streams 8 64 --max-tokens 128 --steps-ahead 1 8 16
    python -m bench.decode_steps --random-model llama-tiny --lane --streams 64   # CPU: host work alone

N streams each generate `--max-tokens` greedy tokens (no logprobs, sent whole: the tokens come in
bursts of 50, as a completion's do) through one TransformersEngine, from 32-token prompts of their
own. Each `--steps-ahead` value is a way (the engine option `greedy_steps_ahead`: how many greedy
steps a pass may take with each step's tokens fed back on the device; 1 is one step a pass). The
ways share one loaded engine and run in turns, `--repeats` rounds each after a warm-up round, new
prompts every round. Prints per way and stream count the median tok/s, the event loop's CPU time
per token (`time.thread_time` of its thread: sampling, scheduling, the generators), the passes per
round, where the engine's worker thread spent the round (its share of the wall time in passes;
per step of the passes that took steps ahead, and in the other passes: prompts, single steps),
and whether every stream's tokens equal those of the first way.

`--lane` turns the decode lane on where it is off by default (the CPU; no CUDA graphs there), so
that the steps-ahead path runs at all: on a CPU with `llama-tiny`, what it saves is host work.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from backends.transformers.engine import TransformersEngine, resolve_device, resolve_dtype
from backends.types import EngineConfig, SamplingParams
from bench.smc import add_model_arguments, random_model_dir

PROMPT_TOKENS = 32


class PassClock:
    """The engine's passes timed on its worker thread: those that took several steps of each
    stream (and how many), and the others."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.ahead_s = self.other_s = 0.0
        self.ahead_steps = self.other_passes = 0
        timed = engine._step_results

        def step_results(groups: list) -> list:
            started = time.perf_counter()
            results = timed(groups)
            elapsed = time.perf_counter() - started
            steps = max((len(r) for r in results if isinstance(r, list)), default=1)
            if steps > 1:
                self.ahead_s += elapsed
                self.ahead_steps += steps
            else:
                self.other_s += elapsed
                self.other_passes += 1
            return results

        engine._step_results = step_results  # type: ignore[method-assign]

    def read(self) -> tuple[float, float, int, int]:
        return self.ahead_s, self.other_s, self.ahead_steps, self.other_passes


async def one_round(
    engine: TransformersEngine, clock: PassClock, streams: int, tokens: int, seed: int
) -> tuple[float, float, int, list, tuple[float, float, float]]:
    """tok/s, event-loop CPU µs per token, passes, each stream's tokens, and the worker's time:
    its busy share of the wall, ms per step taken ahead, ms in other passes."""
    vocab = min(engine.info.vocab_size, len(engine.info.tokenizer)) - 1000
    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=False, stream_interval=50)

    async def stream(i: int) -> list[int]:
        prompt = [(seed * 7919 + i * 104729 + k * 31) % vocab + 1000 for k in range(PROMPT_TOKENS)]
        return [step.token_id async for step in engine.generate(prompt, params)]

    passes, before = engine.status().pass_stats.passes, clock.read()
    started, cpu = time.perf_counter(), time.thread_time()
    texts = await asyncio.gather(*(stream(i) for i in range(streams)))
    wall, loop_cpu = time.perf_counter() - started, time.thread_time() - cpu
    ahead_s, other_s, ahead_steps, _ = (now - then for now, then in zip(clock.read(), before, strict=True))
    worker = ((ahead_s + other_s) / wall, 1e3 * ahead_s / max(ahead_steps, 1), 1e3 * other_s)
    count = sum(map(len, texts))
    return count / wall, loop_cpu / count * 1e6, engine.status().pass_stats.passes - passes, texts, worker


async def run(args: argparse.Namespace, model: str) -> list[tuple]:
    options = {"decode_lane_rows": 512, "decode_lane_compile": False} if args.lane else {}
    config = EngineConfig(model=model, dtype=args.dtype, device=args.device, options=options)
    engine = await asyncio.to_thread(TransformersEngine.load, config)
    clock = PassClock(engine)
    rows = []
    try:
        for streams in args.streams:
            ways = args.steps_ahead
            results: dict[int, list[tuple]] = {w: [] for w in ways}
            for round_ in range(args.repeats + 1):
                for way in ways if round_ % 2 == 0 else list(reversed(ways)):
                    engine.steps_ahead = way
                    result = await one_round(engine, clock, streams, args.max_tokens, seed=round_)
                    if round_:  # the first round warms up (shapes, graphs)
                        results[way].append(result)
            first = results[ways[0]]
            for way, runs in results.items():
                equal = sum(
                    a == b for r, f in zip(runs, first, strict=True) for a, b in zip(r[3], f[3], strict=True)
                )
                rows.append(
                    (
                        way,
                        streams,
                        statistics.median(r[0] for r in runs),
                        statistics.median(r[1] for r in runs),
                        statistics.median(r[2] for r in runs),
                        *(statistics.median(r[4][i] for r in runs) for i in range(3)),
                        f"{equal}/{streams * len(runs)}",
                    )
                )
                rates = [round(r[0]) for r in runs]
                print(f"steps ahead {way}, {streams} streams: {rates} tok/s", flush=True)
    finally:
        await engine.aclose()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--steps-ahead", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lane", action="store_true", help="the decode lane on where it is off by default")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.random_model:
            device = resolve_device(args.device)
            model = str(
                random_model_dir(
                    args.random_model, resolve_dtype(args.dtype, device), device, Path(tmp), args.tokenizer
                )
            )
        rows = asyncio.run(run(args, model))
    print(f"\n### {args.max_tokens} greedy tokens per stream, sent whole, median of {args.repeats}\n")
    print(
        "| steps ahead | streams | tok/s | event loop µs/token | passes per round | worker busy"
        " | ms per step ahead | ms in other passes | tokens equal the first way's |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for way, streams, rate, loop_us, passes, busy, ahead_ms, other_ms, equal in rows:
        print(
            f"| {way} | {streams} | {rate:,.0f} | {loop_us:.1f} | {passes:.0f} | {busy:.0%}"
            f" | {ahead_ms:.2f} | {other_ms:.1f} | {equal} |"
        )


if __name__ == "__main__":
    main()
