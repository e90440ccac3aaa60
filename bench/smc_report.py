"""Tables, plot and JSON of bench/smc.py's results.

A report: results[(P, way)] = rows/s of each repeat (the whole loop, sampling included);
calls[(P, way)] = ms per step spent in the next-token call; server[(P, way)] = the gateway's
median (rows, encode) ms per step from Server-Timing; "caller ms/step" is the rest of each step
(sampling, resampling: the caller's own work, the same for every way); checks[(P, way)] = the largest difference
from an uncached forward pass. "vs engine" (and gateway, decode, genlm) is the median over repeats of
each run's ratio to that way's run of the same repeat: the ways take turns within a repeat.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from pathlib import Path

_ARGS = ("steps", "label", "device", "dtype", "resample_every", "repeats", "particles")
_KEYED = ("results", "calls", "checks", "server")


def save_report(path: Path, args: argparse.Namespace, report: dict) -> None:
    document = {"args": {k: getattr(args, k) for k in _ARGS}}
    for name in _KEYED:
        document[name] = [[p, m, v] for (p, m), v in report[name].items()]
    path.write_text(json.dumps(document))


def load_report(path: Path, args: argparse.Namespace) -> dict:
    saved = json.loads(path.read_text())
    vars(args).update(saved["args"])
    return {name: {(p, m): v for p, m, v in saved.get(name, [])} for name in _KEYED}


def print_tables(args: argparse.Namespace, report: dict) -> None:
    results, calls, checks, server = (report[name] for name in _KEYED)
    median = {key: statistics.median(r) for key, r in results.items()}
    print(
        f"\n### SMC: {args.steps} steps, {args.label}, {args.device}, {args.dtype}, "
        f"resample every {args.resample_every}, median of {args.repeats}\n"
    )
    print(
        "| particles | way | rows/s | min-max | vs engine | vs gateway | vs decode | vs genlm "
        "| call ms/step | caller ms/step | server rows + encode ms | max abs diff vs uncached |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (particles, mode), values in sorted(results.items(), key=lambda item: item[0][0]):
        ratio = {m: _paired(results, particles, mode, m) for m in ("engine", "gateway", "decode", "genlm")}
        call = caller = "-"
        if (particles, mode) in calls:
            per_step = calls[particles, mode]
            call = f"{statistics.median(per_step):.1f}"
            rest = [particles / rate * 1e3 - ms for rate, ms in zip(values, per_step, strict=True)]
            caller = f"{statistics.median(rest):.1f}"
        timing = server.get((particles, mode))
        on_server = f"{timing[0]:.1f} + {timing[1]:.1f}" if timing else "-"
        check = f"{checks[particles, mode]:.1e}" if (particles, mode) in checks else "-"
        print(
            f"| {particles} | {mode} | {median[particles, mode]:.1f} | {min(values):.1f}-{max(values):.1f} | "
            f"{ratio['engine']} | {ratio['gateway']} | {ratio['decode']} | {ratio['genlm']} | {call} | "
            f"{caller} | {on_server} | {check} |"
        )


def _paired(results: dict, particles: int, mode: str, base: str) -> str:
    if (particles, base) not in results:
        return "-"
    runs, base_runs = results[particles, mode], results[particles, base]
    if len(runs) != len(base_runs):
        return f"{statistics.median(runs) / statistics.median(base_runs):.2f}x"
    return f"{statistics.median(a / b for a, b in zip(runs, base_runs, strict=True)):.2f}x"


def plot(path: Path, args: argparse.Namespace, results: dict) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no plot")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({p for p, _ in results})
    modes = list(dict.fromkeys(m for _, m in results))
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
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
