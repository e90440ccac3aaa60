"""Grammar compile worker processes (backends/grammar/worker.py), a few per engine, shared by
all its requests: what a grammar can cost the gateway is what such a process can, and that can
be killed.

A job waits for a free worker (the smallest grammar first, so one ordinary grammar is not held
behind large hostile ones), then has `timeout_s` from the moment the worker takes it; a worker
that overruns is killed, one that dies (a crash in the grammar engine's native code) is gone,
and either is started again for the next job. At most `workers + max_waiting` jobs are in the
pool at once; beyond, GrammarBusyError at once.
"""

from __future__ import annotations

import asyncio
import atexit
import heapq
import itertools
import os
import resource
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from backends.errors import GrammarError
from backends.grammar.worker import FRAME_HEADER
from backends.types import Grammar

START_TIMEOUT_S = 60.0  # a worker's start (Python, llguidance, its tokenizer): ~1 s
MIN_STACK_BYTES = 512 * 1024
_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
T = TypeVar("T")


class GrammarBusyError(GrammarError):
    """More grammars are compiling and waiting than the pool takes; the caller may retry."""


class _WorkerGone(Exception):
    """The worker process died or was killed during a job."""


def worker_stack_bytes() -> int:
    """Half the stack of this process's threads (glibc gives them RLIMIT_STACK's size), so what
    compiles in a worker compiles on a thread here with room to spare."""
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    thread_stack = 8 * 2**20 if soft == resource.RLIM_INFINITY or soft <= 0 else soft
    return max(MIN_STACK_BYTES, min(thread_stack, 64 * 2**20) // 2)


def start_worker_process(hello: bytes) -> subprocess.Popen[bytes]:
    """A worker process that has read `hello` and said it is ready; GrammarError if it cannot."""
    process = subprocess.Popen(
        [sys.executable, "-m", "backends.grammar.worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [_PROJECT_ROOT, os.environ.get("PYTHONPATH")])),
        },
    )
    worker = _Worker()
    worker.process = process
    try:
        worker._send(hello)
        worker._receive(time.monotonic() + START_TIMEOUT_S)
    except (_WorkerGone, TimeoutError):
        worker.kill()
        raise GrammarError("the grammar engine could not start") from None
    return process


class _Worker:
    """One worker process, started at its first job and again after it dies or is killed."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None

    def ensure_started(self, start: Callable[[], subprocess.Popen[bytes]]) -> None:
        if self.process is None or self.process.poll() is not None:
            self.process = start()

    def run(self, grammar: Grammar, timeout_s: float) -> list[str]:
        """The worker's answer; TimeoutError (the worker killed) past `timeout_s`, _WorkerGone if
        it died."""
        deadline = time.monotonic() + timeout_s
        self._send(msgspec.msgpack.encode([grammar.kind, grammar.source]))
        try:
            return msgspec.msgpack.decode(self._receive(deadline))
        except TimeoutError:
            self.kill()
            raise

    def kill(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            _stop(process)

    def exit_status(self) -> int | None:
        process, self.process = self.process, None
        if process is None:
            return None
        try:
            status = process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            process.kill()
            status = process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()
        return status

    def _send(self, body: bytes) -> None:
        assert self.process is not None and self.process.stdin is not None
        try:
            self.process.stdin.write(FRAME_HEADER.pack(len(body)) + body)
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise _WorkerGone from None

    def _receive(self, deadline: float) -> bytes:
        assert self.process is not None and self.process.stdout is not None
        fd = self.process.stdout.fileno()
        header = self._read(fd, FRAME_HEADER.size, deadline)
        return self._read(fd, FRAME_HEADER.unpack(header)[0], deadline)

    @staticmethod
    def _read(fd: int, size: int, deadline: float) -> bytes:
        chunks: list[bytes] = []
        while size:
            left = deadline - time.monotonic()
            try:
                ready = left > 0 and select.select([fd], [], [], left)[0]
            except (OSError, ValueError):  # closed under us: the pool is closing
                raise _WorkerGone from None
            if not ready:
                raise TimeoutError
            try:
                chunk = os.read(fd, min(size, 2**20))
            except OSError:  # closed under us: the pool is closing
                raise _WorkerGone from None
            if not chunk:
                raise _WorkerGone
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait()
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            pipe.close()


class CompilePool:
    """`workers` compile processes and at most `max_waiting` jobs waiting for one."""

    def __init__(self, hello: Callable[[], bytes], workers: int, max_waiting: int) -> None:
        self._hello = hello  # the worker's setup frame, built once at the first start
        self._hello_bytes: bytes | None = None
        self._workers = [_Worker() for _ in range(workers)]
        self._idle = list(self._workers)
        self._capacity = workers + max_waiting
        self._in_pool = 0
        self._queue: list[tuple[int, int]] = []  # (source length, ticket): smallest first
        self._tickets = itertools.count()
        self._changed = threading.Condition()
        self._closed = False
        self._spare: subprocess.Popen[bytes] | None = None  # started, idle, ready to take over
        self._spare_starting = False
        self._spare_lock = threading.Lock()
        self._threads = ThreadPoolExecutor(max_workers=self._capacity, thread_name_prefix="grammar-job")
        atexit.register(self.close)

    async def run(self, job: Callable[..., T], *args: Any) -> T:
        """`job(*args)` on a thread of the pool's own, or GrammarBusyError at once if the pool is
        full; `job` calls `compile` there."""
        with self._changed:
            if self._closed:
                raise GrammarError("the grammar engine is shutting down")
            if self._in_pool >= self._capacity:
                raise GrammarBusyError(
                    f"{self._capacity} grammars are compiling or waiting to; try again shortly"
                )
            self._in_pool += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._threads, job, *args)
        finally:
            with self._changed:
                self._in_pool -= 1

    def compile(self, grammar: Grammar, timeout_s: float) -> str:
        """llguidance's grammar text for `grammar`, checked by a worker within `timeout_s` of its
        taking the job; GrammarError with why not. Blocking: call it on a thread of `run`."""
        worker = self._take(len(grammar.source))
        try:
            worker.ensure_started(self._process)
            try:
                verdict, text = worker.run(grammar, timeout_s)
            except TimeoutError:
                raise GrammarError(f"the grammar did not compile within {timeout_s:g} s") from None
            except _WorkerGone:
                status = worker.exit_status()
                how = f" (signal {-status})" if status is not None and status < 0 else ""
                raise GrammarError(f"the grammar engine crashed on this grammar{how}") from None
        finally:
            self._give_back(worker)
        if verdict != "ok":
            raise GrammarError(text)
        return text

    def _process(self) -> subprocess.Popen[bytes]:
        """A ready worker process: the spare if one is, a new one otherwise; then a new spare
        starts in the background, so that a worker killed or crashed is replaced at once."""
        with self._spare_lock:
            if self._hello_bytes is None:
                self._hello_bytes = self._hello()
            spare, self._spare = self._spare, None
        process = (
            spare if spare is not None and spare.poll() is None else start_worker_process(self._hello_bytes)
        )
        with self._spare_lock:
            starting, self._spare_starting = self._spare_starting, True
        if not starting:
            threading.Thread(target=self._start_spare, name="grammar-worker-spare", daemon=True).start()
        return process

    def _start_spare(self) -> None:
        assert self._hello_bytes is not None
        try:
            process: subprocess.Popen[bytes] | None = start_worker_process(self._hello_bytes)
        except GrammarError:
            process = None  # the next job starts one itself, and says so if it cannot
        with self._spare_lock:
            self._spare_starting = False
            if not self._closed and self._spare is None:
                self._spare, process = process, None
        if process is not None:
            _stop(process)

    def _take(self, size: int) -> _Worker:
        with self._changed:
            ticket = (size, next(self._tickets))
            heapq.heappush(self._queue, ticket)
            while not self._closed and not (self._idle and self._queue[0] == ticket):
                self._changed.wait()
            self._queue.remove(ticket)
            heapq.heapify(self._queue)
            self._changed.notify_all()
            if self._closed:
                raise GrammarError("the grammar engine is shutting down")
            return self._idle.pop()

    def _give_back(self, worker: _Worker) -> None:
        with self._changed:
            self._idle.append(worker)
            self._changed.notify_all()

    def close(self) -> None:
        """Stop every worker process; jobs still waiting are refused."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
            self._changed.notify_all()
        for worker in self._workers:
            worker.kill()
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            _stop(spare)
        self._threads.shutdown(wait=False, cancel_futures=True)
        atexit.unregister(self.close)
