"""The OpenAPI operations of an RL trainer's endpoints (gateway/routes/weight_sync.py)."""

from __future__ import annotations

from gateway.openapi.operation import Operation, schema_ref
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

ACCESS = (
    "Needs `Authorization: Bearer <admin key>`, unless the gateway is configured with "
    "`trusted_weight_sync` (a gateway dedicated to one trainer). "
)
GROUP_ERRORS = ("400", "401", "403", "404", "501", "503")
TAGS = ("RL weight sync",)

WEIGHT_SYNC_OPERATIONS = [
    Operation(
        "post",
        "/init_weights_update_group",
        "Join a trainer's collective (SGLang's)",
        ACCESS + "The engine joins the trainer's torch.distributed group (TCP rendezvous at "
        "`master_address:master_port`, no default group) as rank `rank_offset`, and answers once every rank "
        "has joined. `backend`: nccl (CUDA) or gloo (CPU); by default the engine's device decides. Answers "
        "SGLang's `{success, message}`; a failure adds the error object. See docs/sglang-clients.md.",
        InitWeightsUpdateGroupRequest,
        {"application/json": schema_ref(WeightsGroupResponse)},
        errors=GROUP_ERRORS,
        example={
            "master_address": "10.0.0.5",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "weight_update_group_1a2b3c4d",
        },
        tags=TAGS,
    ),
    Operation(
        "post",
        "/update_weights_from_distributed",
        "Receive new weights over a trainer's collective (SGLang's)",
        ACCESS + "The trainer broadcasts one tensor per name from rank 0, in this order, while the request "
        "is under way. All are received before any parameter changes; floating-point tensors are converted to "
        "the parameter's dtype. Announced tensors that do not fit the model (a name it lacks, another shape, "
        "a non-floating dtype) are still received, then refused with a 400: nothing changes. Requests reading "
        "the old weights (unless held by a pause) finish first; the model's output-cache keys change with the "
        "weights.",
        UpdateWeightsFromDistributedRequest,
        {"application/json": schema_ref(WeightsGroupResponse)},
        errors=GROUP_ERRORS,
        example={
            "names": ["model.layers.0.mlp.down_proj.weight"],
            "dtypes": ["float32"],
            "shapes": [[576, 1536]],
            "group_name": "weight_update_group_1a2b3c4d",
            "flush_cache": False,
            "abort_all_requests": False,
        },
        tags=TAGS,
    ),
    Operation(
        "post",
        "/destroy_weights_update_group",
        "Leave a trainer's collective (SGLang's)",
        ACCESS + "The engine leaves the group.",
        DestroyWeightsUpdateGroupRequest,
        {"application/json": schema_ref(WeightsGroupResponse)},
        errors=GROUP_ERRORS,
        tags=TAGS,
    ),
    Operation(
        "post",
        "/pause_generation",
        "Pause generation (SGLang's)",
        ACCESS + "Every model: `abort` ends the generations in flight at their next step (finish reason "
        "`abort`) and answers once they have ended; `retract` and `in_place` hold them there until "
        "`/continue_generation`, and an update may go ahead meanwhile. New requests wait until then.",
        PauseGenerationRequest,
        {"application/json": schema_ref(GenerationStatus)},
        errors=("400", "403"),
        example={"mode": "retract"},
        tags=TAGS,
    ),
    Operation(
        "post",
        "/continue_generation",
        "Continue generation (SGLang's)",
        ACCESS + "Held and waiting requests go on, on the weights the model then has.",
        ContinueGenerationRequest,
        {"application/json": schema_ref(GenerationStatus)},
        errors=("400", "403"),
        example={"torch_empty_cache": True},
        tags=TAGS,
    ),
    Operation(
        "get",
        "/get_load",
        "Requests running and waiting (SGLang's)",
        "One entry for the server: `num_reqs` requests reading weights, of which `num_waiting_reqs` are held "
        "by a pause or wait for an update; a trainer waits for the difference to be 0 before it updates.",
        responses={
            "application/json": {"type": "array", "items": schema_ref(Load), "minItems": 1, "maxItems": 1}
        },
        errors=(),
        tags=TAGS,
    ),
]

RESPONSE_TYPES = [WeightsGroupResponse, GenerationStatus, Load]
