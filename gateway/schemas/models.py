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
    dtype: str | None = None  # the engine's compute dtype, e.g. "float32"; None while loading
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


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str  # relative to the model's adapters_root, or an absolute path inside it
    model: str | None = None  # the base model; may be omitted when only one is served


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    model: str | None = None


class AdapterStatus(msgspec.Struct, kw_only=True):
    object: Literal["lora_adapter"] = "lora_adapter"
    id: str  # the name clients use: "base:adapter"
    status: Literal["loaded", "unloaded"]
