"""Prometheus instruments, and the ASGI middleware that counts and times every request.

All names start with `logprob_gateway_` and use base units. Label values are bounded: `model` is
a configured model name (empty when the request named none that exists), `adapter` a loaded
adapter's name, `route` the route's path template ("unmatched" for unknown paths). Raw user input
never becomes a label value. One registry per app; the gateway runs one worker process.

Where a concept matches one of vLLM's metrics the name says so in its help text.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "logprob_gateway"
LABELS_KEY = "logprob_gateway.labels"  # where routes leave (model, adapter) in the ASGI scope
DISCONNECTED_KEY = "logprob_gateway.disconnected"  # set by gateway.guard when the client went away
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.requests = Counter(
            f"{PREFIX}_requests",
            "HTTP requests served.",
            ["route", "method", "model", "adapter", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "Time from request to the last response byte (vLLM: e2e request latency).",
            ["route", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(f"{PREFIX}_requests_in_flight", "Requests being served.", registry=r)
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time to the first generated token (vLLM: time_to_first_token).",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Time between generated tokens (vLLM: inter_token_latency).",
            ["model"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens",
            "Prompt tokens processed (vLLM: prompt_tokens).",
            ["model", "adapter", "endpoint"],
            registry=r,
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens",
            "Tokens generated (vLLM: generation_tokens).",
            ["model", "adapter", "endpoint"],
            registry=r,
        )
        self.dense_rows = Counter(
            f"{PREFIX}_dense_rows",
            "Dense next-token rows served.",
            ["model", "adapter", "encoding"],
            registry=r,
        )
        self.dense_response_bytes = Counter(
            f"{PREFIX}_dense_response_bytes",
            "Bytes of dense next-token responses.",
            ["model", "encoding"],
            registry=r,
        )
        self.batch_rows = Histogram(
            f"{PREFIX}_batch_rows",
            "Distinct rows per dense engine call (a request's, at most max_batch_rows).",
            ["model"],
            buckets=ROW_BUCKETS,
            registry=r,
        )
        self.cache_lookups = Counter(
            f"{PREFIX}_cache_lookups", "Dense rows looked up in the output cache.", ["result"], registry=r
        )
        self.cache_errors = Counter(
            f"{PREFIX}_cache_errors", "Failed calls to the cache store (timeouts, outages).", registry=r
        )
        self.cache_duration = Histogram(
            f"{PREFIX}_cache_operation_duration_seconds",
            "Latency of cache store calls.",
            ["operation"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.weight_updates = Counter(
            f"{PREFIX}_weight_updates",
            "New weights loaded while serving, from disk or over a collective.",
            ["model", "source"],
            registry=r,
        )
        self.model_load_duration = Gauge(
            f"{PREFIX}_model_load_duration_seconds", "Time the model took to load.", ["model"], registry=r
        )

    def expose(self) -> bytes:
        return generate_latest(self.registry)

    def child(self, metric: Any, *values: str) -> Any:
        """`metric.labels(*values)`, looked up once: labels() validates and locks at every call,
        and the dense path counts several metrics per call. Label values are bounded (above),
        so this stays small."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found


class StateCollector(Collector):
    """Read at scrape time: model readiness, the models' dense engine calls, and the server's load
    under the names SGLang gives it, which SGLang's model gateway reads to balance its workers."""

    def __init__(self, models: Any, dense: Any, max_streams: int) -> None:
        self.models = models  # the ModelRegistry
        self.dense = dense  # the DenseService, whose engine calls these are
        self.max_streams = max_streams

    def collect(self) -> Iterable[Any]:
        ready = GaugeMetricFamily(
            f"{PREFIX}_model_ready", "1 when the model is loaded and healthy.", labels=["model"]
        )
        in_progress = GaugeMetricFamily(
            f"{PREFIX}_engine_calls_in_progress",
            "Dense engine calls not answered yet (queued in the engine's scheduler, or computing).",
            labels=["model"],
        )
        engine_rows = CounterMetricFamily(
            f"{PREFIX}_engine_rows", "Distinct dense rows of the engine calls answered.", labels=["model"]
        )
        prefill = CounterMetricFamily(
            f"{PREFIX}_prefill_tokens",
            "Prompt tokens of dense rows: from the engine's prefix cache, or computed.",
            labels=["model", "source"],
        )
        reused = computed = 0
        for served in self.models.models.values():
            status = served.engine.status() if served.engine is not None else None
            healthy = served.ready and status is not None and status.healthy
            ready.add_metric([served.name], 1.0 if healthy else 0.0)
            if status is not None and status.prefill_tokens is not None:
                prefill.add_metric([served.name, "cached"], status.prefill_tokens[0])
                prefill.add_metric([served.name, "computed"], status.prefill_tokens[1])
                reused += status.prefill_tokens[0]
                computed += status.prefill_tokens[1]
            calls = self.dense.engine_calls.get(served.name)
            if calls is not None:
                in_progress.add_metric([served.name], calls.stats.in_progress)
                engine_rows.add_metric([served.name], calls.stats.engine_rows)
        yield from (ready, in_progress, engine_rows, prefill)
        yield from self._router_load(reused / (reused + computed) if reused + computed else 0.0)

    def _router_load(self, cache_hit_rate: float) -> Iterable[Any]:
        """SGLang's `sglang:num_running_reqs`, `sglang:num_queue_reqs` and `sglang:token_usage`:
        requests reading weights, those of them waiting (a pause, an update), and the share of
        the server's stream slots they fill, the nearest this gateway has to SGLang's share of its
        KV cache in use."""
        running = waiting = 0
        for served in self.models.models.values():
            running += served.weights.running
            waiting += served.weights.waiting
        for name, value, about in (
            ("num_running_reqs", running, "Requests reading a model's weights, not waiting."),
            ("num_queue_reqs", waiting, "Requests waiting (held by a pause, or behind an update)."),
            (
                "token_usage",
                min(1.0, (running + waiting) / self.max_streams),
                "Share of stream slots in use.",
            ),
            ("cache_hit_rate", cache_hit_rate, "Share of dense rows' prompt tokens from the prefix cache."),
        ):
            gauge = GaugeMetricFamily(f"sglang:{name}", about)
            gauge.add_metric([], value)
            yield gauge


def set_labels(scope: Scope, model: str, adapter: str | None) -> None:
    """Called once the request's model is known to exist."""
    scope[LABELS_KEY] = (model, adapter or "")  # type: ignore[literal-required]


def instrument(app: ASGIApp, metrics: Metrics) -> ASGIApp:
    """Wrap the whole app (not Litestar's per-route middleware), so unknown paths count too."""

    async def instrumented(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def observe(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        metrics.in_flight.inc()
        try:
            await app(scope, receive, observe)
        finally:
            metrics.in_flight.dec()
            if scope.get(DISCONNECTED_KEY):
                status = 499  # client closed the request before its response (nginx's code)
            route = scope.get("path_template") or "unmatched"
            model, adapter = scope.get(LABELS_KEY, ("", ""))  # type: ignore[misc]
            metrics.child(metrics.requests, route, scope["method"], model, adapter, str(status)).inc()
            metrics.child(metrics.request_duration, route, model).observe(time.perf_counter() - started)

    return instrumented
