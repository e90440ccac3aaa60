"""Sequential Monte Carlo workload: rows/s of dense next-token rows, per way of serving them.

    python bench/smc.py                                    # SmolLM2-135M, CPU, float32, 16 x 24
    python bench/smc.py --particles 32 --steps 48 --repeats 5 --plot smc.png
    python bench/smc.py --random-model llama-1b --device cuda --dtype bfloat16 \
        --particles 16 64 256 --steps 16 --modes engine gateway decode   # the GPU run

P particles share a prompt; every step asks the next-token distribution of all P prefixes, samples
each particle's next token from its row (seeded numpy), and every --resample-every steps resamples
the particles by the log-probabilities of their sampled tokens (so particles share prefixes). Each
way runs the same algorithm:

  engine    our TransformersEngine in-process (prefix K/V reuse), identical rows sent once
  gateway   a real gateway process (gateway.launcher), through gateway.client.AsyncGatewayLM
  gateway-nocache   the same with the gateway's output cache off (SMC rows never repeat)
  genlm     genlm-backend's in-process AsyncTransformer, the prompt's K/V cached first (cache_kv)
  decode    plain transformers batched decode with one DynamicCache: the engine's limit

Prints a Markdown table of rows/s per particle count (median over --repeats runs, each with its own prompt so no
cache carries over), checks rows of `engine` and `gateway` against an uncached forward pass of the
same weights, and writes a bar chart (matplotlib). --random-model builds randomly initialised
weights of a named shape (SmolLM2's tokenizer, vocab 49152) in a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.base import EngineConfig  # noqa: E402
from backends.builtin_models import DEFAULT_MODEL, resolve_model_dir  # noqa: E402
from backends.transformers import TransformersEngine, resolve_device, resolve_dtype  # noqa: E402
from gateway.client import AsyncGatewayLM  # noqa: E402
from gateway.launcher import start_gateway  # noqa: E402

PROMPT = "The old lighthouse keeper climbed the stairs every evening, and tonight, as the storm rolled in, he"
SHAPES = {  # Llama-3.2-1B's shape with SmolLM2's vocabulary
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        vocab_size=49152,
    ),
}
MODES = ["engine", "gateway", "gateway-nocache", "genlm", "decode"]
NextRows = Callable[[list[list[int]]], Awaitable[np.ndarray]]  # rows -> float32 [rows, vocab]


def random_model_dir(shape: str, dtype: torch.dtype, directory: Path, tokenizer_dir: Path | None) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or resolve_model_dir(DEFAULT_MODEL))
    config = LlamaConfig(
        **SHAPES[shape],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def sample(logprobs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    cdf = np.cumsum(np.exp(logprobs.astype(np.float64)), axis=1)
    u = rng.random(len(cdf)) * cdf[:, -1]
    return np.minimum((cdf < u[:, None]).sum(axis=1), cdf.shape[1] - 1)


async def smc(
    next_rows: NextRows, prompt: list[int], particles: int, steps: int, resample_every: int, seed: int
) -> tuple[float, list[tuple[list[int], np.ndarray]]]:
    """Seconds taken, and (row, logprobs) of the first and last particle at a few steps."""
    rng = np.random.default_rng(seed)
    rows = [list(prompt) for _ in range(particles)]
    weights = np.zeros(particles)
    kept = []
    started = time.perf_counter()
    for step in range(steps):
        logprobs = await next_rows(rows)
        if step in (0, steps // 2, steps - 1):
            kept += [(list(rows[i]), logprobs[i].copy()) for i in (0, particles - 1)]
        tokens = sample(logprobs, rng)
        weights += logprobs[np.arange(particles), tokens]
        rows = [r + [int(t)] for r, t in zip(rows, tokens, strict=True)]
        if (step + 1) % resample_every == 0:
            w = np.exp(weights - weights.max())
            rows = [list(rows[i]) for i in rng.choice(particles, particles, p=w / w.sum())]
            weights[:] = 0
    return time.perf_counter() - started, kept


def engine_rows(engine: TransformersEngine) -> NextRows:
    async def next_rows(rows: list[list[int]]) -> np.ndarray:
        index: dict[tuple[int, ...], int] = {}  # identical rows once, as the gateway's batcher does
        for row in rows:
            index.setdefault(tuple(row), len(index))
        out = await engine.next_token_logprobs(list(index))
        return out[[index[tuple(r)] for r in rows]]

    return next_rows


def client_rows(lm: object) -> NextRows:
    """Concurrent per-particle calls, as genlm's samplers make them; the client batches them."""

    async def next_rows(rows: list[list[int]]) -> np.ndarray:
        out = await asyncio.gather(*(lm.next_token_logprobs(r) for r in rows))  # type: ignore[attr-defined]
        return torch.stack(out).float().cpu().numpy()

    return next_rows


