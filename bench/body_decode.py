"""How long decoding a request body holds the GIL (and so the event loop), by the body's shape.

    python -m bench.body_decode               # bodies of 64 MiB (max_body_bytes' default)
    python -m bench.body_decode --mib 16
    python -m bench.body_decode --served      # through a mock gateway: /health and RSS meanwhile

msgspec decodes with the GIL held, so a worker thread would not free the event loop meanwhile.
Prints a Markdown table: the body's shape, the wire type it decodes to, and the time taken. With
`--served`: three dense bodies of 64 MiB at once, refused at their first or their last field, sent
to a mock gateway that decodes on its loop (`decode_worker_bytes = 0`) or in its worker processes
(the default); the slowest /health meanwhile, and the peak RSS of the gateway and its workers.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import httpx
import msgspec

from gateway.schemas.completions import CompletionRequest
from gateway.schemas.logprobs import DetokenizeRequest, NextTokenLogprobsRequest, TokenizeRequest


def bodies(size: int) -> list[tuple[str, type, bytes]]:
    fill = size - 40
    row = b"[" + b",".join([b"1"] * 30) + b"]"
    return [
        ("one ASCII string", TokenizeRequest, b'{"model":"m","prompt":"' + b"a" * fill + b'"}'),
        (
            "one string of \\u escapes",
            TokenizeRequest,
            b'{"model":"m","prompt":"' + b"\\u00e9" * (fill // 6) + b'"}',
        ),
        (
            "token ids (5 digits)",
            DetokenizeRequest,
            b'{"model":"m","tokens":[' + b",".join([b"49151"] * (fill // 6)) + b"]}",
        ),
        (
            "short strings",
            CompletionRequest,
            b'{"model":"m","prompt":[' + b",".join([b'"ab"'] * (fill // 5)) + b"]}",
        ),
        (
            "rows of 30 one-digit ids",
            NextTokenLogprobsRequest,
            b'{"model":"m","input":[' + b",".join([row] * (fill // (len(row) + 1))) + b"]}",
        ),
    ]


def _rss_kib(pid: int) -> int:
    """The resident memory of `pid` and its children (the decode workers), in KiB."""
    total = 0
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for each in [pid, *map(int, children.read_text().split())]:
        for line in Path(f"/proc/{each}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total


def served(worker_bytes: int | None) -> tuple[float, float, float]:
    """Three bad 64 MiB dense bodies at once, twice (wrong first field, wrong last field): the
    slowest /health of each round, and the peak RSS increase (MiB) over both."""
    from bench.launcher import start_mock_gateway

    settings = "" if worker_bytes is None else f"[limits]\ndecode_worker_bytes = {worker_bytes}\n"
    rows = b"[" + b",".join([b"[1,2,3,4,5,6,7,8,9,1,2,3,4,5,6,7]"] * 1_900_000) + b"]"
    first = b'{"model": 5, "input": ' + rows + b"}"
    last = b'{"input": ' + rows + b', "model": 5}'
    with tempfile.TemporaryDirectory() as workdir:
        gateway = start_mock_gateway(Path(workdir), settings, slow_delay_s=0.1)
        try:
            base = _rss_kib(gateway.process.pid)
            peak, slowest = base, []
            for body in (first, last):
                senders = [
                    threading.Thread(
                        target=httpx.post,
                        args=(gateway.base_url + "/v1/next_token_logprobs",),
                        kwargs={
                            "content": body,
                            "headers": {"content-type": "application/json"},
                            "timeout": 120,
                        },
                    )
                    for _ in range(3)
                ]
                for sender in senders:
                    sender.start()
                worst = 0.0
                with httpx.Client(base_url=gateway.base_url, timeout=60) as client:
                    while any(sender.is_alive() for sender in senders):
                        started = time.perf_counter()
                        client.get("/health")
                        worst = max(worst, time.perf_counter() - started)
                        peak = max(peak, _rss_kib(gateway.process.pid))
                        time.sleep(0.02)
                slowest.append(worst)
        finally:
            gateway.stop()
    return slowest[0], slowest[1], (peak - base) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--served", action="store_true")
    args = parser.parse_args()
    if args.served:
        print(
            "| decoded | /health, first field wrong (s) | /health, last field wrong (s) | peak RSS + (MiB) |"
        )
        print("|---|---:|---:|---:|")
        for name, worker_bytes in (("on the loop", 0), ("in workers", None)):
            first, last, rss = served(worker_bytes)
            print(f"| {name} | {first:.2f} | {last:.2f} | {rss:.0f} |")
        return
    print("| body | decodes to | MiB | decode (s) |\n|---|---|---:|---:|")
    for name, body_type, body in bodies(args.mib * 2**20):
        started = time.perf_counter()
        msgspec.json.decode(body, type=body_type)
        elapsed = time.perf_counter() - started
        print(f"| {name} | {body_type.__name__} | {len(body) / 2**20:.0f} | {elapsed:.2f} |")


if __name__ == "__main__":
    main()
