"""A custom logit processor that writes each SGLang request's whole next-token row into a file.

A variant of backends/sglang/processor.py for bench/sglang_rows.py: the request's custom params
name a file in shared memory that both processes map, and a slot; the processor writes the row
there and hands back only a flag in `customized_info`. It runs in SGLang's scheduler process
(which imports it by name, so it lives in a module, not in `__main__`); the logits go on unchanged
to SGLang's sampler.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

_MAPPED: dict[str, np.ndarray] = {}  # shared files by path, mapped once per scheduler process


def _mapped(path: str, vocab_size: int, slot: int) -> np.ndarray:
    rows = _MAPPED.get(path)
    if rows is None or slot >= len(rows):  # new, or grown since it was mapped
        rows = _MAPPED[path] = np.memmap(path, dtype=np.float32, mode="r+").reshape(-1, vocab_size)
    return rows


class FileRowsProcessor(CustomLogitProcessor):
    def __call__(
        self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None
    ) -> torch.Tensor:
        rows = torch.log_softmax(logits.float(), dim=-1).cpu().numpy()
        for row, params in zip(rows, custom_param_list or (), strict=True):
            request = params["__req__"]
            # The row after the prompt only: with SGLang's overlap scheduling a request that is done
            # may run one more step, whose row (after its sampled token) must not replace it.
            if request.customized_info is not None:
                continue
            _mapped(params["file"], len(row), params["slot"])[params["slot"]] = row
            request.customized_info = {"dense": [True]}
        return logits
