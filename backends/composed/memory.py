"""How a composed model's two engines share one GPU: the generation engine's memory share, set
where the model's options leave it unset.

The dense engine loads first. Its weights are then in use, but its prefix K/V cache is not: that
grows as rows come, up to its budget (`prefix_cache_bytes`, a tenth of the GPU by default). vLLM
and SGLang, left to their defaults, would take nearly all the rest at start (vLLM 0.92 of the
GPU, SGLang about 0.9 of what is free), so the dense engine's cache would run out of memory as it
grows. So the generation engine gets the free memory less that budget and MARGIN:

    budget = free after the dense engine loaded - its prefix cache budget - MARGIN

in each engine's own terms (read in their sources, vLLM 0.26-0.32, SGLang 0.5):
- vLLM's `gpu_memory_utilization` is a fraction of the whole GPU: everything its engine allocates
  (weights, activations, CUDA graphs, K/V cache), which must be free when it starts
  (`request_memory` of its v1 worker utils). So `budget / total`.
- SGLang's `mem_fraction_static` is a fraction of the memory free when its scheduler starts
  (`pre_model_load_memory`), and covers weights and K/V cache only; the rest of that free memory is
  its headroom for activations and CUDA graphs, which its default sizes from the GPU's capacity
  (`sglang_headroom`). So `(budget - headroom) / free`, but no more than its weights (as much as
  the dense engine holds) and SGLANG_KV_CAP of K/V cache, whatever other processes hold.

With `backend = "sglang"` in mode "server" the share goes to the child's command line
(`launch_args`); a "url" server holds its own memory and is left alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backends.errors import EngineUnavailableError

log = logging.getLogger(__name__)

GIB = 1 << 30
# The generation engine's own CUDA context (outside what either engine counts) and the dense
# engine's activations beyond its cache: a pass of 16,384 tokens of an 8B model takes about 3 GiB.
MARGIN = 4 * GIB
SHARE_OPTIONS = {"vllm": "gpu_memory_utilization", "sglang": "mem_fraction_static"}
SGLANG_SHARE_FLAG = "--mem-fraction-static"
# SGLang generates markedly slower with a very large K/V pool (docs/performance.md, "Composed
# models"), so by default its static share holds its weights and at most this much K/V cache.
SGLANG_KV_CAP = 40 * GIB
# SGLang's defaults by GPU capacity: (below this many MiB, chunked-prefill tokens, largest CUDA-graph
# batch); larger GPUs 16384 and 512.
_SGLANG_SIZES = ((20 << 10, 2048, 8), (35 << 10, 2048, 24), (60 << 10, 4096, 32), (160 << 10, 8192, 256))


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's memory, in bytes: `free` and `total` as torch.cuda.mem_get_info reads them (every
    process's use), `dense` what the dense engine holds (this process's allocator), which is about
    what SGLang's weights will take; other processes may hold the rest of what is in use."""

    free: int
    total: int
    dense: int


def sglang_headroom(total: int) -> int:
    """What SGLang's default keeps out of its static share on a GPU of `total` bytes for
    activations and CUDA graphs (sglang/srt/server_args.py, `_handle_gpu_memory_settings`, one GPU):
    512 MB, 1.5 MB per chunked-prefill token, 2 MB per CUDA-graph batch size, 128 MB, at least
    10 GiB on GPUs over 60 GB. 13.1 GiB on an H100 or H200."""
    mib = total >> 20
    chunk, graphs = next(((c, g) for below, c, g in _SGLANG_SIZES if mib < below), (16384, 512))
    reserved = 512 + 1.5 * chunk + 2 * graphs + 128
    if mib > 60 << 10:
        reserved = max(reserved, 10 << 10)
    return int(reserved) << 20


def generation_share(backend: str, memory: GpuMemory, dense_reserve: int) -> float:
    """The generation engine's share (vllm: of the whole GPU; sglang: of what is free) that leaves
    `dense_reserve` bytes (the dense engine's cache budget, not yet in use) and MARGIN free,
    rounded down to 0.001; EngineUnavailableError when no share can."""
    budget = memory.free - dense_reserve - MARGIN
    if backend == "vllm":
        share = budget / memory.total
    else:
        share = (budget - sglang_headroom(memory.total)) / memory.free
        share = min(share, (memory.dense + SGLANG_KV_CAP) / memory.free)
    share = math.floor(share * 1000) / 1000
    if share <= 0:
        raise EngineUnavailableError(
            f"a composed model's {backend} engine has no room on this GPU: {memory.free / GIB:.1f} of "
            f"{memory.total / GIB:.1f} GiB free after the dense engine loaded, which keeps "
            f"{dense_reserve / GIB:.1f} GiB for its prefix cache (dense_options.prefix_cache_bytes); "
            f"set options.{SHARE_OPTIONS[backend]} or a smaller prefix cache"
        )
    return share


def fitted_options(
    backend: str, options: Mapping[str, Any], memory: GpuMemory, dense_reserve: int
) -> dict[str, Any]:
    """The generation engine's options with its memory share set (the module docstring), unless
    the options set it already, the engine is not vLLM or SGLang, or is an SGLang "url" server."""
    fitted = dict(options)
    name = SHARE_OPTIONS.get(backend)
    mode = options.get("mode", "url" if "url" in options else "engine")
    if name is None or name in options or (backend == "sglang" and mode == "url"):
        return fitted
    launch_args = [str(arg) for arg in options.get("launch_args", [])]
    if backend == "sglang" and mode == "server" and SGLANG_SHARE_FLAG in launch_args:
        return fitted
    share = generation_share(backend, memory, dense_reserve)
    log.info(
        "composed model: %s = %s for the %s engine (%.1f of %.1f GiB free after the dense engine, "
        "%.1f GiB kept for its prefix cache, %.1f GiB margin)",
        name,
        share,
        backend,
        memory.free / GIB,
        memory.total / GIB,
        dense_reserve / GIB,
        MARGIN / GIB,
    )
    if backend == "sglang" and mode == "server":
        fitted["launch_args"] = [*launch_args, SGLANG_SHARE_FLAG, str(share)]
    else:
        fitted[name] = share
    return fitted


def dense_gpu(backend: str, config: Any) -> tuple[GpuMemory, int] | None:
    """(the GPU's memory now, the dense engine's cache budget) when the dense engine (`backend`,
    loaded with `config`) runs on the GPU the generation engine starts on, the first visible one;
    None otherwise (a CPU, or another GPU: nothing to share)."""
    if backend != "transformers":  # MLX and the mock hold no CUDA memory
        return None
    import torch

    from backends.transformers.engine import prefix_cache_bytes, resolve_device

    device = resolve_device(config.device)
    if device.type != "cuda" or (device.index or 0) != 0:
        return None
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemory(free, total, torch.cuda.memory_reserved(device)), prefix_cache_bytes(
        config.options, device
    )
