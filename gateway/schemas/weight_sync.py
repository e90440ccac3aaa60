"""SGLang's endpoints for a trainer's weights over a collective, and for pausing generation
around an update (0.5.17, `srt/managers/io_struct.py`; `/get_load` of `srt/entrypoints/http_server.py`).

Field names and defaults are SGLang's; unknown fields are ignored, as SGLang does. This gateway
adds `model` (a served base model; may be omitted when only one is served) and its error object
on failures. gateway/weights/group.py says what each field does here.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from gateway.schemas.common import ModelName, Name

# The dtypes a trainer may announce (torch's names; backends/transformers/weights_collective.py
# maps them).
TensorDtype = Literal[
    "float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"
]
GroupName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Dimension = Annotated[int, msgspec.Meta(ge=0)]
PauseMode = Literal["abort", "retract", "in_place"]


class InitWeightsUpdateGroupRequest(msgspec.Struct, kw_only=True):
    """Join the trainer's group as rank `rank_offset` (rank 0 is the trainer's)."""

    master_address: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    master_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    rank_offset: Annotated[int, msgspec.Meta(ge=1)]  # below world_size
    world_size: Annotated[int, msgspec.Meta(ge=2, le=65536)]
    group_name: GroupName = "weight_update_group"
    backend: Literal["nccl", "gloo"] | None = None  # None: nccl on CUDA, gloo on the CPU
    model: ModelName | None = None


class UpdateWeightsFromDistributedRequest(msgspec.Struct, kw_only=True):
    """Tensors the trainer broadcasts from rank 0, one per name, in this order."""

    names: Annotated[list[Annotated[str, msgspec.Meta(max_length=1024)]], msgspec.Meta(min_length=1)]
    dtypes: Annotated[list[TensorDtype], msgspec.Meta(min_length=1)]  # one per name
    shapes: Annotated[list[list[Dimension]], msgspec.Meta(min_length=1)]  # one per name
    group_name: GroupName = "weight_update_group"
    flush_cache: bool = True  # caches are flushed on every update either way
    abort_all_requests: bool = False  # true is refused: pause in abort mode first
    weight_version: Name | None = None  # what to call the new weights; default: the update's count
    load_format: None = None  # SGLang's flattened buckets are not supported
    torch_empty_cache: bool = False
    model: ModelName | None = None


class DestroyWeightsUpdateGroupRequest(msgspec.Struct, kw_only=True):
    group_name: GroupName = "weight_update_group"
    model: ModelName | None = None


class WeightsGroupResponse(msgspec.Struct, kw_only=True):
    """SGLang's answer, success or failure; a failure also carries this API's `error` object."""

    success: bool
    message: str
    error: dict[str, str | None] | None = None


class PauseGenerationRequest(msgspec.Struct, kw_only=True):
    mode: PauseMode = "abort"


class ContinueGenerationRequest(msgspec.Struct, kw_only=True):
    torch_empty_cache: bool = True  # accepted; the engines keep their memory either way


class GenerationStatus(msgspec.Struct, kw_only=True):
    """SGLang's answer to /pause_generation and /continue_generation."""

    message: str
    status: Literal["ok"] = "ok"


class Load(msgspec.Struct, kw_only=True):
    """One entry of SGLang's /get_load: requests running (`num_reqs - num_waiting_reqs`, what
    TorchRL waits to see at 0) and waiting (held by a pause, or behind an update)."""

    dp_rank: int = 0
    num_reqs: int
    num_waiting_reqs: int
    num_tokens: int = 0  # SGLang's KV pool: none here
    num_pending_tokens: int = 0
    ts_tic: float
