"""Where the gateway's and the client's own time goes within a dense call over the local socket,
stage by stage.

    python -m bench.server_stages --mock-vocab 16384 --particles 16 64
    python -m bench.server_stages --random-model llama-1b --tokenizer DIR --device cuda --dtype bfloat16 --particles 16 64

Runs bench/step_parts.py with these arguments, its gateways stamping the time at each stage of
every call (bench/stages/server.py, the gateway's command line with its functions wrapped), then
prints, per number of rows, the median µs from each stage to the next, in wall-clock time and in
the event loop thread's own CPU time, over the second half of that many rows' calls (after the
output cache filled). The stages, in a call's
order: the frame read, the request's task running, the body decoded, the model resolved, token
checks, the answer's bytes reserved, the client's segment found, the cache's keys and lookup, the
engine calls (the gateway's split over max_batch_rows), the engine call, the rows landing in the client's memory, and the answer back through
each layer to the socket's write. Then the same for the client (`AsyncGatewayLM` in the bench,
its calls over the local socket): the call, its keys and the request, the segment's lease, the
exchange over the socket, the answer's matrix, its rows filed in the client's row cache, the
tensor, the return (bench/stages/client.py, wrapped in this process).
"""

from __future__ import annotations

import asyncio
import collections
import os
import statistics
import tempfile
from pathlib import Path

import torch

from bench import step_parts
from bench.stages import client, stamps

SERVER, CLIENT = ("frame in", "sent"), ("call", "returned")  # each side's first and last stage


def calls(path: Path) -> tuple[tuple[str, str], list[dict[str, tuple[float, float]]]]:
    """Which side stamped `path`, and each call's first (wall clock, the loop thread's CPU time)
    at each stage, and its rows (`rows`). The client's calls over HTTP are left out."""
    lines = [line.split("\t") for line in path.read_text().splitlines()]
    side = SERVER if any(name == SERVER[0] for name, _, _ in lines) else CLIENT
    out: list[dict[str, tuple[float, float]]] = []
    for name, stamp, cpu in lines:
        if name == SERVER[0] or (side is CLIENT and name.startswith("rows=")):
            out.append({})
        if not out:
            continue
        if name.startswith("rows="):
            out[-1]["rows"] = (float(name[5:]), 0.0)
        else:
            out[-1].setdefault(name, (float(stamp), float(cpu)))
    if side is CLIENT:
        out = [c for c in out if "socket call" in c]
    return side, [c for c in out if side[1] in c and "rows" in c]


def table(side: tuple[str, str], found: list[dict[str, tuple[float, float]]]) -> None:
    start, end = side
    by_rows: dict[int, list[dict[str, tuple[float, float]]]] = collections.defaultdict(list)
    for call in found:
        by_rows[int(call["rows"][0])].append(call)
    for rows, group in sorted(by_rows.items()):
        steady = group[len(group) // 2 :]
        order = sorted((k for k in steady[-1] if k != "rows"), key=lambda k: steady[-1][k][0])
        who = "server" if side is SERVER else "client"
        print(f"\n### {rows} rows, the {who}: median µs from each stage to the next ({len(steady)} calls)\n")
        print("| from | to | µs | the loop thread's CPU µs |\n| --- | --- | ---: | ---: |")

        def gap(first: str, then: str, clock: int, calls: list = steady) -> float:
            return 1e6 * statistics.median(
                c[then][clock] - c[first][clock] for c in calls if first in c and then in c
            )

        for first, then in zip(order, order[1:], strict=False):
            print(f"| {first} | {then} | {gap(first, then, 0):.1f} | {gap(first, then, 1):.1f} |")
        print(f"| {start} | {end} | {gap(start, end, 0):.1f} | {gap(start, end, 1):.1f} |")
        if side is CLIENT:
            own = [gap(start, end, clock) - gap("socket call", "socket answered", clock) for clock in (0, 1)]
            print(
                f"\nthe client's own part (the call less its exchange over the socket): {own[0]:.0f} µs, of "
                f"which its thread ran {own[1]:.0f} µs"
            )
            continue
        device = [
            gap("engine", "engine done", clock)
            + (gap("landing", "landed", clock) if "landing" in order else 0.0)
            for clock in (0, 1)
        ]
        own = [gap("frame in", "sent", clock) - device[clock] for clock in (0, 1)]
        print(
            "\nthe server's own part (frame to write, less the engine call and the rows' landing): "
            f"{own[0]:.0f} µs, "
            f"of which the loop thread ran {own[1]:.0f} µs (the rest it waited: the interpreter lock, "
            "other threads, the scheduler)"
        )


def main() -> None:
    args = step_parts.arguments(__doc__)
    args.gateway_module = "bench.stages.server"
    client.install()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["STAGE_OUT"] = f"{tmp}/stages-"  # where the gateways it starts write their stamps
        step_parts.report(args, asyncio.run(step_parts.run(args, Path(tmp))))
        stamps.dump(client.FIRST, f"{tmp}/stages-client")
        for path in sorted(Path(tmp).glob("stages-*")):
            table(*calls(path))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
