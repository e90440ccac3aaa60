"""SGLang's endpoints for an RL trainer: its weights over a collective, and generation paused
around an update (gateway/weights/group.py). Replacing the weights of a shared service needs the
admin key; `trusted_weight_sync` (a gateway dedicated to one trainer, which sends no key) waives
it. `/get_load` only reads, and needs no more than any other request."""

from __future__ import annotations

from typing import Annotated

from litestar import Request, Response, get, post
from msgspec import Meta

from gateway.contract.operation import OPENAPI, Operation
from gateway.errors import GatewayError
from gateway.models.to_the_end import to_the_end
from gateway.models.weights_update import join_weights_group, leave_weights_group, update_weights_from_group
from gateway.requests import decode_json, registry, settings
from gateway.responses import json_response
from gateway.schemas.weight_sync import (
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    GenerationStatus,
    InitWeightsUpdateGroupRequest,
    Load,
    PauseGenerationRequest,
    UpdateWeightsFromDistributedRequest,
    WeightsGroupResponse,
)
from gateway.weights import group as weight_sync
from gateway.weights.routes import base_model, require_admin

ACCESS = (
    "Needs `Authorization: Bearer <admin key>`, unless the gateway is configured with "
    "`trusted_weight_sync` (a gateway dedicated to one trainer). "
)
TAGS = ["RL weight sync"]
GROUP_ERRORS = ("400", "401", "403", "404", "501", "503")
GROUP_ANSWER = {"application/json": WeightsGroupResponse}
GENERATION_ANSWER = {"application/json": GenerationStatus}


def require_weight_sync_access(request: Request) -> None:
    if not settings(request).trusted_weight_sync:
        require_admin(request)


def _failure(exc: GatewayError) -> Response:
    return json_response(
        WeightsGroupResponse(success=False, message=exc.message, error=exc.error_object()), exc.status_code
    )


@post(
    "/init_weights_update_group",
    status_code=200,
    summary="Join a trainer's collective (SGLang's)",
    description=ACCESS + "The engine joins the trainer's torch.distributed group (TCP rendezvous at "
    "`master_address:master_port`, no default group) as rank `rank_offset`, and answers once every rank "
    "has joined. `backend`: nccl (CUDA) or gloo (CPU); by default the engine's device decides. Answers "
    "SGLang's `{success, message}`; a failure adds the error object. See docs/sglang-clients.md.",
    tags=TAGS,
    opt={
        OPENAPI: Operation(
            request=InitWeightsUpdateGroupRequest,
            content=GROUP_ANSWER,
            errors=GROUP_ERRORS,
            example={
                "master_address": "10.0.0.5",
                "master_port": 29500,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": "weight_update_group_1a2b3c4d",
            },
        )
    },
)
async def init_weights_update_group(request: Request) -> Response:
    require_weight_sync_access(request)
    body = await decode_json(request, InitWeightsUpdateGroupRequest)
    try:
        served = base_model(request, body.model)
        config = settings(request)
        group = weight_sync.weights_group(
            body, config.weight_sync_timeout_s, config.weight_sync_max_pending_joins
        )
        await to_the_end(join_weights_group(served, group))
    except GatewayError as exc:
        return _failure(exc)
    return json_response(
        WeightsGroupResponse(success=True, message="Succeeded to initialize custom process group.")
    )


@post(
    "/update_weights_from_distributed",
    status_code=200,
    summary="Receive new weights over a trainer's collective (SGLang's)",
    description=ACCESS + "The trainer broadcasts one tensor per name from rank 0, in this order, while the "
    "request is under way. All are received before any parameter changes; floating-point tensors are "
    "converted to the parameter's dtype. Announced tensors that do not fit the model (a name it lacks, "
    "another shape, a non-floating dtype) are still received, then refused with a 400: nothing changes. "
    "Requests reading the old weights (unless held by a pause) finish first; the model's output-cache keys "
    "change with the weights.",
    tags=TAGS,
    opt={
        OPENAPI: Operation(
            request=UpdateWeightsFromDistributedRequest,
            content=GROUP_ANSWER,
            errors=GROUP_ERRORS,
            example={
                "names": ["model.layers.0.mlp.down_proj.weight"],
                "dtypes": ["float32"],
                "shapes": [[576, 1536]],
                "group_name": "weight_update_group_1a2b3c4d",
                "flush_cache": False,
                "abort_all_requests": False,
            },
        )
    },
)
async def update_weights_from_distributed(request: Request) -> Response:
    require_weight_sync_access(request)
    body = await decode_json(request, UpdateWeightsFromDistributedRequest)
    try:
        served = base_model(request, body.model)
        tensors = weight_sync.announced_tensors(body)
        await to_the_end(update_weights_from_group(served, body.group_name, tensors, body.weight_version))
    except GatewayError as exc:
        return _failure(exc)
    message = "Succeeded to update parameter online."
    if body.weight_version is not None:
        message += f" Weight version updated to {served.weight_version}."
    return json_response(WeightsGroupResponse(success=True, message=message))