class PlainDecode:
    """One DynamicCache for all particles: prefill the prompt once, then one token per row per
    step; resampling reorders the cache rows. Rows must all extend the previous step's rows."""

    def __init__(self, model: object) -> None:
        self.model = model
        self.cache = None
        self.previous: dict[tuple[int, ...], int] = {}

    async def __call__(self, rows: list[list[int]]) -> np.ndarray:
        with torch.inference_mode():
            return self._step(rows)

    def _step(self, rows: list[list[int]]) -> np.ndarray:
        device = next(self.model.parameters()).device  # type: ignore[attr-defined]
        if self.cache is None:
            out = self.model(torch.tensor([rows[0]], device=device), use_cache=True, logits_to_keep=1)  # type: ignore[operator]
            out.past_key_values.batch_repeat_interleave(len(rows))
            logits = out.logits[:, -1].expand(len(rows), -1)
        else:
            parents = [self.previous[tuple(r[:-1])] for r in rows]
            if parents != list(range(len(self.previous))):
                self.cache.batch_select_indices(torch.tensor(parents, device=device))
            ids = torch.tensor([[r[-1]] for r in rows], device=device)
            out = self.model(ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)  # type: ignore[operator]
            logits = out.logits[:, -1]
        self.cache = out.past_key_values
        self.previous = {tuple(r): i for i, r in enumerate(rows)}
        return torch.log_softmax(logits.float(), dim=-1).cpu().numpy()


def reference_check(model: object, kept: list[tuple[list[int], np.ndarray]]) -> float:
    """Largest |difference| between kept rows and an uncached forward pass of each row alone."""
    device = next(model.parameters()).device  # type: ignore[attr-defined]
    worst = 0.0
    with torch.inference_mode():
        for row, got in kept:
            logits = model(torch.tensor([row], device=device)).logits[0, -1]  # type: ignore[operator]
            expected = torch.log_softmax(logits.float(), dim=-1).cpu().numpy()
            worst = max(worst, float(np.max(np.abs(got - expected))))
    return worst


def print_table(args: argparse.Namespace, results: dict, checks: dict) -> None:
    median = {key: statistics.median(r) for key, r in results.items()}
    print(
        f"\n### SMC: {args.steps} steps, {args.label}, {args.device}, {args.dtype}, "
        f"resample every {args.resample_every}, median of {args.repeats}\n"
    )
    print(
        "| particles | way | rows/s | min-max | vs engine | vs decode | vs genlm | max abs diff vs uncached |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (particles, mode), values in results.items():
        ratio = {
            m: f"{median[particles, mode] / median[particles, m]:.2f}x" if (particles, m) in median else "-"
            for m in ("engine", "decode", "genlm")
        }
        check = f"{checks[particles, mode]:.1e}" if (particles, mode) in checks else "-"
        print(
            f"| {particles} | {mode} | {median[particles, mode]:.1f} | {min(values):.1f}-{max(values):.1f} | "
            f"{ratio['engine']} | {ratio['decode']} | {ratio['genlm']} | {check} |"
        )


def plot(path: Path, args: argparse.Namespace, results: dict) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no plot")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({p for p, _ in results})
    modes = list(dict.fromkeys(m for _, m in results))
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        keys = [(p, mode) for p in counts if (p, mode) in results]
        xs = [counts.index(p) + (j - (len(modes) - 1) / 2) * width for p, _ in keys]
        medians = [statistics.median(results[k]) for k in keys]
        low = [m - min(results[k]) for m, k in zip(medians, keys, strict=True)]
        high = [max(results[k]) - m for m, k in zip(medians, keys, strict=True)]
        ax.bar(xs, medians, width, yerr=[low, high], capsize=3, label=mode, color=f"C{j}")
        for x, value in zip(xs, medians, strict=True):
            ax.annotate(f"{value:.0f}", (x, value), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(counts)), [f"P = {p}" for p in counts])
    ax.set_ylabel("rows/s (median, min-max)")
    ax.set_title(f"SMC, {args.steps} steps: {args.label}, {args.device} {args.dtype}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--particles", type=int, nargs="+", default=[16])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--resample-every", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a Hugging Face directory or a built-in name")
    parser.add_argument("--random-model", choices=list(SHAPES), help="random weights of this shape instead")
    parser.add_argument(
        "--tokenizer", type=Path, help="tokenizer directory of --random-model (default: SmolLM2's)"
    )
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=Path("smc.png"))
    parser.add_argument("--gateway-arg", action="append", default=[], help="extra `serve` flags")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--replot", type=Path, help="print and plot the results of an earlier --json")
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(args.replot.read_text())
        vars(args).update(saved["args"])
        results = {(p, m): v for p, m, v in saved["results"]}
        checks = {(p, m): v for p, m, v in saved["checks"]}
        print_table(args, results, checks)
        plot(args.plot, args, results)
        return
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run(args, Path(tmp)))


