"""Run-time LoRA adapter management (vLLM's endpoint names), behind the admin key."""

from __future__ import annotations

from litestar import Request, Response, post

from gateway.adapters import confine
from gateway.errors import AuthenticationError, ForbiddenError, InvalidRequestError
from gateway.http import access, decode_json, json_response, registry, resolve_model, settings
from gateway.registry import ServedModel
from gateway.schemas.models import AdapterStatus, LoadLoraAdapterRequest, UnloadLoraAdapterRequest


def require_admin(request: Request) -> None:
    if not settings(request).admin_key:
        raise ForbiddenError("admin endpoints are disabled: no admin key is configured")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not access(request).keyring.is_admin(given.strip()):
        raise AuthenticationError("this endpoint needs the admin key as 'Authorization: Bearer <key>'")


def _base_model(request: Request, model: str | None) -> ServedModel:
    models = registry(request).models
    if model is None:
        if len(models) != 1:
            raise InvalidRequestError(f"name the base model: one of {', '.join(models)}", param="model")
        return next(iter(models.values()))
    served, adapter = resolve_model(request, model)
    if adapter is not None:
        raise InvalidRequestError("model must name a base model, not an adapter", param="model")
    return served


@post("/v1/load_lora_adapter", status_code=200, summary="Load a LoRA adapter (admin)")
async def load_lora_adapter(request: Request) -> Response:
    require_admin(request)
    body = await decode_json(request, LoadLoraAdapterRequest)
    served = _base_model(request, body.model)
    root = served.settings.adapters_root
    await served.add_adapter(body.lora_name, confine(root, body.lora_path), confined_to=root)
    return json_response(AdapterStatus(id=f"{served.name}:{body.lora_name}", status="loaded"))


@post("/v1/unload_lora_adapter", status_code=200, summary="Unload a LoRA adapter (admin)")
async def unload_lora_adapter(request: Request) -> Response:
    require_admin(request)
    body = await decode_json(request, UnloadLoraAdapterRequest)
    served = _base_model(request, body.model)
    await served.remove_adapter(body.lora_name)
    return json_response(AdapterStatus(id=f"{served.name}:{body.lora_name}", status="unloaded"))
