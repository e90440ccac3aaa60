"""How long the server's event loop makes `/health` wait while something else runs, probed from
another process: a thread of the test's process would also wait on that process's GIL while it
builds or sends large requests, and count that wait against the server."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import TypeVar

import httpx

T = TypeVar("T")


def _poll_health(base_url: str, ready: Event, stop: Event, polls: Queue) -> None:
    """Polls /health until `stop`; puts its (monotonic start, end, status) triples on `polls`."""
    found = []
    with httpx.Client(base_url=base_url, timeout=60) as c:
        while not stop.is_set():
            started = time.monotonic()
            status = c.get("/health").status_code
            found.append((started, time.monotonic(), status))
            if len(found) == 3:
                ready.set()
            time.sleep(0.005)
    polls.put(found)


def health_latencies_during(base_url: str, work: Callable[[], T]) -> tuple[list[float], T]:
    """Every /health latency of a probe that overlapped `work`, and what `work` returned."""
    context = multiprocessing.get_context("spawn")
    ready, stop, polls = context.Event(), context.Event(), context.Queue()
    poller = context.Process(target=_poll_health, args=(base_url, ready, stop, polls))
    poller.start()
    try:
        assert ready.wait(60), "/health was not polled"
        started = time.monotonic()
        result = work()
        ended = time.monotonic()
        time.sleep(0.05)  # a poll that was waiting on a stalled loop lands
    finally:
        stop.set()
        found = polls.get(timeout=60)
        poller.join()
    during = [end - start for start, end, _ in found if start < ended and end > started]
    assert during and {status for *_, status in found} == {200}
    return during, result
