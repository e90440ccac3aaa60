"""`logprob-gateway fleet`: N gateway replicas and SGLang's model gateway (SMG) in front of them,
on one machine, for a lab's first steps past one replica and for the tests.

The router is SMG, unchanged (`pip install 'logprob-gateway[fleet]'` installs its `smg` command):
the fleet is its job. Each replica is `logprob-gateway serve` with the arguments given after
`--`, on a loopback port of its own; once every replica answers `/health`, the router starts on
`--host`/`--port` with them as its workers and `--policy` as its routing policy for requests
without a routing key (requests with one stay on the replica their key was given), and the fleet
gives it the models' tokenizers. A replica that exits is started again on its port, as a
Deployment would (at once, then after longer waits while it keeps exiting soon after its start);
the router takes it back once its `/health` answers. SIGTERM or Ctrl-C stops the router, then the
replicas (each drains as on its own); if the router exits, the replicas are stopped and the fleet
exits with its status.
docs/fleet.md says what goes through the router and how.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from backends.cpu_threads import cpus_available

POLICIES = (
    "cache_aware",
    "prefix_hash",
    "round_robin",
    "random",
    "power_of_two",
    "least_load",
    "consistent_hashing",
    "manual",
)
START_TIMEOUT_S = 600.0  # a replica's model load, on the slowest machine we know
STOP_TIMEOUT_S = 60.0  # past the replicas' drain (30 s by default)
# A request with a routing key (`x-smg-routing-key`: the client library sends one per instance, an
# SMC job) goes where that key went before; a new key goes to the replica with the fewest keys, so
# jobs keep their prefixes and still spread evenly. Requests without a key follow the policy.
STICKY_KEYS = ("--routing-key-override", "--assignment-mode", "min_group")
RESTART_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # a replica that keeps exiting at start
STEADY_S = 60.0  # a replica up this long has started well: its next restart waits the first delay


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
        *STICKY_KEYS,
        # a port of its own for SMG's metrics (else 29000: a second fleet on the host fails)
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(free_port(host)),
        "--log-level",
        "warn",
        *extra,  # after ours: SMG's parser keeps an option's last value
    ]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
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
        waiting = [url for url in waiting if not _answers(url + "/health")]
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


class _Replica:
    """One replica's process on its port, started again after it exits: at once the first time,
    then after delays that grow while it keeps exiting soon after its start."""

    def __init__(self, port: int, serve_args: Sequence[str], env: dict[str, str]) -> None:
        self.port, self.serve_args, self.env = port, serve_args, env
        self.url = f"http://127.0.0.1:{port}"
        self.failures = 0  # exits in a row, each within STEADY_S of its start
        self.due: float | None = None  # when to start it again
        self.start()

    def start(self) -> None:
        command = [sys.executable, "-m", "gateway.cli", "serve", *self.serve_args]
        self.process = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(self.port)], env=self.env
        )
        self.started, self.due = time.monotonic(), None

    def tend(self) -> None:
        now = time.monotonic()
        if self.due is not None:
            if now >= self.due:
                self.start()
            return
        if self.process.poll() is None:
            return
        self.failures = self.failures + 1 if now - self.started < STEADY_S else 1
        delay = RESTART_DELAYS_S[min(self.failures, len(RESTART_DELAYS_S)) - 1]
        self.due = now + delay
        print(
            f"logprob-gateway fleet: replica {self.url} exited ({self.process.returncode}); "
            f"starting it again in {delay:g} s",
            file=sys.stderr,
            flush=True,
        )


def replica_environment(replicas: int) -> dict[str, str]:
    """This process's environment, and each replica's share of the CPUs it may run on as the
    threads of its engine's math (OMP_NUM_THREADS), unless that is set: replicas that each take
    every core run slower together than one alone."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpus_available() // replicas)))
    return env


def _json(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data else {}
    with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=10) as answer:
        return json.load(answer)


def register_tokenizers(router: str, replica: str, timeout_s: float = 60.0) -> list[str]:
    """Give the router each model's tokenizer, under the model's name, from the directory the
    replicas load it from: SMG answers `/v1/tokenize` and `/v1/detokenize` itself, with its own
    tokenizer. Returns the names registered (none for a model whose directory has no
    tokenizer.json; none at all if the router is not ready within `timeout_s` or refuses them:
    the fleet serves without)."""
    try:
        return _register_tokenizers(router, replica, time.monotonic() + timeout_s)
    except (OSError, ValueError, KeyError) as exc:
        print(f"logprob-gateway fleet: the router has no tokenizers ({exc!r})", file=sys.stderr)
        return []


def _register_tokenizers(router: str, replica: str, deadline: float) -> list[str]:
    while not _answers(router + "/readiness"):
        if time.monotonic() > deadline:
            return []
        time.sleep(0.5)
    names = []
    for card in _json(replica + "/v1/models")["data"]:
        if card.get("parent"):  # an adapter: the base's tokenizer
            continue
        path = _json(f"{replica}/get_model_info?model={urllib.parse.quote(card['id'])}")["tokenizer_path"]
        if Path(path, "tokenizer.json").is_file():
            _json(router + "/v1/tokenizers", {"name": card["id"], "source": path})
            names.append(card["id"])
    while not set(names) <= {t["name"] for t in _json(router + "/v1/tokenizers")["tokenizers"]}:
        if time.monotonic() > deadline:  # SMG loads them in the background
            return []
        time.sleep(0.2)
    return names


def run(args: argparse.Namespace) -> int:
    serve_args = [a for a in args.serve_args if a != "--"]
    env = replica_environment(args.replicas)
    replicas = [_Replica(free_port(), serve_args, env) for _ in range(args.replicas)]
    urls = [replica.url for replica in replicas]
    stopping = False
    router: subprocess.Popen | None = None

    def stop_on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop_on_signal)
    signal.signal(signal.SIGINT, stop_on_signal)
    try:
        _wait_healthy(urls, [replica.process for replica in replicas], args.start_timeout)
        router = subprocess.Popen(router_command(args.host, args.port, urls, args.policy, args.router_arg))
        router_url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
        tokenizers = register_tokenizers(router_url, urls[0])
        print(
            f"logprob-gateway fleet: {args.replicas} replicas ({', '.join(urls)}) behind SMG "
            f"({args.policy}, tokenizers: {', '.join(tokenizers) or 'none'}) on http://{args.host}:{args.port}",
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
            if not stopping:  # Ctrl-C reaches the replicas too
                for replica in replicas:
                    replica.tend()
            time.sleep(0.2)
        return 0
    except (ChildProcessError, TimeoutError, FileNotFoundError) as exc:
        print(f"logprob-gateway fleet: {exc}", file=sys.stderr)
        return 1
    finally:
        # the router first: no request reaches a replica that is stopping
        _stop(([router] if router is not None else []) + [replica.process for replica in replicas])


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
