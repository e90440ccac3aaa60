"""New weights for the SGLang engine through SGLang's own calls: `update_weights_from_disk`, and a
trainer's collective with `init_weights_update_group`, `update_weights_from_distributed` and
`destroy_weights_update_group` (in process: the tokenizer manager's methods; otherwise SGLang's
HTTP endpoints of the same names). SGLang's refusal (`success: false`) is a WeightsError with
SGLang's message.

Every update asks SGLang to flush its cache (`flush_cache=True`): its radix cache holds prefix
keys/values of the old weights. SGLang's scheduler asserts that the flush succeeded, which it
does only when the scheduler is fully idle, and a failed assert ends the scheduler. Two locks
make it idle: the gateway's `WeightsLock` lets the update in once no request of the gateway reads
the weights, and SGLang's tokenizer manager takes its own writer lock (its requests in flight
drained) unless SGLang itself is paused. So SGLang's own `/pause_generation` (in_place, retract)
must never be combined with these calls; the gateway's pause never reaches SGLang.

SGLang forms the group the way backends/transformers/weights_collective.py does (a TCP rendezvous, no default
group), but in its scheduler, which serves nothing while it waits: a join or a broadcast bounded
by SGLang's process-group timeout, not the gateway's. A join is answered at the group's timeout
here all the same; SGLang's late success is then undone. SGLang asserts that an update's group
exists (a failed assert ends its scheduler), so only groups joined here are named to it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

from backends import engine as contract
from backends.device_tensors import pickled
from backends.errors import WeightsError, WeightsGroupError
from backends.sglang.transport import Transport
from backends.types import AnnouncedTensor, WeightsGroup

log = logging.getLogger(__name__)


class HasTransport(Protocol):
    transport: Transport
    model_path: str


async def _call(transport: Transport, name: str, body: dict[str, Any]) -> str:
    """SGLang's answer's message; WeightsError with it when SGLang answers `success: false`."""
    success, message = await transport.weights_call(name, body)
    if not success:
        raise WeightsError(message)
    return message


class SglangCollective(contract.Collective):
    """The groups this engine joined through SGLang, by name; one update or leave at a time each."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._groups: set[str] = set()
        self._joining: set[str] = set()  # until SGLang answers, given up on or not
        self._busy: dict[str, asyncio.Lock] = {}
        self._pending: set[asyncio.Future[Any]] = set()  # joins and leaves nobody awaits

    async def join(self, group: WeightsGroup) -> None:
        if group.name in self._groups or group.name in self._joining:
            raise WeightsGroupError(
                f"a weights update group named {group.name!r} exists already; destroy it first"
            )
        if len(self._joining) >= group.max_pending_joins:
            raise WeightsError(
                f"{len(self._joining)} joins still wait for SGLang's answer; try again once they have one"
            )
        body = {
            "master_address": group.master_address,
            "master_port": group.master_port,
            "rank_offset": group.rank,  # SGLang's rank is rank_offset + its tensor-parallel rank
            "world_size": group.world_size,
            "group_name": group.name,
            "backend": group.backend or "nccl",  # SGLang runs on CUDA
        }
        self._joining.add(group.name)
        joined = asyncio.ensure_future(_call(self.transport, "init_weights_update_group", body))
        self._pending.add(joined)
        given_up = False

        def settle(future: asyncio.Future[str]) -> None:  # on the loop, whether or not anyone waits
            self._pending.discard(future)
            self._joining.discard(group.name)
            formed = not future.cancelled() and future.exception() is None
            if formed and given_up:  # its caller was told it failed: the trainer must not count on it
                leaving = asyncio.ensure_future(self._destroy(group.name, quietly=True))
                self._pending.add(leaving)
                leaving.add_done_callback(self._pending.discard)
            elif formed:
                self._groups.add(group.name)

        joined.add_done_callback(settle)
        try:
            await asyncio.wait_for(asyncio.shield(joined), group.timeout_s)
        except TimeoutError:
            given_up = True
            raise WeightsError(
                "Failed to initialize custom process group: not every rank joined within "
                f"{group.timeout_s:g} s"
            ) from None
        log.info(
            "joined a weights update group through SGLang as rank %d of %d", group.rank, group.world_size
        )

    def _group(self, name: str) -> None:
        if name not in self._groups:
            joining = " (still joining)" if name in self._joining else ""
            raise WeightsGroupError(
                f"no weights update group named {name!r}{joining}; call /init_weights_update_group first"
            )

    async def receive(self, group_name: str, tensors: Sequence[AnnouncedTensor]) -> None:
        self._group(group_name)
        if not tensors:
            raise WeightsError("an update announces no tensors")
        body = {
            "names": [t.name for t in tensors],
            "dtypes": [t.dtype for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": group_name,
            "flush_cache": True,  # prefix keys/values of the old weights must go
        }
        async with self._busy.setdefault(group_name, asyncio.Lock()):
            self._group(group_name)  # it may have been left meanwhile
            await _call(self.transport, "update_weights_from_distributed", body)

    def _known(self, name: str) -> None:
        if name not in self._groups:
            raise WeightsGroupError(f"The group to be destroyed does not exist: {name!r}.")

    async def leave(self, group_name: str) -> None:
        self._known(group_name)
        async with self._busy.setdefault(group_name, asyncio.Lock()):
            self._known(group_name)  # it may have been left meanwhile
            self._groups.discard(group_name)  # SGLang forgets it even when destroying it fails
            self._busy.pop(group_name, None)
            await self._destroy(group_name)

    async def _destroy(self, name: str, quietly: bool = False) -> None:
        try:
            await _call(self.transport, "destroy_weights_update_group", {"group_name": name})
        except Exception as exc:
            if not quietly:
                raise
            log.warning("a weights update group joined too late could not be left: %s", type(exc).__name__)
            return
        log.info("left a weights update group through SGLang")


class SglangDeviceTensors(contract.DeviceTensors):
    """New weights from tensors on SGLang's GPU, through SGLang's `update_weights_from_tensor`:
    each of its tensor-parallel ranks gets the handles and loads the tensors with the model's own
    `load_weights` (checkpoint names; it shards and fuses them itself)."""

    def __init__(self, transport: Transport, tp_size: int) -> None:
        self.transport = transport
        self.tp_size = tp_size

    async def load(self, tensors: Sequence[tuple[str, Any]]) -> None:
        if not tensors:
            raise WeightsError("no tensors to load")
        payload = pickled(tensors)
        body = {"serialized_named_tensors": [payload] * self.tp_size, "flush_cache": True}
        await _call(self.transport, "update_weights_from_tensor", body)


class SglangWeights(contract.Weights):
    # SGLang's scheduler decodes a stream's tokens ahead of the gateway reading them, so there is
    # no step to hold a stream at: an update waits for streams in flight to end, as with vLLM.
    held_between_steps = False

    def __init__(self, engine: HasTransport, tp_size: int) -> None:
        self.engine = engine
        self.collective = SglangCollective(engine.transport)
        self.device_tensors = SglangDeviceTensors(engine.transport, tp_size)

    async def load(self, path: str) -> None:
        # SGLang reloads its original weights itself when loading new ones fails
        body = {"model_path": path, "flush_cache": True}
        await _call(self.engine.transport, "update_weights_from_disk", body)
        self.engine.info = replace(self.engine.info, path=path)
