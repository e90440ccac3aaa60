"""New weights received over a collective from a trainer, as SGLang receives them for TorchRL's
`SGLangWeightSyncScheme` (and OpenRLHF, verl): the trainer forms a torch.distributed group by a
TCP rendezvous, without a default group (SGLang's `init_custom_process_group`); the engine joins
it as its given rank, and each update broadcasts every tensor from rank 0 in the announced order.

The calls that wait for the trainer (joining, the broadcasts) run on threads of their own, never
on an engine's compute thread, so requests are served meanwhile; each waits at most the group's
timeout. torch.distributed does not bound a join by it (its store client retries a failed
connection with a full timeout again, and waits without one for a peer that accepts but never
answers), so a join is answered at its timeout whatever its thread does: a join given up on is
left as soon as it forms, and at most `WeightsGroup.max_pending_joins` threads may still be trying.

The announcement is checked against the model before the first broadcast, and received tensors
are staged in full before any parameter changes. An announcement that does not fit is still
received (into one scratch buffer, then dropped), so the trainer is not left waiting, and
refused; one whose tensors are too large even for that leaves the group, so that the trainer's
broadcasts fail (gloo at once; NCCL at its timeout) instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from math import prod
from typing import Any

import torch

from backends.errors import WeightsError, WeightsGroupError
from backends.types import AnnouncedTensor, WeightsGroup

log = logging.getLogger(__name__)

# The dtype names a trainer may announce (TorchRL's dtype_to_str, torch's own names).
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_MIN_SCRATCH_BYTES = 1 << 20
# What TorchRL's trainer sets in its own process before it forms the group. NCCL picks each
# rank's transport from that rank's environment, so a receiver that may use P2P or shared memory
# while the trainer may not fails the group's first broadcast ("ring 0 does not contain rank 1").
TRAINER_NCCL_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
_POLL_S = 0.2  # between tries to reach a trainer's store


def _until_accepting(host: str, port: int, deadline: float) -> None:
    """Until `host:port` accepts a connection, tried every `_POLL_S` until `deadline` (OSError
    then): torch's store client backs off exponentially between its tries, long enough to miss a
    trainer whose store waits for this rank a few seconds only."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), _POLL_S)):
                return
        except socket.gaierror:
            raise
        except OSError:
            if time.monotonic() + _POLL_S >= deadline:
                raise
            time.sleep(_POLL_S)


def match_trainer_nccl_env() -> dict[str, str]:
    """Set each of TRAINER_NCCL_ENV that this process's environment leaves unset (an operator's
    value, 0 included, is kept), before NCCL first reads them; answers what it set."""
    added = {key: value for key, value in TRAINER_NCCL_ENV.items() if key not in os.environ}
    os.environ.update(added)
    if added:
        settings = ", ".join(f"{key}={value}" for key, value in added.items())
        log.info("weight sync over NCCL: %s, as TorchRL's trainer sets them", settings)
    return added


