"""bench/generation.py's rows: one per target, stream count, constraint and logprobs setting, the
turns of a target merged into one, and the Markdown table of them."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Row:
    target: str
    constraint: str
    logprobs: int | None  # what each request asked for (None: no logprobs)
    streams: int
    rate: float  # median aggregate tokens/s (over turns: the median of each turn's)
    tokens_per_stream: float  # mean completion tokens
    latency_p50: float
    latency_p95: float
    equal: int  # streams whose text equals the request's alone
    compared: int
    worst_diff: float  # largest |token logprob difference| of the equal ones
    valid: int  # constrained outputs that match their grammar
    constrained: int
    turn_rates: list[float] = field(default_factory=list)  # each turn's rate, in the order run

    @property
    def key(self) -> tuple[str, str, int | None, int]:
        return self.target, self.constraint, self.logprobs, self.streams


def merged(turns: Sequence[Sequence[Row]]) -> list[Row]:
    """One row per target and setting from the rows of every turn: the median of the turns' rates
    and latencies, the counts summed, the worst difference kept."""
    groups: dict[tuple[str, str, int | None, int], list[Row]] = {}
    for rows in turns:
        for row in rows:
            groups.setdefault(row.key, []).append(row)
    out = []
    for (target, constraint, logprobs, streams), rows in groups.items():
        out.append(
            Row(
                target,
                constraint,
                logprobs,
                streams,
                statistics.median(r.rate for r in rows),
                statistics.mean(r.tokens_per_stream for r in rows),
                statistics.median(r.latency_p50 for r in rows),
                statistics.median(r.latency_p95 for r in rows),
                sum(r.equal for r in rows),
                sum(r.compared for r in rows),
                max(r.worst_diff for r in rows),
                sum(r.valid for r in rows),
                sum(r.constrained for r in rows),
                [r.rate for r in rows],
            )
        )
    return out


def print_table(
    rows: list[Row],
    reference: str,
    max_tokens: int,
    repeats: int,
    turns: int,
    constraints: Sequence[str],
    sent: str = "",
) -> None:
    """Unconstrained only: the table of old. With constraints: their columns, each stream count's
    rows together. Over several turns: each turn's rate too. `sent`: how the requests went, for
    the title (nothing: one client process, /v1/completions)."""
    constrained = any(row.constraint != "none" for row in rows)
    settings = list(dict.fromkeys(row.logprobs for row in rows))
    base = {(r.streams, r.constraint, r.logprobs): r.rate for r in rows if r.target == reference}
    free = {(r.target, r.streams, r.logprobs): r.rate for r in rows if r.constraint == "none"}
    heads = ["target", "streams", "aggregate tok/s", f"vs {reference}"]
    if turns > 1:
        heads += ["tok/s by turn"]
    if constrained:
        heads[1:1] = ["constraint"]
        heads += ["vs none", "tokens per stream"]
    if settings != [1]:
        heads[1:1] = ["logprobs"]
    heads += ["latency p50 s", "latency p95 s", "texts equal alone", "max logprob diff"]
    heads += ["outputs valid"] if constrained else []
    title = f"Concurrent greedy completions of {max_tokens} tokens{sent}, median of {repeats}"
    if turns > 1:
        title += f" in each of {turns} turns (targets in turn order, then reversed), median of the turns"
    print(f"### {title}{', with and without a grammar' if constrained else ''}\n")
    print("| " + " | ".join(heads) + " |")
    print("| " + " | ".join("---" if head in ("target", "constraint") else "---:" for head in heads) + " |")
    targets = {name: i for i, name in enumerate(dict.fromkeys(row.target for row in rows))}
    kinds = {name: i for i, name in enumerate(constraints)}
    order = {setting: i for i, setting in enumerate(settings)}
    for row in sorted(
        rows, key=lambda r: (order[r.logprobs], r.streams, targets[r.target], kinds[r.constraint])
    ):
        cells = [
            row.target,
            str(row.streams),
            f"{row.rate:.1f}",
            ratio(row.rate, base.get((row.streams, row.constraint, row.logprobs))),
        ]
        if turns > 1:
            cells += [" / ".join(f"{rate:.0f}" for rate in row.turn_rates)]
        if constrained:
            cells[1:1] = [row.constraint]
            free_rate = free.get((row.target, row.streams, row.logprobs))
            cells += [ratio(row.rate, free_rate), f"{row.tokens_per_stream:.1f}"]
        if settings != [1]:
            cells[1:1] = [str(row.logprobs) if row.logprobs is not None else "none"]
        cells += [f"{row.latency_p50:.2f}", f"{row.latency_p95:.2f}", f"{row.equal}/{row.compared}"]
        cells += [f"{row.worst_diff:.1e}" if row.logprobs is not None else "-"]
        cells += [f"{row.valid}/{row.constrained}" if row.constrained else "-"] if constrained else []
        print("| " + " | ".join(cells) + " |")


def ratio(rate: float, base: float | None) -> str:
    return f"{rate / base:.2f}x" if base else "-"
