"""`logprob-gateway fleet`: N gateway replicas and SGLang's model gateway (SMG) in front of them,
on one machine, for a lab's first steps past one replica and for the tests.

The router is SMG, unchanged (`pip install 'logprob-gateway[fleet]'` installs its `smg` command):
the fleet is its job. Each replica is `logprob-gateway serve` with the arguments given after
`--`, on a loopback port of its own; once every replica answers `/health`, the router starts on
`--host`/`--port` with them as its workers and `--policy` as its routing policy. A replica that
exits is started again on its port, as a Deployment would; the router takes it back once its
`/health` answers. SIGTERM or Ctrl-C stops the router, then the replicas (each drains as on its
own); if the router exits, the replicas are stopped and the fleet exits with its status.
docs/fleet.md says what goes through the router and how.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

POLICIES = ("cache_aware", "prefix_hash", "round_robin", "random", "power_of_two", "least_load")
START_TIMEOUT_S = 600.0  # a replica's model load, on the slowest machine we know
STOP_TIMEOUT_S = 60.0  # past the replicas' drain (30 s by default)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def router_command(
    host: str, port: int, workers: Sequence[str], policy: str, extra: Sequence[str] = ()
) -> list[str]:
    """SMG's command line for `workers` (base URLs)."""
    smg = shutil.which("smg")
    if smg is None:
        raise FileNotFoundError("the router's `smg` command is missing: pip install 'logprob-gateway[fleet]'")
    return [
        smg,
        "launch",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        "--policy",
        policy,
        "--log-level",
        "warn",
        *extra,
    ]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _wait_healthy(urls: Sequence[str], processes: Sequence[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    waiting = list(urls)
    while waiting:
        for process in processes:
            if process.poll() is not None:
                raise ChildProcessError(f"a process of the fleet exited with status {process.returncode}")
        waiting = [url for url in waiting if not _healthy(url)]
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"{len(waiting)} replicas did not answer /health within {timeout_s:g} s")
        time.sleep(0.5)


def _stop(processes: Sequence[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run(args: argparse.Namespace) -> int:
    serve_args = [a for a in args.serve_args if a != "--"]
    ports = [free_port() for _ in range(args.replicas)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]

    def start_replica(port: int) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "serve",
                *serve_args,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ]
        )

    replicas = [start_replica(port) for port in ports]
    stopping = False
    router: subprocess.Popen | None = None

    def stop_on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop_on_signal)
    signal.signal(signal.SIGINT, stop_on_signal)
    try:
        _wait_healthy(urls, replicas, args.start_timeout)
        router = subprocess.Popen(router_command(args.host, args.port, urls, args.policy, args.router_arg))
        print(
            f"logprob-gateway fleet: {args.replicas} replicas ({', '.join(urls)}) behind SMG "
            f"({args.policy}) on http://{args.host}:{args.port}",
            file=sys.stderr,
            flush=True,
        )
        while not stopping:
            if router.poll() is not None and not stopping:
                print(
                    f"logprob-gateway fleet: the router exited ({router.returncode}); stopping",
                    file=sys.stderr,
                )
                return router.returncode or 1
            for i, replica in enumerate(replicas):
                if replica.poll() is not None and not stopping:  # Ctrl-C reaches the replicas too
                    print(
                        f"logprob-gateway fleet: replica {urls[i]} exited ({replica.returncode}); starting it again",
                        file=sys.stderr,
                        flush=True,
                    )
                    replicas[i] = start_replica(ports[i])
            time.sleep(0.2)
        return 0
    except (ChildProcessError, TimeoutError, FileNotFoundError) as exc:
        print(f"logprob-gateway fleet: {exc}", file=sys.stderr)
        return 1
    finally:
        _stop(([router] if router is not None else []) + replicas)  # the router first: no request
        # reaches a replica that is stopping


def add_parser(commands: argparse._SubParsersAction) -> None:
    fleet = commands.add_parser(
        "fleet",
        help="serve N replicas behind SGLang's model gateway (SMG), on this machine",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    fleet.add_argument("--replicas", type=int, default=2, help="gateway processes (default: 2)")
    fleet.add_argument("--host", default="127.0.0.1", help="the router's address (default: 127.0.0.1)")
    fleet.add_argument("--port", type=int, default=8000, help="the router's port (default: 8000)")
    fleet.add_argument("--policy", choices=POLICIES, default="cache_aware", help="SMG's routing policy")
    fleet.add_argument(
        "--router-arg", action="append", default=[], metavar="ARG", help="one more argument for `smg launch`"
    )
    fleet.add_argument("--start-timeout", type=float, default=START_TIMEOUT_S, help=argparse.SUPPRESS)
    fleet.add_argument(
        "serve_args", nargs=argparse.REMAINDER, help="after --: arguments of every replica's serve"
    )
