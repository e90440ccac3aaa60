"""SGLang's endpoints for an RL trainer: its weights over a collective, and generation paused
around an update (gateway/weight_sync.py). Replacing the weights of a shared service needs the
admin key; `trusted_weight_sync` (a gateway dedicated to one trainer, which sends no key) waives
it. `/get_load` only reads, and needs no more than any other request."""

from __future__ import annotations

from litestar import Request, Response, get, post

from gateway.errors import GatewayError
from gateway.requests import decode_json, registry, settings
from gateway.responses import json_response
from gateway.schemas.weight_sync import (
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    GenerationStatus,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    UpdateWeightsFromDistributedRequest,
    WeightsGroupResponse,
)
from gateway.weights import group as weight_sync
from gateway.weights.routes import base_model, require_admin


def require_weight_sync_access(request: Request) -> None:
    if not settings(request).trusted_weight_sync:
        require_admin(request)


def _failure(exc: GatewayError) -> Response:
    return json_response(
        WeightsGroupResponse(success=False, message=exc.message, error=exc.error_object()), exc.status_code
    )


@post("/init_weights_update_group", status_code=200, summary="Join a trainer's collective (SGLang's)")
async def init_weights_update_group(request: Request) -> Response:
    require_weight_sync_access(request)
    body = await decode_json(request, InitWeightsUpdateGroupRequest)
    try:
        served = base_model(request, body.model)
        config = settings(request)
        group = weight_sync.weights_group(
            body, config.weight_sync_timeout_s, config.weight_sync_max_pending_joins
        )
        await weight_sync.to_the_end(served.join_weights_group(group))
    except GatewayError as exc:
        return _failure(exc)
    return json_response(
        WeightsGroupResponse(success=True, message="Succeeded to initialize custom process group.")
    )


@post(
    "/update_weights_from_distributed",
    status_code=200,
    summary="Receive new weights over a trainer's collective (SGLang's)",
)
async def update_weights_from_distributed(request: Request) -> Response:
    require_weight_sync_access(request)
    body = await decode_json(request, UpdateWeightsFromDistributedRequest)
    try:
        served = base_model(request, body.model)
        tensors = weight_sync.announced_tensors(body)
        await weight_sync.to_the_end(
            served.update_weights_from_group(body.group_name, tensors, body.weight_version)
        )
    except GatewayError as exc:
        return _failure(exc)
    message = "Succeeded to update parameter online."
    if body.weight_version is not None:
        message += f" Weight version updated to {served.weight_version}."
    return json_response(WeightsGroupResponse(success=True, message=message))


@post("/destroy_weights_update_group", status_code=200, summary="Leave a trainer's collective (SGLang's)")
async def destroy_weights_update_group(request: Request) -> Response:
    require_weight_sync_access(request)
    body = await decode_json(request, DestroyWeightsUpdateGroupRequest)
    try:
        served = base_model(request, body.model)
        await weight_sync.to_the_end(served.leave_weights_group(body.group_name))
    except GatewayError as exc:
        return _failure(exc)
    return json_response(
        WeightsGroupResponse(success=True, message="Succeeded to destroy custom process group.")
    )


@post("/pause_generation", status_code=200, summary="Pause generation (SGLang's)")
async def pause_generation(request: Request) -> Response:
    """abort: requests in flight end at their next step; retract, in_place: they are held there
    until /continue_generation. New requests wait either way."""
    require_weight_sync_access(request)
    body = await decode_json(request, PauseGenerationRequest)
    models = list(registry(request).models.values())
    weight_sync.pause(models, body.mode)
    if body.mode == "abort":  # as SGLang, once what was in flight has ended
        await weight_sync.until_stopped(models, settings(request).weight_sync_timeout_s)
    return json_response(GenerationStatus(message="Generation paused successfully."))


@post("/continue_generation", status_code=200, summary="Continue generation (SGLang's)")
async def continue_generation(request: Request) -> Response:
    require_weight_sync_access(request)
    await decode_json(request, ContinueGenerationRequest)
    weight_sync.resume(registry(request).models.values())
    return json_response(GenerationStatus(message="Generation continued successfully."))


@get("/get_load", summary="Requests running and waiting (SGLang's)")
async def get_load(request: Request) -> Response:
    return json_response([weight_sync.load(registry(request).models.values())])
