"""A fleet on this machine (`logprob-gateway fleet`: N replicas of the real default model behind
SGLang's model gateway), one way of placing work after another, the output cache off so that only
placement decides what is computed again.

    python -m bench.fleet                      # 3 replicas; every way below, workloads A and B
    python -m bench.fleet --ways random --jobs 2 --steps 3 --chat-clients 0

Ways: `routing keys` (the fleet's default: SMG pins each routing key, `x-smg-routing-key`, to the
replica with the fewest keys; a job or a shared system prompt is one key) and SMG's policies
`cache_aware`, `prefix_hash`, `round_robin`, `random` for clients that send no key.

Workload A (SMC): `--jobs` jobs at once, each `--particles` particles over a prompt of 512-1,024
token ids of its own; at each of `--steps` steps a job asks the router for its particles' dense
rows in one call (SGLang's `/generate` with `next_token_logprobs`), then every particle takes one
more token. Workload B (chat): `--chat-clients` clients at once, each `--turns` chat completions
of 16 tokens under one of 6 system prompts of about 1,000 tokens (client i under prompt i mod 6).
Prints a Markdown table per workload: prompt tokens computed (each replica's
`logprob_gateway_prefill_tokens`), the prefix cache's share, rows/s or tok/s, p50/p95 of a call,
and each replica's share of the work (rows, chats). Then the router's own cost for one client:
p50 of a dense call and of a 16-token completion, through the router and straight to a replica.
`--fault`: a replica SIGKILLed under load instead (a mock fleet), and how soon it is back.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.launcher import FleetProcess, start_fleet

MODEL = "smollm2-135m"
KEY_HEADER = "x-smg-routing-key"
WORDS = "river stone music light paper garden window silver morning story".split()


@dataclass(frozen=True)
class Way:
    policy: str
    keyed: bool  # the clients send a routing key


WAYS = {
    "routing keys": Way("cache_aware", keyed=True),
    "cache_aware": Way("cache_aware", keyed=False),
    "prefix_hash": Way("prefix_hash", keyed=False),
    "round_robin": Way("round_robin", keyed=False),
    "random": Way("random", keyed=False),
}


@dataclass
class Run:
    latencies: list[float]
    units: int  # rows or completion tokens
    seconds: float


def replica_counters(fleet: FleetProcess) -> dict[str, dict[str, float]]:
    """Per replica: prompt tokens computed and cached, dense rows served, chats answered."""
    found = {}
    for url in fleet.workers():
        text = httpx.get(url + "/metrics", timeout=10).text

        def total(pattern: str, text: str = text) -> float:
            return sum(float(v) for v in re.findall(pattern + r"[^\n]* ([0-9.e+]+)\n", text))

        found[url] = {
            "computed": total(r'logprob_gateway_prefill_tokens_total\{[^}]*source="computed"'),
            "cached": total(r'logprob_gateway_prefill_tokens_total\{[^}]*source="cached"'),
            "rows": total(r"logprob_gateway_dense_rows_total\{"),
            "chats": total(r'logprob_gateway_requests_total\{[^}]*route="/v1/chat/completions"'),
        }
    return found


def dense_body(rows: list[list[int]]) -> dict:
    return {"model": MODEL, "input_ids": rows, "next_token_logprobs": {"layout": "matrix", "msgpack": True}}


async def smc(base: str, jobs: int, particles: int, steps: int, keyed: bool, seed: int) -> Run:
    rng = random.Random(seed)
    latencies: list[float] = []
    rows = 0

    async def job(client: httpx.AsyncClient, index: int, prompt: list[int]) -> None:
        nonlocal rows
        headers = {KEY_HEADER: f"smc-{seed}-{index}"} if keyed else {}
        tails: list[list[int]] = [[] for _ in range(particles)]
        for _ in range(steps):
            began = time.perf_counter()
            body = dense_body([prompt + t for t in tails])
            answer = await client.post(base + "/generate", json=body, headers=headers)
            answer.raise_for_status()
            latencies.append(time.perf_counter() - began)
            rows += particles
            for tail in tails:
                tail.append(rng.randrange(100, 40000))

    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(512, 1025))] for _ in range(jobs)]
    began = time.perf_counter()
    async with httpx.AsyncClient(timeout=1800) as client:
        await asyncio.gather(*(job(client, i, prompt) for i, prompt in enumerate(prompts)))
    return Run(latencies, rows, time.perf_counter() - began)


async def chat(base: str, clients: int, turns: int, keyed: bool, seed: int) -> Run:
    rng = random.Random(seed)
    systems = [f"You are assistant {s}. " + " ".join(rng.choice(WORDS) for _ in range(990)) for s in range(6)]
    latencies: list[float] = []
    tokens = 0

    async def client_loop(client: httpx.AsyncClient, index: int) -> None:
        nonlocal tokens
        system = index % len(systems)
        headers = {KEY_HEADER: f"system-{seed}-{system}"} if keyed else {}
        for turn in range(turns):
            body = {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": systems[system]},
                    {"role": "user", "content": f"Client {index}, question {turn}: name a colour."},
                ],
                "max_tokens": 16,
                "temperature": 0,
            }
            began = time.perf_counter()
            answer = await client.post(base + "/v1/chat/completions", json=body, headers=headers)
            answer.raise_for_status()
            latencies.append(time.perf_counter() - began)
            tokens += answer.json()["usage"]["completion_tokens"]

    began = time.perf_counter()
    async with httpx.AsyncClient(timeout=1800) as client:
        await asyncio.gather(*(client_loop(client, i) for i in range(clients)))
    return Run(latencies, tokens, time.perf_counter() - began)


def p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1e3


def measured(fleet: FleetProcess, workload: Callable[[], Run]) -> tuple[Run, dict[str, dict[str, float]]]:
    """The workload's run, and what each replica counted during it."""
    before = replica_counters(fleet)
    run = workload()
    after = replica_counters(fleet)
    return run, {url: {k: after[url][k] - before[url][k] for k in after[url]} for url in after}


