"""The custom logit processor that hands each dense-row request its whole next-token row.

SGLang imports this module in its scheduler process (a request names the processor by module and
class: `PROCESSOR`, the form of sglang's `CustomLogitProcessor.to_str()`), and calls it on the
float32 logits of the requests that name it, on the GPU, before sampling. It takes one log_softmax of those rows, one copy into page-locked
host memory, and gives each request its row in `customized_info`, which SGLang returns in the
request's meta_info under "dense": raw little-endian float32 bytes, or their base64 text where the
answer travels as JSON (custom param "b64"). The logits go on unchanged to SGLang's sampler.
"""

from __future__ import annotations

import base64
import json
import pickle
import threading
from typing import Any

import torch

_host: torch.Tensor | None = None  # page-locked rows, grown as needed; one per scheduler process
_host_lock = threading.Lock()  # SGLang's scheduler calls from one thread; anything else may not


def _host_rows(rows: int, vocab: int) -> torch.Tensor:
    global _host
    if _host is None or _host.shape[0] < rows or _host.shape[1] != vocab:
        _host = torch.empty((max(rows, 64), vocab), dtype=torch.float32, pin_memory=torch.cuda.is_available())
    return _host[:rows]


class DenseRowProcessor:
    def __call__(
        self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None
    ) -> torch.Tensor:
        params = custom_param_list or []
        # A row after the prompt only: with SGLang's overlap scheduling a finished request may run
        # one step more, whose row (after its sampled token) must not replace it.
        todo = [i for i, p in enumerate(params) if p["__req__"].customized_info is None]
        if not todo:
            return logits
        index = torch.tensor(todo, device=logits.device)
        rows = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
        with _host_lock:
            host = _host_rows(len(todo), logits.shape[1])
            host.copy_(rows)
            payloads = [row.tobytes() for row in host.numpy()]
        for payload, i in zip(payloads, todo, strict=True):
            row = base64.b64encode(payload).decode() if params[i].get("b64") else payload
            params[i]["__req__"].customized_info = {"dense": [row]}
        return logits


# SGLang unpickles the class with dill, which reads a standard pickle; by reference (module and
# name), so neither sglang nor dill is needed where requests are built.
PROCESSOR = json.dumps({"callable": pickle.dumps(DenseRowProcessor, protocol=4).hex()})
