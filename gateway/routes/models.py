"""GET /v1/models, GET /v1/models/{model}, GET /health, GET /metrics."""

from __future__ import annotations

import msgspec
from litestar import Request, Response, get
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.http import json_response, registry, resolve_model
from gateway.openapi import build_openapi
from gateway.registry import AdapterInfo, ServedModel
from gateway.schemas.models import Health, ModelCard, ModelHealth, ModelList


def _card(served: ServedModel) -> ModelCard:
    engine = served.engine
    return ModelCard(
        id=served.name,
        created=served.created,
        root=engine.model_path if engine else served.settings.model,
        max_model_len=engine.max_model_len if engine else None,
        vocab_size=engine.vocab_size if engine else None,
        dtype=engine.dtype if engine else None,
        backend=served.settings.backend,
        ready=served.ready,
    )


def _adapter_card(served: ServedModel, adapter: AdapterInfo) -> ModelCard:
    return msgspec.structs.replace(
        _card(served),
        id=f"{served.name}:{adapter.name}",
        created=adapter.created,
        root=adapter.path,
        parent=served.name,
    )


@get("/v1/models", summary="List the served models and their adapters")
async def list_models(request: Request) -> Response:
    cards = []
    for served in registry(request).models.values():
        cards.append(_card(served))
        cards.extend(_adapter_card(served, a) for a in served.adapters.values())
    return json_response(ModelList(data=cards))


@get("/v1/models/{model:str}", summary="Describe one served model or adapter")
async def retrieve_model(request: Request, model: str) -> Response:
    served, adapter = resolve_model(request, model)
    return json_response(
        _card(served) if adapter is None else _adapter_card(served, served.adapters[adapter])
    )


@get("/metrics", summary="Prometheus metrics (text exposition format)")
async def prometheus_metrics(request: Request) -> Response:
    return Response(content=request.app.state.metrics.expose(), media_type=CONTENT_TYPE_LATEST)


@get("/openapi.json", summary="The OpenAPI document of this server")
async def openapi_document(request: Request) -> Response:
    """The document; once every model has loaded, token ids bounded by the largest vocabulary (a
    request naming a smaller model's id beyond its own vocabulary gets a 400)."""
    models = registry(request).models.values()
    sizes = [m.engine.vocab_size for m in models if m.ready and m.engine is not None]
    vocab = max(sizes) if sizes and len(sizes) == len(models) else None
    return json_response(build_openapi(request.app.state.settings, vocab))


@get("/health", summary="200 when every model is loaded and healthy, else 503")
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