def table_row(name: str, run: Run, counts: dict[str, dict[str, float]], unit: str) -> str:
    computed = sum(c["computed"] for c in counts.values())
    cached = sum(c["cached"] for c in counts.values())
    total = sum(c[unit] for c in counts.values()) or 1
    shares = " / ".join(f"{c[unit] / total:.2f}" for c in counts.values())
    return (
        f"| {name} | {computed:,.0f} | {cached / max(1.0, cached + computed):.2f} | "
        f"{run.units / run.seconds:.1f} | {p(run.latencies, 0.5):.0f} | {p(run.latencies, 0.95):.0f} | {shares} |"
    )


def overhead(fleet: FleetProcess, calls: int) -> list[tuple[str, float, float]]:
    """p50 (ms) through the router and straight to a replica, the two asked in turn."""
    replica = fleet.workers()[0]
    completion = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    out = []
    with httpx.Client(timeout=120) as client:
        for name, path, body in (
            ("dense call, 1 row", "/generate", dense_body([[1000, 2000, 3000, 4000]])),
            (
                "dense call, 64 rows",
                "/generate",
                dense_body([[1000 + i, 2000, 3000, 4000] for i in range(64)]),
            ),
            ("completion, 16 tokens", "/v1/completions", completion),
        ):
            times: dict[str, list[float]] = {"router": [], "replica": []}
            for i in range(calls + 3):
                for where, url in (("router", fleet.base_url), ("replica", replica)):
                    began = time.perf_counter()
                    client.post(url + path, json=body).raise_for_status()
                    if i >= 3:  # warm
                        times[where].append(time.perf_counter() - began)
            out.append(
                (name, statistics.median(times["router"]) * 1e3, statistics.median(times["replica"]) * 1e3)
            )
    routed, direct = asyncio.run(_client_library_calls(fleet.base_url, replica, calls))
    return [*out, ("AsyncGatewayLM, 64 rows (placed, then straight to the replica)", routed, direct)]


async def _client_library_calls(router: str, replica: str, calls: int) -> tuple[float, float]:
    """p50 (ms) of AsyncGatewayLM's 64-row calls pointed at the router and at a replica, in turn;
    every call's rows new (the client keeps rows it has seen)."""
    from logprob_gateway_client import AsyncGatewayLM

    times: dict[str, list[float]] = {"router": [], "replica": []}
    clients = {"router": AsyncGatewayLM(router, MODEL), "replica": AsyncGatewayLM(replica, MODEL)}
    try:
        for i in range(calls + 3):
            for where, lm in clients.items():
                rows = [[1000 + i, 2000 + j, 3000, 4000 + (where == "router")] for j in range(64)]
                began = time.perf_counter()
                await lm.batch_next_token_logprobs(rows)
                if i >= 3:
                    times[where].append(time.perf_counter() - began)
    finally:
        for lm in clients.values():
            await lm.aclose()
    return statistics.median(times["router"]) * 1e3, statistics.median(times["replica"]) * 1e3


