"""Full-vocabulary log-probability rows captured inside vLLM's engine core.

vLLM's own `logprobs=-1` builds one Python object per vocabulary entry (seconds per batch of
rows). Instead, a batch-level logits processor (vLLM v1's public `LogitsProcessor` interface)
computes log_softmax of the rows of tagged requests on the device and writes each row, as float32,
straight into a file-backed array that the gateway allocated for the call (/dev/shm when it
exists). That works whether the engine core runs in this process or in vLLM's engine-core process.

A request is tagged through `SamplingParams.extra_args[CAPTURE_KEY] = [path, row]` and run with
`max_tokens=1`. The processor runs at every step that contains the request, so with chunked
prefill a row may be written more than once; the last write is the one from the step that samples
the request's only token, which is the full prompt's next-token distribution.

This is the one module that relies on vLLM internals (the logits-processor interface and the
persistent-batch bookkeeping of `BatchUpdate`); `SUPPORTED_VLLM` is the range it was written
against, and tests/backends/test_vllm_capture.py fails loudly when that interface moves.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

SUPPORTED_VLLM = (">=0.26", "<0.33")
CAPTURE_KEY = "logprob_gateway_row"


class DenseRowCapture(LogitsProcessor):
    """Writes log_softmax(logits) of tagged requests into their (path, row) targets."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._targets: dict[int, tuple[str, int]] = {}  # persistent-batch index -> (path, row)
        self._arrays: dict[str, np.memmap] = {}  # open output files, by path

    def is_argmax_invariant(self) -> bool:
        # False makes vLLM call apply() at every step, greedy or not, on the raw float32 logits.
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._targets.pop(index, None)
        for index, params, _, _ in batch_update.added:
            target = (params.extra_args or {}).get(CAPTURE_KEY) if params is not None else None
            if target is None:
                self._targets.pop(index, None)
            else:
                self._targets[index] = (str(target[0]), int(target[1]))
        for first, second, direction in batch_update.moved:
            a, b = self._targets.pop(first, None), self._targets.pop(second, None)
            if a is not None:
                self._targets[second] = a
            if b is not None and direction == MoveDirectionality.SWAP:
                self._targets[first] = b
        for path in set(self._arrays) - {path for path, _ in self._targets.values()}:
            del self._arrays[path]  # every request writing there has left the batch

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._targets:
            return logits
        indices = sorted(i for i in self._targets if i < logits.shape[0])
        rows = torch.log_softmax(logits[indices].float(), dim=-1).cpu().numpy()
        for row, index in zip(rows, indices, strict=True):
            path, position = self._targets[index]
            out = self._arrays.get(path)
            if out is None:
                out = self._arrays[path] = np.memmap(path, dtype=np.float32, mode="r+").reshape(
                    -1, rows.shape[1]
                )
            out[position] = row
        return logits
