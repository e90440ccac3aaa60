"""How a composed model's two engines share one GPU: the generation engine's memory share, set
where the model's options leave it unset.

The dense engine loads first. Its weights are then in use, but its prefix K/V cache is not: that
grows as rows come, up to its budget (a tenth of the GPU by default). A generation engine left to
its defaults would take nearly all the rest at start, so the dense engine's cache would run out of
memory as it grows. So the generation engine gets the free memory less that budget and MARGIN:

    budget = free after the dense engine loaded - its prefix cache budget - MARGIN

in the generation engine's own terms: each backend's registry entry names them (its
`generation_share`, a GenerationShare); what the dense engine holds on the GPU comes from its
entry's `dense_gpu`. A backend without either holds no share of that GPU.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, Protocol

from backends.errors import EngineUnavailableError
from backends.registry import composed_hook
from backends.types import EngineConfig, GpuMemory

log = logging.getLogger(__name__)

GIB = 1 << 30
# The generation engine's own CUDA context (outside what either engine counts) and the dense
# engine's activations beyond its cache: a pass of 16,384 tokens of an 8B model takes about 3 GiB.
MARGIN = 4 * GIB


class GenerationShare(Protocol):
    """A generation backend's terms for its share of the GPU."""

    option: str  # the option that sets it, named where no share can be found

    def leaves_unset(self, options: Mapping[str, Any]) -> bool:
        """The options leave the share unset, and the engine would take it of this GPU."""

    def share(self, memory: GpuMemory, budget: int) -> float:
        """The share, unrounded, that leaves it `budget` bytes of `memory`."""

    def fitted(self, options: Mapping[str, Any], share: float) -> dict[str, Any]:
        """`options` with the share set to `share`."""


def _terms(backend: str) -> GenerationShare | None:
    terms: GenerationShare | None = composed_hook(backend, "generation_share")
    return terms


def generation_share(backend: str, memory: GpuMemory, dense_reserve: int) -> float:
    """The generation engine's share, in its own terms, that leaves `dense_reserve` bytes (the
    dense engine's cache budget, not yet in use) and MARGIN free, rounded down to 0.001;
    EngineUnavailableError when no share can."""
    terms = _terms(backend)
    assert terms is not None, f"{backend} takes no share of a GPU"
    share = math.floor(terms.share(memory, memory.free - dense_reserve - MARGIN) * 1000) / 1000
    if share <= 0:
        raise EngineUnavailableError(
            f"a composed model's {backend} engine has no room on this GPU: {memory.free / GIB:.1f} of "
            f"{memory.total / GIB:.1f} GiB free after the dense engine loaded, which keeps "
            f"{dense_reserve / GIB:.1f} GiB for its prefix cache (dense_options.prefix_cache_bytes); "
            f"set options.{terms.option} or a smaller prefix cache"
        )
    return share


def fitted_options(
    backend: str, options: Mapping[str, Any], memory: GpuMemory, dense_reserve: int
) -> dict[str, Any]:
    """The generation engine's options with its memory share set (the module docstring), unless
    the options set it already, or the engine takes no share of this GPU."""
    terms = _terms(backend)
    if terms is None or not terms.leaves_unset(options):
        return dict(options)
    share = generation_share(backend, memory, dense_reserve)
    log.info(
        "composed model: %s = %s for the %s engine (%.1f of %.1f GiB free after the dense engine, "
        "%.1f GiB kept for its prefix cache, %.1f GiB margin)",
        terms.option,
        share,
        backend,
        memory.free / GIB,
        memory.total / GIB,
        dense_reserve / GIB,
        MARGIN / GIB,
    )
    return terms.fitted(options, share)


def dense_gpu(backend: str, config: EngineConfig) -> tuple[GpuMemory, int] | None:
    """(the GPU's memory now, the dense engine's cache budget) when the dense engine (`backend`,
    loaded with `config`) runs on the GPU the generation engine starts on, the first visible one;
    None otherwise (a CPU, another GPU, or a backend that holds no GPU memory: nothing to share)."""
    on_gpu = composed_hook(backend, "dense_gpu")
    return None if on_gpu is None else on_gpu(config)
