"""Where the gateway's own time goes within a dense call over the local socket, stage by stage.

    python bench/server_stages.py --mock-vocab 16384 --particles 16 64
    python bench/server_stages.py --random-model llama-1b --tokenizer DIR --device cuda --dtype bfloat16 --particles 16 64

Runs bench/step_parts.py with these arguments, its gateways stamping the time at each stage of
every call (bench/stages/sitecustomize.py), then prints, per number of rows, the median µs from
each stage to the next over the second half of that many rows' calls (after the output cache
filled). The stages, in a call's order: the frame read, the request's task running, the body
decoded, the model resolved, token checks, the answer's bytes reserved, the client's segment
found, the cache's keys and lookup, the batcher (queue and merge), the engine call, and the
answer back through each layer to the socket's write.
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


def calls(path: Path) -> list[dict[str, float]]:
    """Each call's first time at each stage, and its rows (`rows`)."""
    out: list[dict[str, float]] = []
    for line in path.read_text().splitlines():
        name, _, stamp = line.partition("\t")
        if name == "frame in":
            out.append({})
        if not out:
            continue
        if name.startswith("rows="):
            out[-1]["rows"] = float(name[5:])
        else:
            out[-1].setdefault(name, float(stamp))
    return [c for c in out if "sent" in c and "rows" in c]


def table(found: list[dict[str, float]]) -> None:
    by_rows: dict[int, list[dict[str, float]]] = collections.defaultdict(list)
    for call in found:
        by_rows[int(call["rows"])].append(call)
    for rows, group in sorted(by_rows.items()):
        steady = group[len(group) // 2 :]
        order = sorted((k for k in steady[-1] if k != "rows"), key=lambda k: steady[-1][k])
        print(f"\n### {rows} rows: median µs from each stage to the next ({len(steady)} calls)\n")
        print("| from | to | µs |\n| --- | --- | ---: |")
        for first, then in zip(order, order[1:], strict=False):
            gaps = [c[then] - c[first] for c in steady if first in c and then in c]
            print(f"| {first} | {then} | {1e6 * statistics.median(gaps):.1f} |")
        total = [c["sent"] - c["frame in"] for c in steady]
        engine = [c["engine done"] - c["engine"] for c in steady if "engine" in c]
        print(f"| frame in | sent | {1e6 * statistics.median(total):.1f} |")
        print(
            f"\nthe server's own part (frame to write, less the engine call): "
            f"{1e6 * (statistics.median(total) - statistics.median(engine)):.0f} µs"
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
