"""Where the gateway's own time goes within a dense call over the local socket, stage by stage.

    python bench/server_stages.py --mock-vocab 16384 --particles 16 64
    python bench/server_stages.py --random-model llama-1b --tokenizer DIR --device cuda --dtype bfloat16 --particles 16 64

Runs bench/step_parts.py with these arguments, its gateways stamping the time at each stage of
every call (bench/stages/sitecustomize.py), then prints, per number of rows, the median µs from
each stage to the next, in wall-clock time and in the event loop thread's own CPU time, over the
second half of that many rows' calls (after the output cache filled). The stages, in a call's
order: the frame read, the request's task running, the body decoded, the model resolved, token
checks, the answer's bytes reserved, the client's segment found, the cache's keys and lookup, the
batcher, the engine call, the rows landing in the client's memory, and the answer back through
each layer to the socket's write.
"""

from __future__ import annotations

import collections
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def calls(path: Path) -> list[dict[str, tuple[float, float]]]:
    """Each call's first (wall clock, the loop thread's CPU time) at each stage, and its rows
    (`rows`)."""
    out: list[dict[str, tuple[float, float]]] = []
    for line in path.read_text().splitlines():
        name, stamp, cpu = line.split("\t")
        if name == "frame in":
            out.append({})
        if not out:
            continue
        if name.startswith("rows="):
            out[-1]["rows"] = (float(name[5:]), 0.0)
        else:
            out[-1].setdefault(name, (float(stamp), float(cpu)))
    return [c for c in out if "sent" in c and "rows" in c]


def table(found: list[dict[str, tuple[float, float]]]) -> None:
    by_rows: dict[int, list[dict[str, tuple[float, float]]]] = collections.defaultdict(list)
    for call in found:
        by_rows[int(call["rows"][0])].append(call)
    for rows, group in sorted(by_rows.items()):
        steady = group[len(group) // 2 :]
        order = sorted((k for k in steady[-1] if k != "rows"), key=lambda k: steady[-1][k][0])
        print(f"\n### {rows} rows: median µs from each stage to the next ({len(steady)} calls)\n")
        print("| from | to | µs | the loop thread's CPU µs |\n| --- | --- | ---: | ---: |")

        def gap(first: str, then: str, clock: int, calls: list = steady) -> float:
            return 1e6 * statistics.median(
                c[then][clock] - c[first][clock] for c in calls if first in c and then in c
            )

        for first, then in zip(order, order[1:], strict=False):
            print(f"| {first} | {then} | {gap(first, then, 0):.1f} | {gap(first, then, 1):.1f} |")
        print(f"| frame in | sent | {gap('frame in', 'sent', 0):.1f} | {gap('frame in', 'sent', 1):.1f} |")
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
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, STAGE_OUT=f"{tmp}/stages-")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "stages"), env.get("PYTHONPATH")]))
        subprocess.run([sys.executable, str(HERE / "step_parts.py"), *sys.argv[1:]], env=env, check=True)
        for path in sorted(Path(tmp).glob("stages-*")):
            table(calls(path))


if __name__ == "__main__":
    main()
