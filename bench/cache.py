"""Output cache: latency and throughput of cache hits versus recomputing, per cache store.

    python -m bench.cache                 # mock engine (vocab 131072) and SmolLM2-135M (vocab 49152)
    python -m bench.cache --rows 16 --requests 30

For each model and store (in-process LRU, Redis), sends `--requests` MessagePack requests of
`--rows` rows: first with fresh prefixes (every row a miss: computed, then stored), then the same
requests again (every row a hit). Prints a Markdown table of median latency and rows/s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np

from bench.launcher import RedisServer, start_gateway

MODELS = {
    "mock": ("mock", 'backend = "mock"\noptions = {vocab_size = 131072}'),
    "transformers": ("smollm2-135m", 'dtype = "float32"'),
}


def config(engine: str, store: str, redis_url: str) -> str:
    name, extra = MODELS[engine]
    cache = f'redis_url = "{redis_url}"' if store == "redis" else "memory_bytes = 2_000_000_000"
    return f'[[models]]\nname = "{name}"\nmodel = "smollm2-135m"\n{extra}\n\n[cache]\n{cache}\n'


def measure(base_url: str, model: str, bodies: list[bytes], expect_hits: int) -> tuple[float, float]:
    latencies = []
    headers = {"Accept": "application/msgpack", "Content-Type": "application/msgpack"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=300) as client:
        started = time.perf_counter()
        for body in bodies:
            t = time.perf_counter()
            response = client.post("/v1/next_token_logprobs", content=body)
            response.raise_for_status()
            latencies.append(time.perf_counter() - t)
            assert msgspec.msgpack.decode(response.content)["usage"]["cache_hits"] == expect_hits
        elapsed = time.perf_counter() - started
    return statistics.median(latencies) * 1000, len(bodies) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(
        "| model | vocab | store | miss: ms/request | miss: rows/s | hit: ms/request | hit: rows/s | speed-up |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp))
        redis.start()
        try:
            for engine in args.engines:
                model = MODELS[engine][0]
                for store in ("memory", "redis"):
                    path = Path(tmp) / f"{engine}-{store}.toml"
                    path.write_text(config(engine, store, redis.url))
                    gateway = start_gateway(["--config", str(path)], Path(tmp) / f"{engine}-{store}.log")
                    try:
                        bodies = [
                            msgspec.msgpack.encode(
                                {
                                    "model": model,
                                    "input": [
                                        [int(t) for t in rng.integers(100, 40000, size=16)]
                                        for _ in range(args.rows)
                                    ],
                                }
                            )
                            for _ in range(args.requests)
                        ]
                        vocab = httpx.get(f"{gateway.base_url}/v1/models/{model}").json()["vocab_size"]
                        miss_ms, miss_rps = measure(gateway.base_url, model, bodies, 0)
                        hit_ms, hit_rps = measure(gateway.base_url, model, bodies, args.rows)
                    finally:
                        gateway.stop()
                    print(
                        f"| {model} | {vocab} | {store} | {miss_ms:.1f} | {miss_rps * args.rows:.0f} | "
                        f"{hit_ms:.1f} | {hit_rps * args.rows:.0f} | {miss_ms / hit_ms:.1f}x |"
                    )
        finally:
            redis.stop()


if __name__ == "__main__":
    main()
