"""A custom logit processor that hands each SGLang request the whole next-token row it was asked.

It runs in SGLang's scheduler process (which imports it by name, so it lives in a module, not in
`__main__`), on the logits of the requests that name it: one log_softmax of the batch on the GPU,
one copy to the host, and each request's first row in its `customized_info`, which SGLang returns in
the request's meta_info. The logits go on unchanged to SGLang's sampler.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


class DenseRowsProcessor(CustomLogitProcessor):
    def __call__(
        self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None
    ) -> torch.Tensor:
        rows = torch.log_softmax(logits.float(), dim=-1).cpu().numpy()
        for row, params in zip(rows, custom_param_list or (), strict=True):
            request = params["__req__"]
            # The row after the prompt only: with SGLang's overlap scheduling a request that is done
            # may run one more step, whose row (after its sampled token) must not replace it.
            if request.customized_info is None:
                request.customized_info = {"dense": [row]}
        return logits
