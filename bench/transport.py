"""Dense-row transport per encoding: MB/s of the codecs alone, and of POST /v1/next_token_logprobs.

    python -m bench.transport                        # codecs; mock engine (vocab 131072); SmolLM2-135M
    python -m bench.transport --engines mock --rows 256 --requests 20 --concurrency 1

First, in process: the server's encoder (`gateway.dense.delivery.in_body`, whose buffers go out as they
are) and the client's decoder (`logprob_gateway_client.wire` for MessagePack; base64/JSON as a client
would) on `--codec-rows` rows of a 49152-token vocabulary, in MB of response per second. Then over
loopback HTTP: the gateway as a child process (output cache off), `--requests` requests of
`--rows` distinct rows each from `--concurrency` concurrent httpx clients, and last
`logprob_gateway_client.AsyncGatewayLM`, its answers written into its memory by the gateway (shared
memory), then read off the socket (MessagePack matrix). The mock engine shows
what HTTP and the encodings cost; the real model adds the forward pass. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np

from bench.launcher import start_gateway
from gateway.dense.delivery import in_body
from gateway.schemas.logprobs import NextTokenLogprobsRequest, NextTokenLogprobsUsage
from logprob_gateway_client import AsyncGatewayLM
from logprob_gateway_client.encoding import decode_row
from logprob_gateway_client.wire import decode_msgpack_matrix, decode_msgpack_rows

ENCODINGS = [  # (label, encoding_format, dtype, msgpack, layout)
    ("json float", "float", "float32", False, "rows"),
    ("json base64 f32", "base64", "float32", False, "rows"),
    ("json base64 bf16", "base64", "bfloat16", False, "rows"),
    ("msgpack f32", "float", "float32", True, "rows"),
    ("msgpack f16", "float", "float16", True, "rows"),
    ("msgpack bf16", "float", "bfloat16", True, "rows"),
    ("msgpack f32 matrix", "float", "float32", True, "matrix"),
    ("msgpack bf16 matrix", "float", "bfloat16", True, "matrix"),
]


def engine_args(engine: str, workdir: Path) -> tuple[list[str], str]:
    if engine == "mock":
        config = workdir / "mock.toml"
        config.write_text(
            '[[models]]\nname = "mock"\nmodel = "smollm2-135m"\nbackend = "mock"\noptions = {vocab_size = 131072}\n'
        )
        return ["--config", str(config), "--no-cache"], "mock"
    return ["--model", "smollm2-135m", "--dtype", "float32", "--no-cache"], "smollm2-135m"


def decode(
    content: bytearray, rows: int, encoding_format: str, dtype: str, binary: bool, layout: str
) -> np.ndarray:
    if binary:
        if layout == "matrix":
            return decode_msgpack_matrix(content, rows)
        return decode_msgpack_rows(content, rows, dtype)
    document = msgspec.json.decode(content)
    if layout == "matrix":
        if encoding_format == "base64":
            return decode_row(document["logprobs"], dtype).reshape(rows, -1)
        return np.array(document["logprobs"], dtype=np.float32)
    if encoding_format == "base64":
        return np.stack([decode_row(d["logprobs"], dtype) for d in document["data"]])
    return np.array([d["logprobs"] for d in document["data"]], dtype=np.float32)


def codec_table(rows: int, vocab: int = 49152, repeats: int = 5) -> None:
    """The server's encoder and the client's decoder on one response of `rows` rows."""
    values = np.random.default_rng(0).standard_normal((rows, vocab)).astype(np.float32)
    usage = NextTokenLogprobsUsage(prompt_tokens=rows, total_tokens=rows, cache_hits=0)
    print(f"\n### codecs in process: {rows} rows x {vocab}\n")
    print("| encoding | MB | encode MB/s | decode MB/s |")
    print("| --- | ---: | ---: | ---: |")
    for label, encoding_format, dtype, binary, layout in ENCODINGS:
        body = NextTokenLogprobsRequest(
            model="m", input=[[1]], encoding_format=encoding_format, dtype=dtype, layout=layout
        )

        timings = {"encode": [], "decode": []}
        for _ in range(repeats):
            started = time.perf_counter()
            parts = in_body(values, body, usage, binary)
            timings["encode"].append(time.perf_counter() - started)
            content = bytearray(b"".join(parts))  # as a client receives it: a writable buffer
            started = time.perf_counter()
            decoded = decode(content, rows, encoding_format, dtype, binary, layout)
            timings["decode"].append(time.perf_counter() - started)
        assert decoded.shape == values.shape
        mb = len(content) / 1e6
        print(
            f"| {label} | {mb:.1f} | {mb / min(timings['encode']):.0f} | {mb / min(timings['decode']):.0f} |"
        )


async def run_encoding(
    base_url: str, model: str, encoding: tuple, rows: int, requests: int, concurrency: int, seed: int
) -> dict:
    label, encoding_format, dtype, binary, layout = encoding
    rng = np.random.default_rng(seed)
    headers = {"Accept": "application/msgpack", "Content-Type": "application/msgpack"} if binary else {}

    def body(i: int) -> bytes:
        # distinct short prefixes, so every row is computed (no de-duplication)
        batch = [[int(t) for t in rng.integers(100, 40000, size=8)] for _ in range(rows)]
        doc = {
            "model": model,
            "input": batch,
            "encoding_format": encoding_format,
            "dtype": dtype,
            "layout": layout,
        }
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


async def run_client(
    base_url: str, model: str, rows: int, requests: int, seed: int, shared_memory: bool
) -> dict:
    """logprob_gateway_client.AsyncGatewayLM, one batch call at a time."""
    rng = np.random.default_rng(seed)
    batches = [
        [[int(t) for t in rng.integers(100, 40000, size=8)] for _ in range(rows)] for _ in range(requests + 1)
    ]
    async with AsyncGatewayLM(base_url, model, cache_size=0, shared_memory=shared_memory) as lm:
        await lm.batch_next_token_logprobs(batches[-1])  # warm-up
        started = time.perf_counter()
        for batch in batches[:requests]:
            out = await lm.batch_next_token_logprobs(batch)
        elapsed = time.perf_counter() - started
        used = lm.shared_memory_answers > 0
    per_row = out.shape[1] * 4
    return {
        "encoding": f"AsyncGatewayLM ({'f32 into shared memory' if used else 'msgpack f32 matrix, socket'})",
        "req/s": requests / elapsed,
        "rows/s": requests * rows / elapsed,
        "MB/s": requests * rows * per_row / elapsed / 1e6,
        "bytes/row": per_row,
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
    parser.add_argument("--codec-rows", type=int, default=64, help="rows of the in-process codec table")
    args = parser.parse_args()
    codec_table(args.codec_rows)
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
                results += [
                    asyncio.run(run_client(gateway.base_url, model, args.rows, args.requests, 99, shared))
                    for shared in (True, False)
                ]
            finally:
                gateway.stop()
            print_table(
                f"{engine} ({model}), {args.rows} rows/request, concurrency {args.concurrency}", results
            )


if __name__ == "__main__":
    main()