@post(
    "/destroy_weights_update_group",
    status_code=200,
    summary="Leave a trainer's collective (SGLang's)",
    description=ACCESS + "The engine leaves the group.",
    tags=TAGS,
    opt={
        OPENAPI: Operation(
            request=DestroyWeightsUpdateGroupRequest, content=GROUP_ANSWER, errors=GROUP_ERRORS
        )
    },
)
async def destroy_weights_update_group(request: Request) -> Response:
    require_weight_sync_access(request)
    body = await decode_json(request, DestroyWeightsUpdateGroupRequest)
    try:
        served = base_model(request, body.model)
        await to_the_end(leave_weights_group(served, body.group_name))
    except GatewayError as exc:
        return _failure(exc)
    return json_response(
        WeightsGroupResponse(success=True, message="Succeeded to destroy custom process group.")
    )


@post(
    "/pause_generation",
    status_code=200,
    summary="Pause generation (SGLang's)",
    description=ACCESS + "Every model: `abort` ends the generations in flight at their next step (finish "
    "reason `abort`); `retract` and `in_place` hold them there until `/continue_generation`, and an "
    "update may go ahead meanwhile. Answers once nothing runs (generations ended or held, dense calls "
    "done), at most `weight_sync_timeout_s`, so a trainer's first `/get_load` finds nothing running; "
    "in `retract` and `in_place` mode at once where an engine's streams are not held (vLLM, SGLang: "
    "they run to their end). New requests wait until `/continue_generation`.",
    tags=TAGS,
    opt={
        OPENAPI: Operation(
            request=PauseGenerationRequest,
            content=GENERATION_ANSWER,
            errors=("400", "403"),
            example={"mode": "retract"},
        )
    },
)
async def pause_generation(request: Request) -> Response:
    """abort: requests in flight end at their next step; retract, in_place: they are held there
    until /continue_generation. New requests wait either way. Answered once nothing runs where
    streams are held: SGLang answers a retract before its running step drains, and TorchRL then
    sleeps a poll interval before its next /get_load."""
    require_weight_sync_access(request)
    body = await decode_json(request, PauseGenerationRequest)
    models = list(registry(request).models.values())
    weight_sync.pause(models, body.mode)
    # Held streams stop at their next step; an engine that generates ahead (vLLM, SGLang) holds
    # none, and waiting for its streams to end is the trainer's to do, by /get_load.
    if body.mode == "abort" or all(served.weights.hold_at_steps for served in models):
        await weight_sync.until_stopped(models, settings(request).weight_sync_timeout_s)
    return json_response(GenerationStatus(message="Generation paused successfully."))


@post(
    "/continue_generation",
    status_code=200,
    summary="Continue generation (SGLang's)",
    description=ACCESS + "Held and waiting requests go on, on the weights the model then has.",
    tags=TAGS,
    opt={
        OPENAPI: Operation(
            request=ContinueGenerationRequest,
            content=GENERATION_ANSWER,
            errors=("400", "403"),
            example={"torch_empty_cache": True},
        )
    },
)
async def continue_generation(request: Request) -> Response:
    require_weight_sync_access(request)
    await decode_json(request, ContinueGenerationRequest)
    weight_sync.resume(registry(request).models.values())
    return json_response(GenerationStatus(message="Generation continued successfully."))


@get(
    "/get_load",
    summary="Requests running and waiting (SGLang's)",
    description="One entry for the server: `num_reqs` requests reading weights, of which `num_waiting_reqs` "
    "are held by a pause or wait for an update; a trainer waits for the difference to be 0 before it "
    "updates.",
    tags=TAGS,
    opt={
        OPENAPI: Operation(
            content={"application/json": Annotated[list[Load], Meta(min_length=1, max_length=1)]}, errors=()
        )
    },
)
async def get_load(request: Request) -> Response:
    return json_response([weight_sync.load(registry(request).models.values())])
