"""GET /v1/models and GET /health."""

from __future__ import annotations

from typing import Literal

import msgspec

from gateway.schemas.common import FilePath, ModelName, Name


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
    status: Literal["ok", "loading", "unhealthy", "shutting_down"]
    models: list[ModelHealth]


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: Name
    lora_path: FilePath  # relative to the model's adapters_root, or an absolute path inside it
    model: ModelName | None = None  # the base model; may be omitted when only one is served


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: Name
    model: ModelName | None = None


class UpdateWeightsFromDiskRequest(msgspec.Struct, kw_only=True):
    """SGLang's request (`UpdateWeightFromDiskReqInput`), the fields that apply here."""

    model_path: FilePath  # a Hugging Face directory: config.json and safetensors weights
    load_format: Name | None = None  # None, "auto" or "safetensors"
    weight_version: Name | None = None  # what to call the new weights; default: the update's count
    flush_cache: bool = True  # the output cache's keys change with the weights either way
    abort_all_requests: bool = False  # requests reading the old weights are waited for, not aborted
    model: ModelName | None = None  # the base model; may be omitted when only one is served


class UpdateWeightsFromDiskResponse(msgspec.Struct, kw_only=True):
    """SGLang's answer, success or failure; a failure also carries this API's `error` object."""

    success: bool
    message: str
    num_paused_requests: int = 0
    error: dict[str, str | None] | None = None


class AdapterStatus(msgspec.Struct, kw_only=True):
    object: Literal["lora_adapter"] = "lora_adapter"
    id: str  # the name clients use: "base:adapter"
    status: Literal["loaded", "unloaded"]