def join_group(group: WeightsGroup, backend: str, device: torch.device) -> Any:
    """A process group of `group.world_size` ranks with this process as `group.rank`, formed as
    SGLang's `init_custom_process_group` forms it (and TorchRL's trainer, its mirror): a TCP
    rendezvous at the trainer, a store prefixed with the group's name, no default group. Blocks
    until every rank has joined, at most `group.timeout_s` unless a peer accepts the store's
    connection but never answers (torch then waits without bound)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "nccl":
        match_trainer_nccl_env()
    deadline = time.monotonic() + group.timeout_s
    host = f"[{group.master_address}]" if ":" in group.master_address else group.master_address
    url = f"tcp://{host}:{group.master_port}"
    _until_accepting(group.master_address, group.master_port, deadline)
    timeout = timedelta(seconds=max(deadline - time.monotonic(), 1.0))
    store, rank, world_size = next(rendezvous(url, group.rank, group.world_size, timeout=timeout))
    # what is left of the timeout, for the group's own exchange over the store
    timeout = timedelta(seconds=max(deadline - time.monotonic(), 1.0))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group.name, store),
        group_name=group.name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def mismatch(tensors: Sequence[AnnouncedTensor], parameters: Mapping[str, torch.Tensor]) -> str | None:
    """Why the announced tensors cannot be loaded into `parameters` (by checkpoint name), or None.
    Floating-point tensors are converted to their parameter's dtype, as from disk and in SGLang."""
    problems: list[str] = []
    seen: set[str] = set()
    for tensor in tensors:
        parameter = parameters.get(tensor.name)
        dtype = DTYPES[tensor.dtype]
        if tensor.name in seen:
            problems.append(f"{tensor.name!r} is announced twice")
        elif parameter is None:
            problems.append(f"this model has no parameter {tensor.name!r}")
        elif tuple(parameter.shape) != tensor.shape:
            problems.append(
                f"{tensor.name!r} has shape {list(tensor.shape)}, this model's has {list(parameter.shape)}"
            )
        elif parameter.dtype.is_floating_point and not dtype.is_floating_point:
            problems.append(
                f"{tensor.name!r} is announced as {tensor.dtype}, this model's is "
                f"{str(parameter.dtype).removeprefix('torch.')}"
            )
        seen.add(tensor.name)
    if not problems:
        return None
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return f"{len(problems)} of {len(tensors)} tensors do not fit this model: {'; '.join(problems[:3])}{more}"


