"""A fleet on this machine (`logprob-gateway fleet`: N replicas of the real default model behind
SGLang's model gateway), one routing policy after another, the output cache off so that only
placement decides what is computed again.

    python -m bench.fleet                      # 3 replicas; cache_aware, prefix_hash, random, round_robin
    python -m bench.fleet --policies random --jobs 2 --steps 3

Workload A (SMC): `--jobs` jobs at once, each `--particles` particles over a prompt of 512-1,024
token ids of its own; at each of `--steps` steps a job asks the router for its particles' dense
rows in one call (SGLang's `/generate` with `next_token_logprobs`), then every particle takes one
more token. Prints a Markdown table per policy: prompt tokens computed (each replica's
`logprob_gateway_prefill_tokens`), the prefix cache's share, rows/s, p50/p95 of a call, and each
replica's share of the rows. Then the router's own cost for one client: p50 of the same dense
call (64 rows) and of a 16-token completion, through the router and straight to a replica.
`--fault`: a replica SIGKILLed under load instead (a mock fleet), and how soon it is back.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from gateway.fleet import free_port

MODEL = "smollm2-135m"


def start_fleet(
    replicas: int, policy: str, workdir: Path, router_args: list[str] | None = None
) -> tuple[subprocess.Popen, str]:
    config = workdir / "gateway.toml"
    config.write_text(
        f'[[models]]\nname = "{MODEL}"\nmodel = "{MODEL}"\ndtype = "float32"\n\n[cache]\nenabled = false\n'
    )
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "fleet",
            "--replicas",
            str(replicas),
            "--port",
            str(port),
            "--policy",
            policy,
            *(f"--router-arg={arg}" for arg in router_args or []),
            "--",
            "--config",
            str(config),
        ],
        stdout=(workdir / f"fleet-{policy}.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while not _ready(base, replicas):
        assert process.poll() is None and time.monotonic() < deadline, "the fleet did not start"
        time.sleep(0.5)
    return process, base


def replica_counters(base: str) -> dict[str, dict[str, float]]:
    """Per worker: prompt tokens computed and cached, dense rows served."""
    found = {}
    for worker in httpx.get(base + "/workers", timeout=10).json()["workers"]:
        text = httpx.get(worker["url"] + "/metrics", timeout=10).text

        def total(pattern: str, text: str = text) -> float:
            return sum(float(v) for v in re.findall(pattern + r"[^\n]* ([0-9.e+]+)\n", text))

        found[worker["url"]] = {
            "computed": total(r'logprob_gateway_prefill_tokens_total\{[^}]*source="computed"'),
            "cached": total(r'logprob_gateway_prefill_tokens_total\{[^}]*source="cached"'),
            "rows": total(r"logprob_gateway_dense_rows_total\{"),
        }
    return found


def dense_body(rows: list[list[int]]) -> dict:
    return {"model": MODEL, "input_ids": rows, "next_token_logprobs": {"layout": "matrix", "msgpack": True}}


async def smc(base: str, jobs: int, particles: int, steps: int, seed: int) -> tuple[list[float], int, float]:
    rng = random.Random(seed)
    latencies: list[float] = []
    rows = 0

    async def job(client: httpx.AsyncClient, prompt: list[int]) -> None:
        nonlocal rows
        tails: list[list[int]] = [[] for _ in range(particles)]
        for _ in range(steps):
            began = time.perf_counter()
            answer = await client.post(base + "/generate", json=dense_body([prompt + t for t in tails]))
            answer.raise_for_status()
            latencies.append(time.perf_counter() - began)
            rows += particles
            for tail in tails:
                tail.append(rng.randrange(100, 40000))

    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(512, 1025))] for _ in range(jobs)]
    began = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(job(client, prompt) for prompt in prompts))
    return latencies, rows, time.perf_counter() - began


def p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1e3


def overhead(base: str, calls: int) -> list[tuple[str, float, float]]:
    """p50 (ms) through the router and straight to a replica, the two asked in turn."""
    replica = httpx.get(base + "/workers", timeout=10).json()["workers"][0]["url"]
    rows = [[1000 + i, 2000, 3000, 4000] for i in range(64)]
    completion = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    out = []
    with httpx.Client(timeout=120) as client:
        for name, path, body in (
            ("dense call, 64 rows", "/generate", dense_body(rows)),
            ("completion, 16 tokens", "/v1/completions", completion),
        ):
            times: dict[str, list[float]] = {"router": [], "replica": []}
            for i in range(calls + 3):
                for where, url in (("router", base), ("replica", replica)):
                    began = time.perf_counter()
                    client.post(url + path, json=body).raise_for_status()
                    if i >= 3:  # warm
                        times[where].append(time.perf_counter() - began)
            out.append(
                (name, statistics.median(times["router"]) * 1e3, statistics.median(times["replica"]) * 1e3)
            )
    return out


def fault(workdir: Path) -> str:
    """A mock fleet of 2 under round_robin; one replica SIGKILLed under sequential completions:
    the failures, when the fleet's new replica answers /health, when the router uses it again."""
    import os
    import signal

    config = workdir / "mock.toml"
    config.write_text(f'[[models]]\nname = "{MODEL}"\nmodel = "{MODEL}"\nbackend = "mock"\n')
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "fleet",
            "--replicas",
            "2",
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--",
            "--config",
            str(config),
        ],
        stdout=(workdir / "fault.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        while not _ready(base, 2):
            assert process.poll() is None, "the fleet did not start"
            time.sleep(0.3)
        victim_url = sorted(w["url"] for w in httpx.get(base + "/workers").json()["workers"])[0]
        victim = next(
            int(pid)
            for pid in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
            if victim_url.rsplit(":", 1)[1].encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
        )
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        sent, failed, healthy, used = 0, 0, None, None
        with httpx.Client(timeout=30) as client:
            while used is None and time.monotonic() - killed < 300:
                try:
                    failed += client.post(base + "/v1/completions", json=body).status_code != 200
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
        process.terminate()
        process.wait(timeout=120)


def _ready(base: str, replicas: int) -> bool:
    try:
        workers = httpx.get(base + "/workers", timeout=2).json()["workers"]
        return len(workers) == replicas and httpx.get(base + "/readiness", timeout=2).status_code == 200
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def _served(url: str) -> float | None:
    """Completions a replica has answered; None while it is down."""
    try:
        text = httpx.get(url + "/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    pattern = r'logprob_gateway_requests_total\{[^}]*route="/v1/completions"[^}]*\} ([0-9.e+]+)'
    return sum(float(v) for v in re.findall(pattern, text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument(
        "--policies", nargs="+", default=["cache_aware", "prefix_hash", "random", "round_robin"]
    )
    parser.add_argument("--jobs", type=int, default=6)
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--overhead-calls", type=int, default=30)
    parser.add_argument("--router-arg", action="append", default=[], help="one more `smg launch` argument")
    parser.add_argument("--fault", action="store_true", help="only the SIGKILLed replica, on the mock engine")
    args = parser.parse_args()
    if args.fault:
        with tempfile.TemporaryDirectory() as workdir:
            print(fault(Path(workdir)))
        return
    print(
        "| policy | prompt tokens computed | from prefix cache | rows/s | p50 (ms) | p95 (ms) | replicas' shares of rows |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    with tempfile.TemporaryDirectory() as workdir:
        for i, policy in enumerate(args.policies):
            process, base = start_fleet(args.replicas, policy, Path(workdir), args.router_arg)
            try:
                latencies, rows, seconds = asyncio.run(
                    smc(base, args.jobs, args.particles, args.steps, seed=7)
                )
                counters = replica_counters(base)
                computed = sum(c["computed"] for c in counters.values())
                cached = sum(c["cached"] for c in counters.values())
                total_rows = sum(c["rows"] for c in counters.values()) or 1
                shares = " / ".join(f"{c['rows'] / total_rows:.2f}" for c in counters.values())
                print(
                    f"| {policy} | {computed:,.0f} | {cached / max(1.0, cached + computed):.2f} | {rows / seconds:.1f} | "
                    f"{p(latencies, 0.5):.0f} | {p(latencies, 0.95):.0f} | {shares} |",
                    flush=True,
                )
                if i == len(args.policies) - 1 and args.overhead_calls:
                    lines = overhead(base, args.overhead_calls)
            finally:
                process.terminate()
                process.wait(timeout=120)
    if args.overhead_calls:
        print("\n| one client, p50 | through the router (ms) | to a replica (ms) | router's cost (ms) |")
        print("| --- | ---: | ---: | ---: |")
        for name, routed, direct in lines:
            print(f"| {name} | {routed:.2f} | {direct:.2f} | {routed - direct:.2f} |")


if __name__ == "__main__":
    main()