async def measure_gateway(
    mode: str, model_dir: Path, args: argparse.Namespace, tmp: Path, measure: Callable
) -> None:
    toml = tmp / f"{mode}.toml"
    toml.write_text(
        f'[[models]]\nname = "smc"\nmodel = "{model_dir}"\ndtype = "{args.dtype}"\ndevice = "{args.device}"\n'
        + ("[cache]\nenabled = false\n" if mode == "gateway-nocache" else "")
    )
    gateway = start_gateway(["--config", str(toml), *args.gateway_arg], tmp / f"{mode}.log")
    timings: dict[int, list[tuple[float, float]]] = {}  # rows per request -> (rows ms, encode ms)

    async def record(response) -> None:  # the gateway's Server-Timing header
        if "server-timing" not in response.headers:
            return
        parts = dict(part.strip().split(";dur=") for part in response.headers["server-timing"].split(","))
        rows = int(response.request.headers.get("x-bench-rows", 0))
        timings.setdefault(rows, []).append((float(parts["rows"]), float(parts["encode"])))

    try:
        clients = [AsyncGatewayLM(gateway.base_url, "smc") for _ in range(args.repeats + 1)]
        for client in clients:
            http = client._async_client()
            http.event_hooks["response"].append(record)
            http.event_hooks["request"].append(_count_rows)
        await measure(mode, lambda p, r: client_rows(clients[r]))
        for client in clients:
            await client.aclose()
    finally:
        gateway.stop()
    for rows, values in sorted(timings.items()):
        if rows in args.particles:
            compute, encode = (statistics.median(v) for v in zip(*values, strict=True))
            print(f"{mode} P={rows}: server median per step: rows {compute:.1f} ms, encode {encode:.1f} ms")


async def _count_rows(request) -> None:
    """Tags a dense request with its row count, for the Server-Timing summary."""
    if request.url.path.endswith("/next_token_logprobs"):
        import msgspec

        request.headers["x-bench-rows"] = str(len(msgspec.msgpack.decode(request.content)["input"]))


async def run(args: argparse.Namespace, tmp: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.random_model:
        model_dir = random_model_dir(args.random_model, dtype, tmp / "model", args.tokenizer)
        args.label = f"random {args.random_model}"
    else:
        model_dir = resolve_model_dir(args.model)
        args.label = args.model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    def prompt(p: int, r: int) -> list[int]:  # its own per run, so no cache carries over
        return tokenizer(f"{PROMPT} ({p}.{r})").input_ids

    results: dict[str, list[float]] = {}
    checks: dict[str, float] = {}

    async def measure(mode: str, make: Callable[[int, int], NextRows]) -> None:
        for p in args.particles:
            # A warm-up run; then each repeat has its own prompt, so nothing cached carries over.
            await smc(make(p, args.repeats), prompt(p, args.repeats), p, 2, 2, args.seed)
            for r in range(args.repeats):
                seconds, kept = await smc(
                    make(p, r), prompt(p, r), p, args.steps, args.resample_every, args.seed + 1000 * p + r
                )
                results.setdefault((p, mode), []).append(p * args.steps / seconds)
                if mode.startswith(("engine", "gateway")):
                    checks[p, mode] = max(checks.get((p, mode), 0.0), reference_check(model, kept))
            print(f"P={p} {mode}: {', '.join(f'{v:.1f}' for v in results[p, mode])} rows/s", flush=True)

    config = EngineConfig(model=str(model_dir), dtype=args.dtype, device=args.device)
    if "engine" in args.modes:
        engine = TransformersEngine.load(config)
        await measure("engine", lambda p, r: engine_rows(engine))
        stats = engine.prefix_cache.stats if engine.prefix_cache else None
        print(f"engine prefix cache: {stats}")
        await engine.aclose()
        del engine
    for mode in ("gateway", "gateway-nocache"):
        if mode in args.modes:
            await measure_gateway(mode, model_dir, args, tmp, measure)
    if "genlm" in args.modes:
        if importlib.util.find_spec("genlm.backend") is None:
            print("genlm-backend is not installed: no genlm row")
        else:
            from genlm.backend.llm import AsyncTransformer

            lm = AsyncTransformer(model, tokenizer, batch_size=max(args.particles))

            def fresh(p: int, r: int) -> NextRows:  # the prompt's K/V is cached before the clock starts
                lm.clear_cache()
                lm.cache_kv(prompt(p, r))
                return client_rows(lm)

            await measure("genlm", fresh)
    if "decode" in args.modes:
        await measure("decode", lambda p, r: PlainDecode(model))
    print_table(args, results, checks)
    if args.json:
        keep = ("steps", "label", "device", "dtype", "resample_every", "repeats", "particles")
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: getattr(args, k) for k in keep},
                    "results": [[p, m, v] for (p, m), v in results.items()],
                    "checks": [[p, m, v] for (p, m), v in checks.items()],
                }
            )
        )
    plot(args.plot, args, results)


if __name__ == "__main__":
    main()
