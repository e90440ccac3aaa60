"""The application factory: routes, error handlers, and the models' lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Callable, Iterable
from types import ModuleType

from litestar import Litestar
from litestar.datastructures import State
from litestar.handlers import HTTPRouteHandler
from litestar.types import ASGIApp

from gateway import status
from gateway.access import Access, KeyRing
from gateway.dense import routes as dense_routes
from gateway.dense import vocabulary as dense_vocabulary
from gateway.dense.local_socket import LocalSocketServer
from gateway.dense.row_cache import build_cache
from gateway.dense.service import DenseService
from gateway.dense.shared_memory import SharedMemoryWriter
from gateway.errors import EXCEPTION_HANDLERS
from gateway.guard import guard
from gateway.metrics import Metrics, StateCollector, instrument
from gateway.models.registry import ModelRegistry
from gateway.openai import chat, completions, models, responses
from gateway.server.shutdown import Shutdown
from gateway.settings import Settings
from gateway.sglang_api import routes as sglang_routes
from gateway.weights import group_routes
from gateway.weights import routes as weights_routes

log = logging.getLogger(__name__)

# The feature modules whose route handlers the app serves, and the OpenAPI document describes
# (gateway/contract/document.py): adding an endpoint is writing its handler in one of them.
ROUTE_MODULES: tuple[ModuleType, ...] = (
    completions,
    chat,
    responses,
    dense_routes,
    models,
    dense_vocabulary,
    weights_routes,
    sglang_routes,
    group_routes,
    status,
)


def route_handlers(modules: Iterable[ModuleType]) -> list[HTTPRouteHandler]:
    """Every Litestar route handler defined at the top level of `modules`, in their order."""
    return [
        handler
        for module in modules
        for handler in vars(module).values()
        if isinstance(handler, HTTPRouteHandler) and handler.fn.__module__ == module.__name__
    ]


ROUTE_HANDLERS = route_handlers(ROUTE_MODULES)


def create_app(
    settings: Settings,
    registry: ModelRegistry | None = None,
    *,
    on_loaded: Callable[[], None] | None = None,
    on_load_failed: Callable[[dict[str, str]], None] | None = None,
) -> Litestar:
    """Build the app. Models load in the background after start-up, so /health can say "loading"
    while they do; requests for a model that is not ready get a 503. Once every model has loaded,
    `on_loaded` runs (the serving process tunes itself then); once every model has been tried and
    some failed, `on_load_failed` runs instead with their errors by name (the serving process
    exits), and without it they stay failed, answering 503."""
    metrics = Metrics()
    registry = registry or ModelRegistry(settings.models, metrics)
    access = Access(KeyRing.from_settings(settings), settings.limits)
    shared_memory = SharedMemoryWriter() if settings.shared_memory and sys.platform == "linux" else None
    dense = DenseService(metrics, shared_memory)
    metrics.registry.register(StateCollector(registry, dense, settings.limits.max_streams))
    state = State(
        {
            "settings": settings,
            "route_handlers": ROUTE_HANDLERS,  # what the app serves, for its OpenAPI document
            "registry": registry,
            "dense": dense,
            "metrics": metrics,
            "access": access,
            "shutdown": Shutdown(),
            "local_socket": None,  # a LocalSocketServer once it listens
        }
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        dense.cache = build_cache(settings.cache, metrics, dense.quiet)
        if shared_memory is not None and settings.local_socket:
            local = LocalSocketServer(dense, registry, access, settings.limits, metrics, state.shutdown)
            try:
                log.info("dense rows for clients on this host also at %s", await local.start())
                state.local_socket = local
            except OSError as exc:  # no writable temporary directory: HTTP serves them all
                log.warning("no local socket (%s); same-host clients use HTTP", exc)
        loading = asyncio.create_task(_load(registry, on_loaded, on_load_failed))
        try:
            yield
        finally:
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
            if state.local_socket is not None:
                await state.local_socket.aclose()
            await dense.aclose()
            await registry.aclose()

    return Litestar(
        route_handlers=ROUTE_HANDLERS,
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[lifespan],
        state=state,
        openapi_config=None,
        logging_config=None,
        request_max_body_size=settings.limits.max_body_bytes,
    )


async def _load(
    registry: ModelRegistry,
    on_loaded: Callable[[], None] | None,
    on_load_failed: Callable[[dict[str, str]], None] | None,
) -> None:
    await registry.load_all()
    failures = {m.name: m.error for m in registry.models.values() if m.error is not None}
    if failures and on_load_failed is not None:
        on_load_failed(failures)
    elif on_loaded is not None:
        on_loaded()


def serving_app(
    settings: Settings,
    *,
    on_loaded: Callable[[], None] | None = None,
    on_load_failed: Callable[[dict[str, str]], None] | None = None,
) -> tuple[Litestar, ASGIApp]:
    """The app, and what the server runs: the app inside the key/limit/disconnect guard, inside
    the metrics wrapper (so refused and unknown requests are counted too)."""
    app = create_app(settings, on_loaded=on_loaded, on_load_failed=on_load_failed)
    guarded = guard(app, app.state.access, app.state.shutdown, metrics_public=settings.metrics_public)
    return app, instrument(guarded, app.state.metrics)
