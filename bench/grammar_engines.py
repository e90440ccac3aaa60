"""xgrammar against llguidance on the default model's vocabulary (issue #42): compile and per-step costs.

    python -m bench.grammar_engines            # everything (a few minutes on 2 cores)
    python -m bench.grammar_engines --quick    # one compile repetition, fewer schemas
    python -m bench.grammar_engines --torch-threads 2   # torch's apply kernels on 2 threads

Needs `pip install xgrammar llguidance` (CPU wheels). For each library:
- compile: per grammar (bench/grammar_schemas.py: 20 JSON schemas, 3 regexes, an arithmetic grammar in
  each library's own syntax), the median of `--reps` compiles on a fresh compiler (cold), a second
  compile on the same compiler (cached, xgrammar only: llguidance has no compile cache), and the first
  mask fill of a fresh matcher (llguidance builds its lexer lazily, so part of its compile lands there);
- decode: B streams (1, then 64), each with a matcher on one JSON schema; per step the B bitmasks are
  filled with the library's batched call, applied to a float32 [B, vocab] CPU tensor with the
  library's torch helper, and one token per stream is accepted with the batched call. A stream takes
  its schema instance's next token when the mask allows it, otherwise the lowest allowed id that is
  not end-of-sequence, and restarts once its matcher terminates;
- checks: every grammar is decoded to termination; the text must validate (jsonschema with format
  checks, re.fullmatch, a Python expression for the arithmetic grammar) and equal the instance.
Prints Markdown tables; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    import xgrammar
except ImportError:
    sys.exit("this benchmark needs both grammar engines: pip install xgrammar llguidance")

import torch
from transformers import AutoTokenizer

from backends.builtin_models import resolve_model_dir
from bench.grammar_schemas import FEATURE_PROBES, FeatureProbe, Grammar, all_grammars

STEPS = 64


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self.batch = xgrammar.BatchGrammarMatcher()

    def new_compiler(self) -> Any:
        return xgrammar.GrammarCompiler(self.info)

    def compile(self, compiler: Any, grammar: Grammar) -> Any:
        if grammar.kind == "json":
            return compiler.compile_json_schema(grammar.source)
        if grammar.kind == "regex":
            return compiler.compile_regex(grammar.source)
        return compiler.compile_grammar(grammar.source[self.name])

    def matcher(self, compiled: Any) -> Any:
        return xgrammar.GrammarMatcher(compiled)

    def allocate(self, batch: int) -> torch.Tensor:
        return xgrammar.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def fill_one(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        xgrammar.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        return xgrammar.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def terminated(self, matcher: Any) -> bool:
        return matcher.is_terminated()

    def verdict(self, probe: FeatureProbe, eos: int) -> str:
        compiler = self.new_compiler()
        try:
            if probe.kind == "json":
                compiled = compiler.compile_json_schema(probe.source)
            else:
                compiled = compiler.compile_regex(probe.source)
        except Exception as error:  # the library raises RuntimeError or its own subclasses
            return f"error: {type(error).__name__}: {str(error).strip()}"
        matcher = xgrammar.GrammarMatcher(compiled)
        return "accepts" if matcher.accept_string(probe.text) and matcher.accept_token(eos) else "rejects"


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        self.executor = llguidance.LLExecutor()

    def new_compiler(self) -> None:
        return None

    def source_of(self, grammar: Grammar) -> str:
        if grammar.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(grammar.source)
        if grammar.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(grammar.source)
        return llguidance.LLMatcher.grammar_from_lark(grammar.source[self.name])

    def compile(self, compiler: None, grammar: Grammar) -> Any:
        matcher = llguidance.LLMatcher(self.tokenizer, self.source_of(grammar))
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def allocate(self, batch: int) -> torch.Tensor:
        return llguidance.torch.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        llguidance.torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def fill_one(self, matcher: Any, bitmask: torch.Tensor) -> None:
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        return llguidance.torch.consume_token_par(self.executor, list(zip(matchers, tokens, strict=True)))

    def terminated(self, matcher: Any) -> bool:
        return matcher.is_stopped()

    def verdict(self, probe: FeatureProbe, eos: int) -> str:
        if probe.kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(probe.source)
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(probe.source)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return f"error: {matcher.get_error().strip()}"
        tokens = self.tokenizer.tokenize_str(probe.text) + [eos]
        return "accepts" if matcher.consume_tokens(tokens) else "rejects"


Library = XGrammar | LLGuidance


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def measure_compile(library: Library, grammar: Grammar, reps: int) -> tuple[float, float | None, float]:
    """Median cold compile ms, cached compile ms (None without a cache), median first mask fill ms."""
    cold, first_mask = [], []
    cached = None
    bitmask = library.allocate(1)
    for _ in range(reps):
        compiler = library.new_compiler()
        start = time.perf_counter()
        compiled = library.compile(compiler, grammar)
        cold.append(time.perf_counter() - start)
        matcher = library.matcher(compiled)
        start = time.perf_counter()
        library.fill_one(matcher, bitmask)
        first_mask.append(time.perf_counter() - start)
        if compiler is not None:
            start = time.perf_counter()
            library.compile(compiler, grammar)
            cached = time.perf_counter() - start
    return median_ms(cold), None if cached is None else cached * 1e3, median_ms(first_mask)


@dataclass
class Stream:
    grammar: Grammar
    pristine: Any  # a compiled grammar (xgrammar) or an unused matcher (llguidance)
    target: list[int]
    matcher: Any = None
    taken: list[int] = field(default_factory=list)


@dataclass
class StepTimes:
    fill: list[float] = field(default_factory=list)
    apply: list[float] = field(default_factory=list)
    accept: list[float] = field(default_factory=list)


@dataclass
class Finished:
    grammar: Grammar
    text: str
    rejected: bool


def choose_token(stream: Stream, bitmask_row: torch.Tensor, masked_row: torch.Tensor, eos: int) -> int:
    position = len(stream.taken)
    wanted = stream.target[position] if position < len(stream.target) else eos
    if (int(bitmask_row[wanted >> 5]) >> (wanted & 31)) & 1:
        return wanted
    allowed = torch.isfinite(masked_row).nonzero().flatten().tolist()
    not_eos = [token for token in allowed if token != eos]
    return not_eos[0] if not_eos else eos


def simulate(
    library: Library, streams: list[Stream], steps: int | None, eos: int, decode: Callable[[list[int]], str]
) -> tuple[StepTimes, list[Finished]]:
    """Run `steps` decoding steps (or, with None, until every stream has finished once, capped)."""
    batch = len(streams)
    for stream in streams:
        stream.matcher, stream.taken = library.matcher(stream.pristine), []
    bitmask = library.allocate(batch)
    base_logits = torch.randn(batch, library.vocab_size, generator=torch.Generator().manual_seed(0))
    logits = torch.empty_like(base_logits)
    library.apply(logits.clone(), bitmask)  # warm-up: llguidance's helper is torch.compile'd on first use
    times, finished, done = StepTimes(), [], set()
    step = 0
    while (step < steps) if steps is not None else (len(done) < batch and step < 1000):
        step += 1
        logits.copy_(base_logits)
        matchers = [stream.matcher for stream in streams]
        start = time.perf_counter()
        library.fill(matchers, bitmask)
        times.fill.append(time.perf_counter() - start)
        start = time.perf_counter()
        library.apply(logits, bitmask)
        times.apply.append(time.perf_counter() - start)
        tokens = [choose_token(s, bitmask[i], logits[i], eos) for i, s in enumerate(streams)]
        start = time.perf_counter()
        accepted = library.accept(matchers, tokens)
        times.accept.append(time.perf_counter() - start)
        for index, (stream, token, ok) in enumerate(zip(streams, tokens, accepted, strict=True)):
            stream.taken.append(token)
            if ok and not library.terminated(stream.matcher):
                continue
            text = decode([t for t in stream.taken if t != eos])
            finished.append(Finished(stream.grammar, text, rejected=not ok))
            done.add(index)
            stream.matcher, stream.taken = library.matcher(stream.pristine), []
    return times, finished


def per_step_row(library: Library, batch: int, times: StepTimes) -> str:
    fill, apply, accept = (statistics.mean(t) * 1e3 for t in (times.fill, times.apply, times.accept))
    total = fill + apply + accept
    return (
        f"| {library.name} | {batch} | {fill:.3f} | {apply:.3f} | {accept:.3f} | {total:.3f} "
        f"| {total * 1e3 / batch:.1f} |"
    )


def apply_helper_rows(vocab_size: int, batch: int = 64, reps: int = 20) -> list[str]:
    """Each library's apply helper on one [batch, vocab] bitmask: both use the same packed int32 layout."""
    helpers = {
        "xgrammar.apply_token_bitmask_inplace (cpu)": xgrammar.apply_token_bitmask_inplace,
        "llguidance.torch.apply_token_bitmask_inplace": llguidance.torch.apply_token_bitmask_inplace,
    }
    base_logits = torch.randn(batch, vocab_size)
    logits = torch.empty_like(base_logits)
    rows = []
    for name, helper in helpers.items():
        cells = []
        for allowed_bits in (0, -1):  # only token 0 allowed (as inside a JSON key), everything allowed
            bitmask = xgrammar.allocate_token_bitmask(batch, vocab_size)
            bitmask.fill_(allowed_bits)
            bitmask[:, 0] |= 1
            samples = []
            for _ in range(reps + 1):
                logits.copy_(base_logits)
                start = time.perf_counter()
                helper(logits, bitmask)
                samples.append(time.perf_counter() - start)
            cells.append(f"{median_ms(samples[1:]):.3f}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def check_lines(library: Library, grammars: list[Grammar], finished: list[Finished]) -> list[str]:
    lines = []
    first = {}
    for item in finished:
        first.setdefault(item.grammar.name, item)
    for grammar in grammars:
        item = first.get(grammar.name)
        if item is None:
            lines.append(f"FAIL {library.name} {grammar.name}: never terminated")
            continue
        valid = not item.rejected and grammar.is_valid(item.text)
        verdict = "ok  " if valid else "FAIL"
        note = "" if item.text == grammar.instance_text else " (diverged from the instance)"
        lines.append(f"{verdict} {library.name} {grammar.name}: {item.text!r}{note}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one compile repetition, every 4th schema")
    parser.add_argument("--reps", type=int, default=3, help="cold compiles per grammar (median)")
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared box)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    reps = 1 if args.quick else args.reps

    model_dir = resolve_model_dir("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    eos = tokenizer.eos_token_id
    grammars = all_grammars()
    json_grammars = [g for g in grammars if g.kind == "json"]
    if args.quick:
        json_grammars = json_grammars[::4]
        grammars = json_grammars + [g for g in grammars if g.kind != "json"]

    versions = {name: importlib.metadata.version(name) for name in ("xgrammar", "llguidance", "torch")}
    print(f"# Grammar engines on smollm2-135m (vocab {vocab_size}, torch threads {torch.get_num_threads()})")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + "\n")

    libraries: list[Library] = [XGrammar(tokenizer, vocab_size), LLGuidance(tokenizer, vocab_size)]
    compile_rows: dict[str, dict[str, tuple[float, float | None, float]]] = {}
    step_rows, checks = [], []
    for library in libraries:
        for grammar in grammars:
            compile_rows.setdefault(grammar.name, {})[library.name] = measure_compile(library, grammar, reps)
        compiler = library.new_compiler()

        def stream_for(grammar: Grammar, library: Library = library, compiler: Any = compiler) -> Stream:
            target = tokenizer.encode(grammar.instance_text, add_special_tokens=False)
            return Stream(grammar, library.compile(compiler, grammar), target)

        _, finished = simulate(library, [stream_for(g) for g in grammars], None, eos, tokenizer.decode)
        checks += check_lines(library, grammars, finished)
        single = StepTimes()
        for grammar in json_grammars:
            times, _ = simulate(library, [stream_for(grammar)], STEPS, eos, tokenizer.decode)
            for name in ("fill", "apply", "accept"):
                getattr(single, name).extend(getattr(times, name))
        step_rows.append(per_step_row(library, 1, single))
        streams = [stream_for(json_grammars[i % len(json_grammars)]) for i in range(64)]
        times, _ = simulate(library, streams, STEPS, eos, tokenizer.decode)
        step_rows.append(per_step_row(library, 64, times))

    print(f"## Compile, ms (cold: median of {reps} on a fresh compiler; cached: second compile)\n")
    print(
        "| grammar | xgrammar cold | xgrammar cached | xgrammar 1st mask | llguidance cold | llguidance 1st mask |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, by_library in compile_rows.items():
        x_cold, x_cached, x_mask = by_library["xgrammar"]
        l_cold, _, l_mask = by_library["llguidance"]
        print(f"| {name} | {x_cold:.1f} | {x_cached:.3f} | {x_mask:.2f} | {l_cold:.1f} | {l_mask:.2f} |")
    print(
        f"\n## Decode, mean per step over {STEPS} steps (B=1: each JSON schema in turn; B=64: schemas cycled)\n"
    )
    print("| library | B | fill ms | apply ms | accept ms | total ms | µs per stream-step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(step_rows))
    print("\n## Apply helpers alone, ms, B=64 (median of 20)\n")
    print("| helper | 1 token allowed | all allowed |")
    print("|---|---:|---:|")
    print("\n".join(apply_helper_rows(vocab_size)))
    print("\n## Features: compiles? accepts the text? (valid: what jsonschema / re say)\n")
    print("| probe | valid | xgrammar | llguidance |")
    print("|---|---|---|---|")
    for probe in FEATURE_PROBES:
        cells = [" / ".join(library.verdict(probe, eos).splitlines()) for library in libraries]
        print(f"| {probe.label} | {'yes' if probe.valid else 'no'} | " + " | ".join(cells) + " |")
    print("\n## Checks (first completion of every grammar)\n")
    print("\n".join(checks))
    failures = [line for line in checks if line.startswith("FAIL")]
    if failures:
        print(f"\n!!! {len(failures)} CHECK(S) FAILED !!!")
        return 1
    print(f"\nall {len(checks)} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
