"""GET /v1/models and GET /health."""

from __future__ import annotations

from typing import Literal

import msgspec


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "logprob-gateway"
    root: str
    parent: str | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None
    backend: str
    ready: bool


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ModelHealth(msgspec.Struct, kw_only=True):
    name: str
    ready: bool
    error: str | None = None


class Health(msgspec.Struct, kw_only=True):
    status: Literal["ok", "loading", "unhealthy"]
    models: list[ModelHealth]
