"""The least a call through a second process can cost on this machine: the gateway's path with
no work in it.

    python -m bench.wake_floor --engine-ms 2 --calls 400 --touch-mb 0 12

An "engine" that keeps its thread busy for --engine-ms (as a CUDA synchronize does), called
several ways, the ways taking turns call by call:

- in process: an asyncio loop hands the call to a worker thread and waits for it (our engine in
  process: `run_in_executor`);
- two processes: the same, behind a Unix socket: the client sends a small frame, the server's
  loop hands the call to its worker thread and writes a small answer frame back (the gateway's
  local socket with no work in it);
- two processes, the worker returning --tail-ms before the engine's end and the loop waiting
  out the rest itself, awake (the transformers engine's rows landing, waited for by the loop);
- two processes, the answer written by the worker thread itself (one wake-up fewer);
- two processes, the loop waiting as above and the client polling its socket awake (asyncio
  turning without sleeping) over the same last --tail-ms instead of sleeping until the answer;
- the same, and the server's loop also polling awake for up to --linger-ms after each answer, for
  the next call (a wake-up at each end kept warm); these calls run back to back after the others,
  as a lingering loop takes a core from whatever call follows it.

The server's loop is uvloop's where it is installed (the gateway's, under uvicorn), with --asyncio
the standard one.

Between calls the client reads --touch-mb megabytes (an SMC step's rows, read by its sampling).
Prints the median µs each call takes beyond the engine's time: what a same-host gateway cannot
go under on this machine, whatever its own code does.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import statistics
import struct
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_LENGTH = struct.Struct("<I")


def busy(seconds: float) -> float:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return seconds


def busy_until(deadline: float) -> None:
    while time.perf_counter() < deadline:
        pass


def serve(
    path: str,
    engine_s: float,
    tail_s: float,
    linger_s: float,
    use_uvloop: bool,
    ready: multiprocessing.synchronize.Event,
) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        executor = ThreadPoolExecutor(1)

        class Connection(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.transport = transport
                self.sock = transport.get_extra_info("socket")

            def data_received(self, data: bytes) -> None:
                self.received = True
                tag = data[4:5]
                if tag == b"t":  # the worker thread answers
                    executor.submit(self.answer_from_thread)
                else:
                    asyncio.ensure_future(self.answer(0.0 if tag == b"l" else tail_s, tag == b"b"))

            async def answer(self, tail: float, linger: bool) -> None:
                deadline = time.perf_counter() + engine_s
                await loop.run_in_executor(executor, busy_until, deadline - tail)
                busy_until(deadline)
                self.transport.write(_LENGTH.pack(2) + b"ok")
                if linger:  # the loop polls, awake, for the next request a while
                    self.received = False
                    until = time.perf_counter() + linger_s
                    while not self.received and time.perf_counter() < until:
                        await asyncio.sleep(0)

            def answer_from_thread(self) -> None:
                busy(engine_s)
                os.write(self.sock.fileno(), _LENGTH.pack(2) + b"ok")

        server = await loop.create_unix_server(Connection, path)
        ready.set()
        async with server:
            await server.serve_forever()

    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            use_uvloop = False
    if use_uvloop:
        uvloop.run(main())
    else:
        asyncio.run(main())


async def measure(args: argparse.Namespace, path: str) -> dict[str, list[float]]:
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(1)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    await loop.sock_connect(sock, path)
    engine_s, tail_s = args.engine_ms / 1e3, args.tail_ms / 1e3

    async def in_process() -> None:
        await loop.run_in_executor(executor, busy, engine_s)

    async def remote(tag: bytes, poll: bool = False) -> None:
        sent = time.perf_counter()
        await loop.sock_sendall(sock, _LENGTH.pack(1) + tag)
        received = b""
        while len(received) < 6:
            received += await (polled(sent) if poll else loop.sock_recv(sock, 64))

    async def polled(sent: float) -> bytes:
        """The socket read, asleep until the engine's last --tail-ms, then polling awake."""
        reading = asyncio.ensure_future(loop.sock_recv(sock, 64))
        await asyncio.wait({reading}, timeout=max(0.0, sent + engine_s - tail_s - time.perf_counter()))
        until = time.perf_counter() + 2 * tail_s
        while not reading.done() and time.perf_counter() < until:
            await asyncio.sleep(0)
        return await reading

    ways = {
        "in process": in_process,
        "two processes": lambda: remote(b"l"),
        f"two processes, the loop waiting the last {args.tail_ms} ms": lambda: remote(b"w"),
        "two processes, answered by the worker": lambda: remote(b"t"),
        "two processes, the loop waiting, the client polling awake the same last ms": lambda: remote(
            b"w", True
        ),
    }
    # A lingering server keeps a core busy into whatever call comes next, and only a call that
    # follows one of its own finds it awake: its calls run back to back, after the others.
    lingering = {
        f"the same, the server's loop also polling {args.linger_ms} ms for the next call (back to back)": lambda: (
            remote(b"b", True)
        )
    }
    results: dict[str, list[float]] = {}
    for mb in args.touch_mb:
        rows = np.ones((mb << 20) // 4, dtype=np.float32) if mb else None
        for turns in ([ways] * args.calls, [lingering] * args.calls):
            for i, turn in enumerate(turns):
                for name, call in turn.items():
                    if rows is not None:
                        rows.sum()
                    started = time.perf_counter()
                    await call()
                    if i >= args.calls // 10:
                        results.setdefault(f"{name}|{mb}", []).append(
                            time.perf_counter() - started - engine_s
                        )
            await asyncio.sleep(2 * args.linger_ms / 1e3)  # the server's loop asleep again
    sock.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine-ms", type=float, default=2.0)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--touch-mb", type=int, nargs="+", default=[0, 12])
    parser.add_argument("--tail-ms", type=float, default=0.5)
    parser.add_argument("--linger-ms", type=float, default=3.0)
    parser.add_argument("--asyncio", action="store_true", help="the server's loop: asyncio's, not uvloop's")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "floor.sock")
        ready = multiprocessing.get_context("spawn").Event()
        server = multiprocessing.get_context("spawn").Process(
            target=serve,
            args=(
                path,
                args.engine_ms / 1e3,
                args.tail_ms / 1e3,
                args.linger_ms / 1e3,
                not args.asyncio,
                ready,
            ),
            daemon=True,
        )
        server.start()
        try:
            ready.wait(30)
            results = asyncio.run(measure(args, path))
        finally:
            server.terminate()
            server.join()
    loop = "asyncio" if args.asyncio else "uvloop (where installed)"
    print(
        f"\n### A call beyond its {args.engine_ms} ms engine, median (p90) µs, {os.cpu_count()} CPUs, server loop {loop}\n"
    )
    names = list(dict.fromkeys(key.split("|")[0] for key in results))
    print("| way | " + " | ".join(f"client reads {mb} MB between calls" for mb in args.touch_mb) + " |")
    print("| --- |" + " ---: |" * len(args.touch_mb))
    for name in names:
        cells = []
        for mb in args.touch_mb:
            values = sorted(results[f"{name}|{mb}"])
            cells.append(
                f"{statistics.median(values) * 1e6:.0f} ({values[int(len(values) * 0.9)] * 1e6:.0f})"
            )
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    threading.excepthook = lambda hook_args: None
    main()
