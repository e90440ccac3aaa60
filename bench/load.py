"""Load and soak: a realistic mix of requests against a gateway for a bounded time.

    python -m bench.load                                   # starts a gateway on the default model
    python -m bench.load --duration 300 --workers 16       # longer, more concurrent
    python -m bench.load --backend mock                    # the HTTP layer alone
    python -m bench.load --url http://host:8000 --model smollm2-135m --pid 4242   # a running one

`--workers` clients loop for `--duration` seconds, each picking a kind at random (WEIGHTS): dense
rows as JSON base64 and as MessagePack (fresh random prefixes), repeated rows (a small pool, so
mostly cache hits, checked against the first copy seen), completions, streamed chat completions,
tokenize, and bad requests that must get their 4xx in OpenAI's error format. Every response is
checked (status, content type, shape, rows normalised). Unexpected outcomes: a 5xx, a transport
error, a wrong status, a malformed body. A request not finished within `--timeout` is stuck. The
server's RSS (/proc/<pid>/status VmRSS) is sampled every second. Prints a Markdown table and a
summary line; exits 1 on any unexpected or stuck request, or if the server does not drain.

tests/gateway/test_soak.py imports this file and runs the same mix against the real model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from backends.builtin_models import DEFAULT_MODEL
from bench.launcher import start_gateway
from logprob_gateway_client.encoding import decode_row

MSGPACK = "application/msgpack"
WEIGHTS = {
    "dense_base64": 2,
    "dense_msgpack": 3,
    "dense_repeat": 3,
    "completion": 1,
    "chat_stream": 1,
    "tokenize": 1,
    "bad": 1,
}
SENTENCES = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Photosynthesis converts light into",
    "The three primary colours are",
    "Élan vital, naïveté, 東京 and emoji 🙂 in one prompt",
]
POOL_SIZE = 8  # distinct prefixes of dense_repeat: hot enough to stay cached
ROW_TOLERANCE = 1e-4  # a row recomputed in another batch equals the first copy within this (README)


class Unexpected(Exception):
    """A response that is not what the request should get; `status` is its HTTP status (most
    checks run on a 200's body)."""

    def __init__(self, message: str, status: int = 200) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Target:
    """What the mix needs to know about the served model, and the repeated rows seen so far."""

    model: str
    vocab_size: int
    pool: list[list[int]]
    reference: dict[int, np.ndarray] = field(default_factory=dict)
    cache_hits: int = 0


def expect(response: httpx.Response, status: int, content_type: str) -> None:
    if response.status_code != status:
        raise Unexpected(f"status {response.status_code}: {response.text[:200]}", response.status_code)
    if not response.headers.get("content-type", "").startswith(content_type):
        raise Unexpected(f"content-type {response.headers.get('content-type')!r}", response.status_code)


def check_row(raw: bytes | str, dtype: str, vocab: int) -> np.ndarray:
    """Decoded row; raises unless it is a normalised log-probability row of the vocabulary's width."""
    row = decode_row(raw, dtype)  # type: ignore[arg-type]
    if row.shape != (vocab,) or np.isnan(row).any() or row.max() > 1e-3:
        raise Unexpected(f"malformed {dtype} row: shape {row.shape}, max {row.max() if row.size else None}")
    top = float(row.max())
    total = top + float(np.log(np.exp(row.astype(np.float64) - top).sum()))
    if abs(total) > (1e-3 if dtype == "float32" else 5e-2):
        raise Unexpected(f"{dtype} row is not normalised: logsumexp {total:.4f}")
    return row


def random_prefix(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(rng.randint(4, 32))]


async def dense(
    target: Target, client: httpx.AsyncClient, rows: list[list[int]], dtype: str, binary: bool
) -> list[np.ndarray]:
    body = {"model": target.model, "input": rows, "encoding_format": "base64", "dtype": dtype}
    if binary:
        headers = {"content-type": MSGPACK, "accept": MSGPACK}
        response = await client.post(
            "/v1/next_token_logprobs", content=msgspec.msgpack.encode(body), headers=headers
        )
        expect(response, 200, MSGPACK)
        document = msgspec.msgpack.decode(response.content)
    else:
        response = await client.post("/v1/next_token_logprobs", json=body)
        expect(response, 200, "application/json")
        document = response.json()
    data = document["data"]
    if [d["index"] for d in data] != list(range(len(rows))) or document["dtype"] != dtype:
        raise Unexpected(f"rows/dtype do not match the request: {len(data)} rows, {document['dtype']}")
    if document["usage"]["prompt_tokens"] != sum(map(len, rows)):
        raise Unexpected(f"usage {document['usage']} for {sum(map(len, rows))} tokens")
    target.cache_hits += document["usage"]["cache_hits"]
    return [check_row(d["logprobs"], dtype, target.vocab_size) for d in data]


async def dense_base64(target: Target, client: httpx.AsyncClient, rng: random.Random) -> int:
    rows = [random_prefix(rng, target.vocab_size) for _ in range(rng.randint(1, 8))]
    await dense(target, client, rows, "float32", binary=False)
    return 200


async def dense_msgpack(target: Target, client: httpx.AsyncClient, rng: random.Random) -> int:
    rows = [random_prefix(rng, target.vocab_size) for _ in range(rng.randint(1, 8))]
    dtype = rng.choice(["float32", "float16", "bfloat16"])
    await dense(target, client, rows, dtype, binary=True)
    return 200


async def dense_repeat(target: Target, client: httpx.AsyncClient, rng: random.Random) -> int:
    picks = rng.sample(range(len(target.pool)), rng.randint(1, 4))
    rows = await dense(target, client, [target.pool[i] for i in picks], "float32", binary=True)
    for i, row in zip(picks, rows, strict=True):
        first = target.reference.setdefault(i, row)
        finite = np.isfinite(first)
        if (
            not np.array_equal(finite, np.isfinite(row))
            or np.abs(row[finite] - first[finite]).max() > ROW_TOLERANCE
        ):
            raise Unexpected(f"repeated row {i} differs from its first copy")
    return 200


async def completion(target: Target, client: httpx.AsyncClient, rng: random.Random) -> int:
    max_tokens = rng.randint(1, 8)
    body = {
        "model": target.model,
        "prompt": rng.choice(SENTENCES),
        "max_tokens": max_tokens,
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "logprobs": rng.choice([None, 0, 3]),
    }
    response = await client.post("/v1/completions", json=body)
    expect(response, 200, "application/json")
    choice, usage = response.json()["choices"], response.json()["usage"]
    if len(choice) != 1 or choice[0]["finish_reason"] not in ("stop", "length"):
        raise Unexpected(f"bad choices: {choice}")
    if not 0 < usage["completion_tokens"] <= max_tokens:
        raise Unexpected(f"usage {usage} for max_tokens {max_tokens}")
    return 200


async def chat_stream(target: Target, client: httpx.AsyncClient, rng: random.Random) -> int:
    max_tokens = rng.randint(1, 8)
    body = {
        "model": target.model,
        "messages": [{"role": "user", "content": rng.choice(SENTENCES)}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
        expect(response, 200, "text/event-stream")
        events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        raise Unexpected(f"stream did not end with [DONE]: {events[-2:]}")
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        raise Unexpected(f"error event in stream: {next(c for c in chunks if 'error' in c)}")
    usage = chunks[-1].get("usage") if chunks else None
    if not usage or not 0 < usage["completion_tokens"] <= max_tokens:
        raise Unexpected(f"last chunk's usage {usage} for max_tokens {max_tokens}")
    return 200


async def tokenize(target: Target, client: httpx.AsyncClient, rng: random.Random) -> int:
    response = await client.post(
        "/v1/tokenize", json={"model": target.model, "prompt": rng.choice(SENTENCES)}
    )
    expect(response, 200, "application/json")
    body = response.json()
    if body["count"] != len(body["tokens"]) or not body["tokens"]:
        raise Unexpected(f"tokenize answered {body}")
    return 200


def bad_requests(model: str, vocab: int) -> list[tuple[str, str, str, bytes, dict, int]]:
    """(name, method, path, body, headers, expected status)."""
    as_json = {"content-type": "application/json"}

    def js(body: dict) -> bytes:
        return json.dumps(body).encode()

    completion_ = {"model": model, "prompt": "Hi", "max_tokens": 1}
    return [
        (
            "unknown-model",
            "POST",
            "/v1/completions",
            js({**completion_, "model": "no-such-model"}),
            as_json,
            404,
        ),
        ("temperature-3", "POST", "/v1/completions", js({**completion_, "temperature": 3}), as_json, 400),
        ("malformed-json", "POST", "/v1/chat/completions", b'{"model": ', as_json, 400),
        (
            "not-utf8",
            "POST",
            "/v1/completions",
            b'{"model": "' + model.encode() + b'", "prompt": "\xff"}',
            as_json,
            400,
        ),
        (
            "msgpack-nan",
            "POST",
            "/v1/completions",
            msgspec.msgpack.encode({**completion_, "top_p": float("nan")}),
            {"content-type": MSGPACK},
            400,
        ),
        (
            "id-outside-vocab",
            "POST",
            "/v1/next_token_logprobs",
            js({"model": model, "input": [[vocab]]}),
            as_json,
            400,
        ),
        ("empty-input", "POST", "/v1/next_token_logprobs", js({"model": model, "input": []}), as_json, 400),
        ("unknown-route", "POST", "/v1/no_such_endpoint", b"{}", as_json, 404),
        ("wrong-method", "GET", "/v1/completions", b"", {}, 405),
    ]


async def bad(target: Target, client: httpx.AsyncClient, rng: random.Random) -> int:
    name, method, path, body, headers, status = rng.choice(bad_requests(target.model, target.vocab_size))
    response = await client.request(method, path, content=body, headers=headers)
    if response.status_code != status:
        raise Unexpected(f"{name}: expected {status}, got {response.status_code}", response.status_code)
    error = response.json().get("error")
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        raise Unexpected(f"{name}: not OpenAI's error object: {response.text[:200]}", response.status_code)
    return status


KINDS = {
    f.__name__: f for f in (dense_base64, dense_msgpack, dense_repeat, completion, chat_stream, tokenize, bad)
}


# -- running and reporting ----------------------------------------------------------------------


@dataclass
class KindStats:
    statuses: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)  # seconds, of requests that finished
    unexpected: int = 0
    stuck: int = 0
    problems: list[str] = field(default_factory=list)  # the first few, to print

    def note(self, problem: str) -> None:
        if len(self.problems) < 3:
            self.problems.append(problem[:300])


@dataclass
class Report:
    duration_s: float
    workers: int
    kinds: dict[str, KindStats]
    rss_mb: list[tuple[float, float]]  # (seconds since the start, MB)
    cache_hits: int

    @property
    def requests(self) -> int:
        return sum(sum(k.statuses.values()) + k.stuck for k in self.kinds.values())

    @property
    def unexpected(self) -> int:
        return sum(k.unexpected for k in self.kinds.values())

    @property
    def stuck(self) -> int:
        return sum(k.stuck for k in self.kinds.values())

    def rss_window(self, first: bool, window_s: float = 10.0) -> float | None:
        """Median RSS over the first (or last) `window_s` seconds of the run."""
        if not self.rss_mb:
            return None
        end = self.rss_mb[-1][0]
        picked = [mb for t, mb in self.rss_mb if (t <= window_s if first else t >= end - window_s)]
        return statistics.median(picked) if picked else None

    @property
    def rss_growth_mb(self) -> float | None:
        first, last = self.rss_window(True), self.rss_window(False)
        return None if first is None or last is None else last - first

    def table(self) -> str:
        lines = [
            "| kind | requests | statuses | p50 ms | p95 ms | p99 ms | max ms | unexpected | stuck |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        everything = KindStats()
        for name, k in [*self.kinds.items(), ("all", everything)]:
            if name != "all":
                everything.statuses.update(k.statuses)
                everything.latencies += k.latencies
                everything.unexpected += k.unexpected
                everything.stuck += k.stuck
            ms = np.percentile(k.latencies, [50, 95, 99, 100]) * 1000 if k.latencies else [float("nan")] * 4
            statuses = " ".join(f"{s}×{n}" for s, n in sorted(k.statuses.items(), key=str))
            lines.append(
                f"| {name} | {sum(k.statuses.values()) + k.stuck} | {statuses} | "
                + " | ".join(f"{v:.0f}" for v in ms)
                + f" | {k.unexpected} | {k.stuck} |"
            )
        return "\n".join(lines)

    def summary(self) -> str:
        rss = "RSS not sampled"
        if self.rss_mb:
            peak = max(mb for _, mb in self.rss_mb)
            rss = (
                f"RSS {self.rss_window(True):.0f} MB (first 10 s) -> {self.rss_window(False):.0f} MB "
                f"(last 10 s): growth {self.rss_growth_mb:+.0f} MB, peak {peak:.0f} MB"
            )
        return (
            f"{self.requests} requests in {self.duration_s:.1f} s ({self.requests / self.duration_s:.1f}/s) "
            f"from {self.workers} workers; {self.unexpected} unexpected, {self.stuck} stuck; "
            f"{self.cache_hits} cached rows served; {rss}"
        )

    def problems(self) -> list[str]:
        return [f"{name}: {p}" for name, k in self.kinds.items() for p in k.problems]


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


async def model_target(client: httpx.AsyncClient, model: str, seed: int) -> Target:
    response = await client.get(f"/v1/models/{model}")
    response.raise_for_status()
    vocab = response.json()["vocab_size"]
    rng = random.Random(seed)
    return Target(model, vocab, [random_prefix(rng, vocab) for _ in range(POOL_SIZE)])


async def run_load(
    base_url: str,
    model: str,
    *,
    duration_s: float,
    workers: int,
    timeout_s: float = 60.0,
    pid: int | None = None,
    seed: int = 0,
    api_key: str | None = None,
    weights: dict[str, int] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Report:
    """Run the mix; every request is bounded by `timeout_s` (past it, it counts as stuck and is
    abandoned, which closes its connection)."""
    weights = weights or WEIGHTS
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=workers + 2, max_keepalive_connections=workers + 2)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=timeout_s + 5, limits=limits, transport=transport
    ) as client:
        target = await model_target(client, model, seed)
        stats = {name: KindStats() for name in weights}
        rss: list[tuple[float, float]] = []
        started = time.monotonic()
        deadline = started + duration_s

        async def worker(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            names, cumulative = list(weights), list(weights.values())
            while time.monotonic() < deadline:
                name = rng.choices(names, cumulative)[0]
                kind, t0 = stats[name], time.perf_counter()
                try:
                    status = await asyncio.wait_for(KINDS[name](target, client, rng), timeout_s)
                except TimeoutError:
                    kind.stuck += 1
                    kind.note(f"not finished after {timeout_s} s")
                    continue
                except Exception as exc:  # transport errors, and bodies that do not parse or check
                    status = getattr(exc, "status", None) or type(exc).__name__
                    kind.unexpected += 1
                    kind.note(f"{type(exc).__name__}: {exc}")
                kind.statuses[status] += 1
                kind.latencies.append(time.perf_counter() - t0)

        async def sample_rss() -> None:
            while pid is not None and time.monotonic() < deadline:
                mb = rss_mb(pid)
                if mb is not None:
                    rss.append((time.monotonic() - started, mb))
                await asyncio.sleep(1.0)

        sampler = asyncio.create_task(sample_rss())
        await asyncio.gather(*(worker(i) for i in range(workers)))
        elapsed = time.monotonic() - started
        await sampler
    if pid is not None and (mb := rss_mb(pid)) is not None:
        rss.append((elapsed, mb))
    return Report(elapsed, workers, stats, rss, target.cache_hits)


@dataclass
class ServerState:
    in_flight: float  # other than the scrape that measured it
    queued: float  # dense engine calls not answered yet, every model's
    server_errors: float  # 5xx responses counted by the server since it started (/health aside)


def server_state(base_url: str, api_key: str | None = None) -> ServerState:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(base_url + "/metrics", headers=headers, timeout=30).text
    in_flight = queued = errors = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "logprob_gateway_requests_in_flight":
                in_flight = sample.value - 1  # the scrape itself is in flight
            elif sample.name == "logprob_gateway_engine_calls_in_progress":
                queued += sample.value
            elif sample.name == "logprob_gateway_requests_total" and sample.labels["status"].startswith("5"):
                errors += 0 if sample.labels["route"] == "/health" else sample.value  # 503 while loading
    return ServerState(in_flight, queued, errors)


def drained(base_url: str, api_key: str | None = None, wait_s: float = 10.0) -> ServerState:
    """The server's state once nothing is in flight or queued, or after `wait_s` (abandoned
    requests take a moment to be cancelled server-side)."""
    deadline = time.monotonic() + wait_s
    while True:
        state = server_state(base_url, api_key)
        if (state.in_flight == 0 and state.queued == 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="a running gateway; without it one is started")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--pid", type=int, help="the running gateway's process, to sample its RSS")
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer'")
    parser.add_argument("--backend", default="transformers", help="for a started gateway")
    parser.add_argument("--cache-mb", type=int, default=16, help="a started gateway's in-process cache")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    def go(base_url: str, pid: int | None) -> tuple[Report, ServerState]:
        report = asyncio.run(
            run_load(
                base_url,
                args.model,
                duration_s=args.duration,
                workers=args.workers,
                timeout_s=args.timeout,
                pid=pid,
                seed=args.seed,
                api_key=args.api_key,
            )
        )
        return report, drained(base_url, args.api_key)

    if args.url:
        report, state = go(args.url.rstrip("/"), args.pid)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "gateway.toml"
            config.write_text(
                f'[[models]]\nname = "{args.model}"\nmodel = "{args.model}"\nbackend = "{args.backend}"\n'
                f'dtype = "float32"\n\n[cache]\nmemory_bytes = {args.cache_mb * 2**20}\n'
            )
            gateway = start_gateway(["--config", str(config)], Path(tmp) / "gateway.log")
            try:
                report, state = go(gateway.base_url, gateway.process.pid)
            finally:
                gateway.stop()
    print(report.table())
    print()
    print(report.summary())
    print(
        f"server after the run: {state.in_flight:.0f} in flight, {state.queued:.0f} queued, {state.server_errors:.0f} 5xx"
    )
    for problem in report.problems():
        print("  ", problem)
    failed = report.unexpected or report.stuck or state.in_flight or state.queued or state.server_errors
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
