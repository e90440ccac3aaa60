"""How long decoding a request body holds the GIL (and so the event loop), by the body's shape.

    python bench/body_decode.py               # bodies of 64 MiB (max_body_bytes' default)
    python bench/body_decode.py --mib 16

msgspec decodes with the GIL held, so a worker thread would not free the event loop meanwhile.
Prints a Markdown table: the body's shape, the wire type it decodes to, and the time taken.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.schemas.completions import CompletionRequest  # noqa: E402
from gateway.schemas.logprobs import DetokenizeRequest, NextTokenLogprobsRequest, TokenizeRequest  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    print("| body | decodes to | MiB | decode (s) |\n|---|---|---:|---:|")
    for name, body_type, body in bodies(args.mib * 2**20):
        started = time.perf_counter()
        msgspec.json.decode(body, type=body_type)
        elapsed = time.perf_counter() - started
        print(f"| {name} | {body_type.__name__} | {len(body) / 2**20:.0f} | {elapsed:.2f} |")


if __name__ == "__main__":
    main()
