"""Throughput of POST /v1/next_token_logprobs per encoding: requests/s, rows/s, MB/s, bytes/row.

    python bench/dense.py                       # mock engine (vocab 131072) and SmolLM2-135M
    python bench/dense.py --engines mock --rows 16 --requests 100 --concurrency 4

Starts the gateway as a child process on loopback, warms it up, then sends `--requests` requests of
`--rows` rows each from `--concurrency` concurrent clients, for each encoding. Prints a Markdown
table. The mock engine shows what the HTTP layer and the encodings cost; the real model adds the
forward pass.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.launcher import start_gateway  # noqa: E402

ENCODINGS = [  # (label, encoding_format, dtype, msgpack)
    ("json float", "float", "float32", False),
    ("json base64 f32", "base64", "float32", False),
    ("json base64 bf16", "base64", "bfloat16", False),
    ("msgpack f32", "float", "float32", True),
    ("msgpack f16", "float", "float16", True),
    ("msgpack bf16", "float", "bfloat16", True),
]


def engine_args(engine: str, workdir: Path) -> tuple[list[str], str]:
    if engine == "mock":
        config = workdir / "mock.toml"
        config.write_text(
            '[[models]]\nname = "mock"\nmodel = "smollm2-135m"\nbackend = "mock"\noptions = {vocab_size = 131072}\n'
        )
        return ["--config", str(config)], "mock"
    return ["--model", "smollm2-135m", "--dtype", "float32"], "smollm2-135m"


async def run_encoding(
    base_url: str, model: str, encoding: tuple, rows: int, requests: int, concurrency: int, seed: int
) -> dict:
    label, encoding_format, dtype, binary = encoding
    rng = np.random.default_rng(seed)
    headers = {"Accept": "application/msgpack", "Content-Type": "application/msgpack"} if binary else {}

    def body(i: int) -> bytes:
        # distinct short prefixes, so every row is computed (no de-duplication)
        batch = [[int(t) for t in rng.integers(100, 40000, size=8)] for _ in range(rows)]
        doc = {"model": model, "input": batch, "encoding_format": encoding_format, "dtype": dtype}
        return msgspec.msgpack.encode(doc) if binary else msgspec.json.encode(doc)

    bodies = [body(i) for i in range(requests + concurrency)]
    sizes: list[int] = []
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=300) as client:

        async def worker(items: list[bytes], record: bool) -> None:
            for content in items:
                response = await client.post("/v1/next_token_logprobs", content=content)
                response.raise_for_status()
                if record:
                    sizes.append(len(response.content))

        await asyncio.gather(*(worker([bodies[requests + c]], False) for c in range(concurrency)))  # warm-up
        started = time.perf_counter()
        await asyncio.gather(*(worker(bodies[c:requests:concurrency], True) for c in range(concurrency)))
        elapsed = time.perf_counter() - started
    total = sum(sizes)
    return {
        "encoding": label,
        "req/s": requests / elapsed,
        "rows/s": requests * rows / elapsed,
        "MB/s": total / elapsed / 1e6,
        "bytes/row": total / (requests * rows),
    }


def print_table(engine: str, results: list[dict]) -> None:
    print(f"\n### {engine}\n")
    print("| encoding | req/s | rows/s | MB/s | bytes/row |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r['encoding']} | {r['req/s']:.1f} | {r['rows/s']:.0f} | {r['MB/s']:.1f} | {r['bytes/row']:.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--engines", nargs="+", default=["mock", "transformers"], choices=["mock", "transformers"]
    )
    parser.add_argument("--rows", type=int, default=8, help="rows per request")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines:
            serve_args, model = engine_args(engine, Path(tmp))
            gateway = start_gateway(serve_args, Path(tmp) / f"{engine}.log")
            try:
                results = [
                    asyncio.run(
                        run_encoding(
                            gateway.base_url, model, enc, args.rows, args.requests, args.concurrency, seed=i
                        )
                    )
                    for i, enc in enumerate(ENCODINGS)
                ]
            finally:
                gateway.stop()
            print_table(
                f"{engine} ({model}), {args.rows} rows/request, concurrency {args.concurrency}", results
            )


if __name__ == "__main__":
    main()
