"""Run-time changes of served models behind the admin key: LoRA adapters (vLLM's endpoint names)
and new weights (SGLang's)."""

from __future__ import annotations

import asyncio

from litestar import Request, Response, post

from gateway.contract.operation import OPENAPI, Operation
from gateway.errors import AuthenticationError, ForbiddenError, GatewayError, InvalidRequestError
from gateway.models.adapter_checks import confine
from gateway.models.adapters import add_adapter, remove_adapter
from gateway.models.served import ServedModel
from gateway.models.weights_root import weights_dir
from gateway.models.weights_update import update_weights
from gateway.requests import access, decode_json, registry, resolve_model, settings
from gateway.responses import json_response
from gateway.schemas.models import (
    AdapterStatus,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
)

ADMIN_ERRORS = ("400", "401", "403", "404", "500", "503")


def require_admin(request: Request) -> None:
    if not settings(request).admin_key:
        raise ForbiddenError("admin endpoints are disabled: no admin key is configured")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not access(request).keyring.is_admin(given.strip()):
        raise AuthenticationError("this endpoint needs the admin key as 'Authorization: Bearer <key>'")


def base_model(request: Request, model: str | None) -> ServedModel:
    models = registry(request).models
    if model is None:
        if len(models) != 1:
            raise InvalidRequestError(f"name the base model: one of {', '.join(models)}", param="model")
        return next(iter(models.values()))
    served, adapter = resolve_model(request, model)
    if adapter is not None:
        raise InvalidRequestError("model must name a base model, not an adapter", param="model")
    return served


@post(
    "/v1/load_lora_adapter",
    status_code=200,
    summary="Load a LoRA adapter (admin)",
    description="Needs `Authorization: Bearer <admin key>`. `lora_path` must lie inside the model's adapters "
    "root; the adapter must be a PEFT LoRA adapter with safetensors weights and a rank within the limit.",
    tags=["Admin"],
    opt={
        OPENAPI: Operation(
            request=LoadLoraAdapterRequest, content={"application/json": AdapterStatus}, errors=ADMIN_ERRORS
        )
    },
)
async def load_lora_adapter(request: Request) -> Response:
    require_admin(request)
    body = await decode_json(request, LoadLoraAdapterRequest)
    served = base_model(request, body.model)
    root = served.settings.adapters_root
    await add_adapter(served, body.lora_name, confine(root, body.lora_path), confined_to=root)
    return json_response(AdapterStatus(id=f"{served.name}:{body.lora_name}", status="loaded"))


@post(
    "/v1/unload_lora_adapter",
    status_code=200,
    summary="Unload a LoRA adapter (admin)",
    description="Needs `Authorization: Bearer <admin key>`.",
    tags=["Admin"],
    opt={
        OPENAPI: Operation(
            request=UnloadLoraAdapterRequest,
            content={"application/json": AdapterStatus},
            errors=(*ADMIN_ERRORS, "429"),
        )
    },
)
async def unload_lora_adapter(request: Request) -> Response:
    require_admin(request)
    body = await decode_json(request, UnloadLoraAdapterRequest)
    served = base_model(request, body.model)
    await remove_adapter(served, body.lora_name, settings(request).limits.weights_update_wait_s)
    return json_response(AdapterStatus(id=f"{served.name}:{body.lora_name}", status="unloaded"))


@post(
    "/update_weights_from_disk",
    status_code=200,
    summary="Load new weights in place (admin; SGLang's)",
    description="Needs `Authorization: Bearer <admin key>`. New weights of the same architecture from a Hugging "
    "Face directory of safetensors weights, without a restart: requests reading the old weights finish on "
    "them first, and the model's output-cache keys change with the weights. Answers SGLang's "
    "`{success, message}`; a failure (400 weights that do not fit, 501 an engine that cannot) adds the "
    "error object. See docs/sglang-clients.md.",
    tags=["Admin"],
    opt={
        OPENAPI: Operation(
            request=UpdateWeightsFromDiskRequest,
            content={"application/json": UpdateWeightsFromDiskResponse},
            errors=("400", "401", "403", "404", "429", "501", "503"),
        )
    },
)
async def update_weights_from_disk(request: Request) -> Response:
    """New weights of the same architecture, without a restart. Requests reading the old weights
    finish on them first; the model's fingerprint, and every output-cache key, changes with them.
    The directory must lie inside the model's `weights_root` (gateway/models/weights_root.py). Answers
    SGLang's {success, message}; a failure (4xx, 501) adds this API's error object."""
    require_admin(request)
    body = await decode_json(request, UpdateWeightsFromDiskRequest)
    try:
        served = base_model(request, body.model)
        if not body.model_path:
            raise InvalidRequestError("model_path must name a directory", param="model_path")
        if body.load_format not in (None, "auto", "safetensors"):
            raise InvalidRequestError(
                f"load_format {body.load_format!r} is not supported: safetensors weights only",
                param="load_format",
            )
        if body.abort_all_requests:
            raise InvalidRequestError(
                "abort_all_requests is not supported: an update waits for the requests in flight",
                param="abort_all_requests",
            )
        path = await asyncio.to_thread(weights_dir, served.settings.weights_root, body.model_path)
        await update_weights(
            served, path, body.weight_version, settings(request).limits.weights_update_wait_s
        )
    except GatewayError as exc:
        return json_response(
            UpdateWeightsFromDiskResponse(success=False, message=exc.message, error=exc.error_object()),
            exc.status_code,
        )
    message = f"Succeeded to update model weights. Weight version updated to {served.weight_version}."
    return json_response(UpdateWeightsFromDiskResponse(success=True, message=message))
