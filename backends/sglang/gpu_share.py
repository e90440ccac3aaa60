"""SGLang's terms for its share of a GPU it shares with a composed model's dense engine
(backends/composed/memory.py), read in its sources (SGLang 0.5). `mem_fraction_static` is a
fraction of the memory free when its scheduler starts (`pre_model_load_memory`), and covers
weights and K/V cache only; the rest of that free memory is its headroom for activations and CUDA
graphs, which its default sizes from the GPU's capacity (`sglang_headroom`). So
`(budget - headroom) / free`, but no more than its weights (as much as the dense engine holds) and
SGLANG_KV_CAP of K/V cache, whatever other processes hold. Left to its default it would take about
0.9 of what is free at start, and the dense engine's prefix cache would run out of memory as it
grows.

In mode "server" the share goes to the child's command line (`launch_args`); a "url" server holds
its own memory and is left alone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backends.types import GpuMemory

GIB = 1 << 30
SGLANG_SHARE_FLAG = "--mem-fraction-static"
# SGLang generates markedly slower with a very large K/V pool (docs/performance.md, "Composed
# models"), so by default its static share holds its weights and at most this much K/V cache.
SGLANG_KV_CAP = 40 * GIB
# SGLang's defaults by GPU capacity: (below this many MiB, chunked-prefill tokens, largest CUDA-graph
# batch); larger GPUs 16384 and 512.
_SGLANG_SIZES = ((20 << 10, 2048, 8), (35 << 10, 2048, 24), (60 << 10, 4096, 32), (160 << 10, 8192, 256))


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


def _mode(options: Mapping[str, Any]) -> str:
    return options.get("mode", "url" if "url" in options else "engine")


def _launch_args(options: Mapping[str, Any]) -> list[str]:
    return [str(arg) for arg in options.get("launch_args", [])]


class SglangShare:
    option = "mem_fraction_static"

    def leaves_unset(self, options: Mapping[str, Any]) -> bool:
        mode = _mode(options)
        if mode == "url" or self.option in options:
            return False
        return not (mode == "server" and SGLANG_SHARE_FLAG in _launch_args(options))

    def share(self, memory: GpuMemory, budget: int) -> float:
        share = (budget - sglang_headroom(memory.total)) / memory.free
        return min(share, (memory.dense + SGLANG_KV_CAP) / memory.free)

    def fitted(self, options: Mapping[str, Any], share: float) -> dict[str, Any]:
        if _mode(options) == "server":
            return {**options, "launch_args": [*_launch_args(options), SGLANG_SHARE_FLAG, str(share)]}
        return {**options, self.option: share}


SGLANG_SHARE = SglangShare()
