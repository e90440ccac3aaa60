"""GET /v1/models, GET /v1/models/{model}: the served models and their adapters, as OpenAI lists them."""

from __future__ import annotations

import msgspec
from litestar import Request, Response, get

from gateway.contract.operation import OPENAPI, Operation
from gateway.models.served import AdapterInfo, ServedModel
from gateway.requests import registry, resolve_model
from gateway.responses import json_response
from gateway.schemas.models import ModelCard, ModelList


def _card(served: ServedModel) -> ModelCard:
    engine = served.engine
    return ModelCard(
        id=served.name,
        created=served.created,
        root=engine.info.path if engine else served.settings.model,
        max_model_len=engine.info.max_model_len if engine else None,
        vocab_size=engine.info.vocab_size if engine else None,
        dtype=engine.info.dtype if engine else None,
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


@get(
    "/v1/models",
    summary="List models",
    description="Served base models and their adapters (`base:adapter`).",
    tags=["OpenAI"],
    opt={OPENAPI: Operation(content={"application/json": ModelList}, errors=("500",))},
)
async def list_models(request: Request) -> Response:
    cards = []
    for served in registry(request).models.values():
        cards.append(_card(served))
        cards.extend(_adapter_card(served, a) for a in served.adapters.values())
    return json_response(ModelList(data=cards))


@get(
    "/v1/models/{model:str}",
    summary="Describe a model",
    description="One served model or adapter.",
    tags=["OpenAI"],
    opt={OPENAPI: Operation(content={"application/json": ModelCard}, errors=("404", "500"))},
)
async def retrieve_model(request: Request, model: str) -> Response:
    served, adapter = resolve_model(request, model)
    return json_response(
        _card(served) if adapter is None else _adapter_card(served, served.adapters[adapter])
    )
