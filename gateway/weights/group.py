"""A trainer's weights over a collective, and generation paused around an update: SGLang's
endpoints for on-policy RL (TorchRL's `SGLangWeightSyncScheme`) on the served models.

The trainer forms a torch.distributed group and asks the gateway to join it
(`/init_weights_update_group`); each update, it pauses generation (`/pause_generation`), waits
for `/get_load` to report nothing running, announces the tensors
(`/update_weights_from_distributed`) while it broadcasts them, and resumes (`/continue_generation`).
The engine joins and receives (backends/transformers/weights_collective.py for the transformers
engine); the model's `WeightsLock` keeps requests and the update apart
(gateway/models/weights_lock.py); the update changes the model's fingerprint and version as a
load from disk does (gateway/models/weights_update.py).

Operations that talk to the trainer run to their end even if the HTTP client goes away
(gateway/models/to_the_end.py): the trainer is broadcasting into them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

from backends.types import AnnouncedTensor, WeightsGroup
from gateway.errors import InvalidRequestError
from gateway.models.served import ServedModel
from gateway.schemas.weight_sync import (
    InitWeightsUpdateGroupRequest,
    Load,
    PauseMode,
    UpdateWeightsFromDistributedRequest,
)

log = logging.getLogger(__name__)


def weights_group(
    body: InitWeightsUpdateGroupRequest, timeout_s: float, max_pending_joins: int
) -> WeightsGroup:
    if body.rank_offset >= body.world_size:
        raise InvalidRequestError(
            f"rank_offset {body.rank_offset} is not a rank of a group of {body.world_size}: "
            "the gateway's rank must be below world_size",
            param="rank_offset",
        )
    if "\0" in body.master_address or "/" in body.master_address:
        raise InvalidRequestError(
            "master_address must be a host name or an IP address", param="master_address"
        )
    return WeightsGroup(
        name=body.group_name,
        master_address=body.master_address,
        master_port=body.master_port,
        rank=body.rank_offset,  # one engine worker: rank_offset + 0
        world_size=body.world_size,
        backend=body.backend,
        timeout_s=timeout_s,
        max_pending_joins=max_pending_joins,
    )


def announced_tensors(body: UpdateWeightsFromDistributedRequest) -> list[AnnouncedTensor]:
    """The announcement as tensors; refused before anything is received when it is malformed."""
    lengths = {"names": len(body.names), "dtypes": len(body.dtypes), "shapes": len(body.shapes)}
    if len(set(lengths.values())) > 1:
        counts = ", ".join(f"{n} {field}" for field, n in lengths.items())
        raise InvalidRequestError(
            f"names, dtypes and shapes must have one entry per tensor: {counts}", param="dtypes"
        )
    if body.abort_all_requests:
        raise InvalidRequestError(
            "abort_all_requests is not supported: pause generation with mode abort first",
            param="abort_all_requests",
        )
    return [
        AnnouncedTensor(name, dtype, tuple(shape))
        for name, dtype, shape in zip(body.names, body.dtypes, body.shapes, strict=True)
    ]


def pause(models: Iterable[ServedModel], mode: PauseMode) -> None:
    for served in models:
        served.weights.pause(mode)
    log.info("generation paused (%s)", mode)


def resume(models: Iterable[ServedModel]) -> None:
    for served in models:
        served.weights.resume()
    log.info("generation continued")


def load(models: Iterable[ServedModel]) -> Load:
    """Requests reading weights now, over every model: running, and waiting (at a pause or
    behind an update)."""
    running = waiting = 0
    for served in models:
        running += served.weights.running
        waiting += served.weights.waiting
    return Load(num_reqs=running + waiting, num_waiting_reqs=waiting, ts_tic=time.perf_counter())


async def until_stopped(models: list[ServedModel], timeout_s: float) -> None:
    """Wait (at most `timeout_s`) until no request runs on the weights: after a pause, generated
    choices end (abort) or are held (retract, in_place) at their next step, and dense requests
    finish."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(served.weights.until_idle() for served in models)), timeout_s)