def fault(workdir: Path) -> str:
    """A mock fleet of 2 under round_robin; one replica SIGKILLed under sequential completions:
    the failures, when the fleet's new replica answers /health, when the router uses it again."""
    config = workdir / "mock.toml"
    config.write_text(f'[[models]]\nname = "{MODEL}"\nmodel = "{MODEL}"\nbackend = "mock"\n')
    fleet = start_fleet(["--config", str(config)], workdir / "fault.log", 2, "round_robin")
    try:
        victim_url = fleet.workers()[0]
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        os.kill(fleet.replica_pid(victim_url), signal.SIGKILL)
        killed = time.monotonic()
        sent, failed, healthy, used = 0, 0, None, None
        with httpx.Client(timeout=30) as client:
            while used is None and time.monotonic() - killed < 300:
                try:
                    failed += client.post(fleet.base_url + "/v1/completions", json=body).status_code != 200
                except httpx.HTTPError:
                    failed += 1
                sent += 1
                if healthy is None and _served(victim_url) is not None:
                    healthy, before = time.monotonic() - killed, _served(victim_url)
                elif healthy is not None and (_served(victim_url) or 0) > before:
                    used = time.monotonic() - killed
        return (
            f"{sent} requests after the kill, {failed} failed; the replica answered /health again "
            f"after {healthy:.1f} s, and the router sent it a request after {used:.1f} s"
        )
    finally:
        fleet.stop()


def _served(url: str) -> float | None:
    """Completions a replica has answered; None while it is down."""
    try:
        text = httpx.get(url + "/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    pattern = r'logprob_gateway_requests_total\{[^}]*route="/v1/completions"[^}]*\} ([0-9.e+]+)'
    return sum(float(v) for v in re.findall(pattern, text))


HEADER = (
    "| way | prompt tokens computed | from prefix cache | {unit}/s | p50 (ms) | p95 (ms) | replicas' shares |\n"
    "| --- | ---: | ---: | ---: | ---: | ---: | --- |"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--ways", nargs="+", choices=list(WAYS), default=list(WAYS))
    parser.add_argument("--jobs", type=int, default=6)
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--chat-clients", type=int, default=24)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--overhead-calls", type=int, default=30)
    parser.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=2 << 30,
        help="each replica's prefix cache (default 2 GiB: two SMC jobs' K/V; the CPU default, 1 GiB, holds one)",
    )
    parser.add_argument("--router-arg", action="append", default=[], help="one more `smg launch` argument")
    parser.add_argument("--fault", action="store_true", help="only the SIGKILLed replica, on the mock engine")
    args = parser.parse_args()
    if args.fault:
        with tempfile.TemporaryDirectory() as workdir:
            print(fault(Path(workdir)))
        return
    tables: dict[str, list[str]] = {"A": [], "B": []}
    lines: Sequence[tuple[str, float, float]] = ()
    with tempfile.TemporaryDirectory() as workdir:
        config = Path(workdir) / "gateway.toml"
        config.write_text(
            f'[[models]]\nname = "{MODEL}"\nmodel = "{MODEL}"\ndtype = "float32"\n'
            f"options = {{prefix_cache_bytes = {args.prefix_cache_bytes}}}\n\n[cache]\nenabled = false\n"
        )
        for i, name in enumerate(args.ways):
            way = WAYS[name]
            log = Path(workdir) / f"fleet-{i}.log"
            fleet = start_fleet(["--config", str(config)], log, args.replicas, way.policy, args.router_arg)
            try:
                if args.jobs:
                    run, counts = measured(
                        fleet,
                        lambda f=fleet, w=way: asyncio.run(
                            smc(f.base_url, args.jobs, args.particles, args.steps, w.keyed, seed=7)
                        ),
                    )
                    tables["A"].append(table_row(name, run, counts, "rows"))
                    print("A", tables["A"][-1], flush=True)
                if args.chat_clients:
                    run, counts = measured(
                        fleet,
                        lambda f=fleet, w=way: asyncio.run(
                            chat(f.base_url, args.chat_clients, args.turns, w.keyed, seed=7)
                        ),
                    )
                    tables["B"].append(table_row(name, run, counts, "chats"))
                    print("B", tables["B"][-1], flush=True)
                if i == len(args.ways) - 1 and args.overhead_calls:
                    lines = overhead(fleet, args.overhead_calls)
            finally:
                fleet.stop()
    for workload, unit in (("A", "rows"), ("B", "tok")):
        if tables[workload]:
            print(f"\nWorkload {workload}\n\n" + HEADER.format(unit=unit))
            print("\n".join(tables[workload]))
    if lines:
        print("\n| one client, p50 | through the router (ms) | to a replica (ms) | router's cost (ms) |")
        print("| --- | ---: | ---: | ---: |")
        for name, routed, direct in lines:
            print(f"| {name} | {routed:.2f} | {direct:.2f} | {routed - direct:.2f} |")


if __name__ == "__main__":
    main()
