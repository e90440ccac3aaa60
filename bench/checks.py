"""What a bench reports of a served model besides its speed: the GPU memory it holds, and its
dense rows against an uncached forward pass of the same weights.

A `TargetReport` per target, printed as one Markdown table:

    GiB at start     free GPU memory before the target started less free memory once it answered
                     (every process on the GPU: the bench's own stays as it was)
    GiB after run    the same once its measurements ended: caches filled, graphs captured
    GiB free after   what the GPU had left then
    share set        the memory share a composed model gave its generation engine, from its log
                     (backends/composed/memory.py), or "-"
    max |Δ|          the largest |difference| between rows the target served and a forward pass of
                     each row alone by transformers in the same dtype (`reference_check`, which
                     bench/smc.py applies to its ways), or "-" where it served none

The reference model loads once after every target stopped, so the targets find the GPU as a
deployment would.
"""

from __future__ import annotations

import gc
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from backends.transformers.engine import resolve_device, resolve_dtype
from bench.launcher import restore_vllm_environment
from logprob_gateway_client import AsyncGatewayLM

GIB = 1 << 30
Kept = list[tuple[list[int], np.ndarray]]  # (row, its logprobs) as a target served them
SHARE_LINE = re.compile(r"composed model: (\w+ = [\d.]+)")


@dataclass
class TargetReport:
    name: str
    free_before: int | None = None  # bytes; None off CUDA
    free_started: int | None = None
    free_after: int | None = None
    share: str = "-"
    kept: Kept = field(default_factory=list)
    max_diff: float | None = None


def gpu_free(device: str) -> int | None:
    """Free bytes of the GPU `device` names (every process's use counted), None off CUDA."""
    resolved = resolve_device(device)
    if resolved.type != "cuda":
        return None
    return torch.cuda.mem_get_info(resolved)[0]


def share_set(log_path: Path) -> str:
    """The memory share a composed model's gateway log says it set ("gpu_memory_utilization =
    0.846"), or "-"."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    found = SHARE_LINE.search(text)
    return found.group(1) if found else "-"


async def gateway_rows(base_url: str, model: str, rows: list[list[int]]) -> Kept:
    """`rows` as a gateway serves them (one request, as an SMC step asks), each with its row."""
    lm = AsyncGatewayLM(base_url, model)
    restore_vllm_environment()  # what importing genlm-backend set, kept from servers started later
    try:
        out = np.asarray(await lm.batch_next_token_logprobs(rows), dtype=np.float32)
    finally:
        await lm.aclose()
    return [(list(row), out[i].copy()) for i, row in enumerate(rows)]


def reference_check(model: object, kept: Kept) -> float:
    """Largest |difference| between kept rows and an uncached forward pass of each row alone."""
    device = next(model.parameters()).device  # type: ignore[attr-defined]
    worst = 0.0
    with torch.inference_mode():
        for row, got in kept:
            logits = model(torch.tensor([row], device=device)).logits[0, -1]  # type: ignore[operator]
            expected = torch.log_softmax(logits.float(), dim=-1).cpu().numpy()
            worst = max(worst, float(np.max(np.abs(got - expected))))
    return worst


def check_rows(reports: list[TargetReport], model_dir: Path, dtype: str, device: str) -> None:
    """Sets `max_diff` of each report with kept rows, against one reference model loaded here."""
    if not any(report.kept for report in reports):
        return
    from transformers import AutoModelForCausalLM

    resolved = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype(dtype, resolved))
    model = model.to(resolved).eval()
    for report in reports:
        if report.kept:
            report.max_diff = reference_check(model, report.kept)
    del model
    gc.collect()
    if resolved.type == "cuda":
        torch.cuda.empty_cache()


def _gib(before: int | None, after: int | None) -> str:
    return "-" if before is None or after is None else f"{(before - after) / GIB:.1f}"


def print_reports(reports: list[TargetReport]) -> None:
    print("\n### Per target: GPU memory and dense rows\n")
    print("| target | GiB at start | GiB after run | GiB free after | share set | max \\|Δ\\| vs uncached |")
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    for r in reports:
        free = "-" if r.free_after is None else f"{r.free_after / GIB:.1f}"
        diff = "-" if r.max_diff is None else f"{r.max_diff:.1e}"
        started, after = _gib(r.free_before, r.free_started), _gib(r.free_before, r.free_after)
        print(f"| {r.name} | {started} | {after} | {free} | {r.share} | {diff} |")
