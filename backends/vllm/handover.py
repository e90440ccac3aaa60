"""New weights for the vLLM engine as tensors another engine of the gateway holds on the same
device (a composed model's dense engine): the gateway's side (VllmDeviceTensors) sends them
through `collective_rpc` to a class vLLM mixes into its worker class (`worker_extension_cls`,
imported by name in the worker's process)."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

from backends import engine as contract
from backends.device_tensors import pickled
from backends.errors import WeightsError


class VllmDeviceTensors(contract.DeviceTensors):
    """Tensors on vLLM's device, loaded on every worker by HandedTensors; its prefix cache then
    emptied (keys/values of the old weights)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm  # vLLM's AsyncLLM

    async def load(self, tensors: Sequence[tuple[str, Any]]) -> None:
        if not tensors:
            raise WeightsError("no tensors to load")
        await self.llm.collective_rpc("load_handed_tensors", args=(pickled(tensors),))
        await self.llm.reset_prefix_cache()


class HandedTensors:
    """Mixed into vLLM's worker class, whose `reload_weights` it calls."""

    reload_weights: Any  # the worker's own

    def load_handed_tensors(self, payload: bytes) -> None:
        """The tensors in `payload` (backends/device_tensors.py: CUDA IPC handles, or shared memory
        on the CPU) loaded in place by vLLM's own reload, through the model's `load_weights`
        (checkpoint names: it fuses and shards them itself); parameters not named keep theirs."""
        tensors = pickle.loads(payload)  # noqa: S301 (the gateway's own process sent it)
        self.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)