def _nbytes(tensor: AnnouncedTensor) -> int:
    return prod(tensor.shape) * DTYPES[tensor.dtype].itemsize


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def receive_tensors(
    pg: Any,
    tensors: Sequence[AnnouncedTensor],
    parameters: Mapping[str, torch.Tensor] | None,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Each announced tensor from rank 0's broadcast over `pg`, on `device`, converted to its
    parameter's dtype; without `parameters`, each is received into one scratch buffer and dropped."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    staged: dict[str, torch.Tensor] = {}
    scratch = None
    if parameters is None:
        scratch = torch.empty(max(map(_nbytes, tensors)), dtype=torch.uint8, device=device)
    for tensor in tensors:
        dtype = DTYPES[tensor.dtype]
        if scratch is not None:
            buffer = scratch[: _nbytes(tensor)].view(dtype).view(tensor.shape)
        else:
            buffer = torch.empty(tensor.shape, dtype=dtype, device=device)
        torch.distributed.broadcast(buffer, src=0, group=pg)
        if parameters is not None:
            wanted = parameters[tensor.name].dtype
            staged[tensor.name] = buffer if buffer.dtype == wanted else buffer.to(wanted)
    _synchronize(device)
    return staged


def _destroy_quietly(pg: Any) -> None:
    with contextlib.suppress(Exception):  # a broken group is gone either way
        torch.distributed.destroy_process_group(pg)


def in_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """`fn(*args)` on a daemon thread of its own: a trainer that never comes keeps neither a pool's
    thread nor the process's exit waiting."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, failure: BaseException | None) -> None:
        if future.done():  # cancelled meanwhile
            return
        if failure is not None:
            future.set_exception(failure)
        else:
            future.set_result(result)

    def run() -> None:
        result, failure = None, None
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 (handed to the awaiting task)
            failure = exc
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
            loop.call_soon_threadsafe(settle, result, failure)

    threading.Thread(target=run, name="weight-sync", daemon=True).start()
    return future


class CollectiveGroups:
    """The groups an engine has joined, by name; one update or leave at a time per group."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._groups: dict[str, Any] = {}  # name -> torch ProcessGroup
        self._joining: set[str] = set()
        self._unsettled = 0  # join threads still running, those given up on included
        self._busy: dict[str, asyncio.Lock] = {}

    def _backend(self, requested: str | None) -> str:
        if requested is None:
            return "nccl" if self.device.type == "cuda" else "gloo"
        if requested == "nccl" and self.device.type != "cuda":
            raise WeightsError(
                "backend nccl needs an engine on a CUDA device; this one is on the CPU: use gloo"
            )
        return requested

    async def join(self, group: WeightsGroup) -> None:
        """Join `group`, answered within `group.timeout_s`: a join not formed by then is given up
        (WeightsError), and left if it forms later."""
        if group.name in self._groups or group.name in self._joining:
            raise WeightsGroupError(
                f"a weights update group named {group.name!r} exists already; destroy it first"
            )
        if self._unsettled >= group.max_pending_joins:
            raise WeightsError(
                f"{self._unsettled} joins are still trying to reach their trainers; try again once "
                "they have failed (a peer that accepts connections but never answers holds one)"
            )
        backend = self._backend(group.backend)
        self._joining.add(group.name)
        self._unsettled += 1
        joined = in_thread(join_group, group, backend, self.device)
        given_up = False

        def register(future: asyncio.Future[Any]) -> None:  # on the loop, whether or not anyone waits
            self._unsettled -= 1
            formed = not future.cancelled() and future.exception() is None
            if given_up:
                if formed:  # its caller was told it failed: the trainer must not count on it
                    in_thread(_destroy_quietly, future.result())
                return
            self._joining.discard(group.name)
            if formed:
                self._groups[group.name] = future.result()

        joined.add_done_callback(register)
        try:
            await asyncio.wait_for(asyncio.shield(joined), group.timeout_s)
        except TimeoutError:
            given_up = True
            self._joining.discard(group.name)
            raise WeightsError(
                "Failed to initialize custom process group: not every rank joined within "
                f"{group.timeout_s:g} s"
            ) from None
        except Exception as exc:
            raise WeightsError(
                f"Failed to initialize custom process group: {type(exc).__name__}: {exc}"
            ) from exc
        log.info(
            "joined a weights update group (%s) as rank %d of %d",  # its name is the caller's text
            backend,
            group.rank,
            group.world_size,
        )

    def _group(self, name: str) -> Any:
        pg = self._groups.get(name)
        if pg is None:
            joining = " (still joining)" if name in self._joining else ""
            raise WeightsGroupError(
                f"no weights update group named {name!r}{joining}; call /init_weights_update_group first"
            )
        return pg

    async def receive(
        self, name: str, tensors: Sequence[AnnouncedTensor], parameters: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The announced tensors, received in full and converted to their parameters' dtypes;
        WeightsError after receiving them if they do not fit `parameters`."""
        self._group(name)
        if not tensors:
            raise WeightsError("an update announces no tensors")
        async with self._busy.setdefault(name, asyncio.Lock()):
            pg = self._group(name)  # it may have been left meanwhile
            problem = mismatch(tensors, parameters)
            limit = max(sum(p.numel() * p.element_size() for p in parameters.values()), _MIN_SCRATCH_BYTES)
            if problem is not None and max(map(_nbytes, tensors)) > limit:
                await self._leave(name)
                raise WeightsError(
                    f"{problem}; a tensor too large to receive and drop was announced, so this engine "
                    f"left group {name!r}: join again"
                )
            try:
                staged = await in_thread(
                    receive_tensors, pg, tensors, None if problem else parameters, self.device
                )
            except Exception as exc:
                await self._leave(name)
                raise WeightsError(
                    f"receiving the weights over group {name!r} failed ({type(exc).__name__}: {exc}); "
                    "no weights changed, and this engine left the group: join again"
                ) from exc
        if problem is not None:
            raise WeightsError(f"{problem}; the tensors were received and dropped, no weights changed")
        return staged

    async def leave(self, name: str) -> None:
        if name not in self._groups:
            raise WeightsGroupError(f"The group to be destroyed does not exist: {name!r}.")
        async with self._busy.setdefault(name, asyncio.Lock()):
            await self._leave(name)

    async def _leave(self, name: str) -> None:
        pg = self._groups.pop(name, None)
        self._busy.pop(name, None)
        if pg is not None:
            await in_thread(_destroy_quietly, pg)
            log.info("left a weights update group")

    async def aclose(self) -> None:
        for name in list(self._groups):
            await self._leave(name)
