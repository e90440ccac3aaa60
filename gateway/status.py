"""The service's own endpoints: GET /health, GET /metrics, GET /openapi.json."""

from __future__ import annotations

from litestar import Request, Response, get
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.contract.document import build_openapi
from gateway.contract.operation import OPENAPI, TEXT, Operation, Reply
from gateway.requests import registry
from gateway.responses import json_response
from gateway.schemas.models import Health, ModelHealth


@get(
    "/metrics",
    summary="Prometheus metrics",
    description="Prometheus text exposition format.",
    tags=["Operations"],
    opt={OPENAPI: Operation(content={"text/plain": TEXT}, errors=())},
)
async def prometheus_metrics(request: Request) -> Response:
    return Response(content=request.app.state.metrics.expose(), media_type=CONTENT_TYPE_LATEST)


@get(
    "/openapi.json",
    summary="This document",
    description="The OpenAPI document of the running server.",
    tags=["Operations"],
    opt={OPENAPI: Operation(content={"application/json": {"type": "object"}}, errors=())},
)
async def openapi_document(request: Request) -> Response:
    """The document; once every model has loaded, token ids bounded by the largest vocabulary (a
    request naming a smaller model's id beyond its own vocabulary gets a 400)."""
    models = registry(request).models.values()
    sizes = [m.engine.info.vocab_size for m in models if m.ready and m.engine is not None]
    vocab = max(sizes) if sizes and len(sizes) == len(models) else None
    state = request.app.state
    return json_response(build_openapi(state.route_handlers, state.settings, vocab))


@get(
    "/health",
    summary="Readiness",
    description="200 when every model (and its configured adapters) is loaded and healthy; 503 with the "
    "same body otherwise.",
    tags=["Operations"],
    opt={
        OPENAPI: Operation(
            content={"application/json": Health},
            errors=("503",),
            # the health document, not an error object
            replies={"503": Reply("Loading or unhealthy.", {"application/json": Health})},
        )
    },
)
async def health(request: Request) -> Response:
    models = registry(request).models.values()
    healthy = registry(request).healthy
    failed = any(m.error for m in models)
    status = "ok" if healthy else ("unhealthy" if failed else "loading")
    if request.app.state.shutdown.draining:  # out of the load balancer before the listener closes
        status, healthy = "shutting_down", False
    body = Health(
        status=status, models=[ModelHealth(name=m.name, ready=m.ready, error=m.error) for m in models]
    )
    return json_response(body, status_code=200 if healthy else 503)
