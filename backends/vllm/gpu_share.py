"""vLLM's terms for its share of a GPU it shares with a composed model's dense engine
(backends/composed/memory.py), read in its sources (vLLM 0.26-0.32): `gpu_memory_utilization` is a
fraction of the whole GPU, and covers everything its engine allocates (weights, activations, CUDA
graphs, K/V cache), which must be free when it starts (`request_memory` of its v1 worker utils).
So the budget left to it, over the GPU's total. Left to its default it would take 0.92 of the GPU
at start, and the dense engine's prefix cache would run out of memory as it grows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backends.types import GpuMemory


class VllmShare:
    option = "gpu_memory_utilization"

    def leaves_unset(self, options: Mapping[str, Any]) -> bool:
        return self.option not in options

    def share(self, memory: GpuMemory, budget: int) -> float:
        return budget / memory.total

    def fitted(self, options: Mapping[str, Any], share: float) -> dict[str, Any]:
        return {**options, self.option: share}


VLLM_SHARE = VllmShare()
