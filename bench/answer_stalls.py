"""How long `/health` waits while one dense answer of the most rows a request may ask is made and
sent, by its encoding, on the real default model.

    python -m bench.answer_stalls                 # 1,024 rows (limits.max_rows), 3 rounds
    python -m bench.answer_stalls --rows 256 --rounds 1

Each round asks rows no earlier round asked (no cache hits), reads the whole answer, and polls
`/health` from another process meanwhile (a thread of this one would wait on this process's GIL
while it reads a gigabyte of JSON). Prints a Markdown table: the encoding, the answer's size, the
time to read it, and the slowest and median `/health` of every round.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import httpx

ENCODINGS = {
    "JSON rows of floats": ({}, {}),
    "JSON matrix of floats": ({"layout": "matrix"}, {}),
    "JSON rows, base64": ({"encoding_format": "base64"}, {}),
    "MessagePack matrix": ({"layout": "matrix"}, {"Accept": "application/msgpack"}),
}


def _poll(base_url: str, stop: multiprocessing.synchronize.Event, out: multiprocessing.Queue) -> None:
    found = []
    with httpx.Client(base_url=base_url, timeout=60) as client:
        while not stop.is_set():
            started = time.monotonic()
            client.get("/health")
            found.append((started, time.monotonic()))
            time.sleep(0.005)
    out.put(found)


def _read(base_url: str, body: dict, headers: dict) -> int:
    size = 0
    with httpx.Client(timeout=600) as client:
        with client.stream(
            "POST", base_url + "/v1/next_token_logprobs", json=body, headers=headers
        ) as answer:
            answer.raise_for_status()
            for chunk in answer.iter_raw():
                size += len(chunk)
    return size


def main() -> None:
    from bench.launcher import start_gateway
    from gateway.settings import Limits

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=Limits().max_rows)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as workdir:
        config = Path(workdir) / "gateway.toml"
        config.write_text('[[models]]\nname = "m"\nmodel = "smollm2-135m"\ndtype = "float32"\n')
        gateway = start_gateway(["--config", str(config)], Path(workdir) / "gateway.log")
        print("| answer | MB | read (s) | /health max (ms) | /health p50 (ms) |\n|---|---:|---:|---:|---:|")
        first = 10
        try:
            for name, (fields, headers) in ENCODINGS.items():
                latencies, size, spent = [], 0, 0.0
                for _ in range(args.rounds):
                    rows = [[first, 1 + i % 1000, 2 + i // 1000] for i in range(args.rows)]
                    first += 1
                    stop, out = context.Event(), context.Queue()
                    poller = context.Process(target=_poll, args=(gateway.base_url, stop, out))
                    poller.start()
                    time.sleep(1.0)
                    began = time.monotonic()
                    size = _read(gateway.base_url, {"model": "m", "input": rows, **fields}, headers)
                    ended = time.monotonic()
                    spent += ended - began
                    time.sleep(0.05)
                    stop.set()
                    polls = out.get(timeout=60)
                    poller.join()
                    latencies += [end - start for start, end in polls if start < ended and end > began]
                print(
                    f"| {name} | {size / 1e6:.0f} | {spent / args.rounds:.1f} | "
                    f"{max(latencies) * 1e3:.0f} | {statistics.median(latencies) * 1e3:.1f} |"
                )
        finally:
            gateway.stop()


if __name__ == "__main__":
    main()
