"""Masked attention over grouped keys/values without copying them once per query head.

transformers' SDPA attention repeats every key/value head for each query head of its group
(`repeat_kv`) whenever an attention mask is given, because torch's fast kernels take grouped heads
only without a mask. A dense pass over padded or resampled rows always has a mask, and on a model
with grouped heads (Llama 3: 32 query heads, 8 key/value heads) that copy of the whole cache, four
times over, at every layer, costs more than the attention itself. For a pass of one new token per
row (every decode step) the copy is not needed: the query heads of a group can stand as query
positions of their one key/value head. This registers, through transformers' attention interface,
an implementation that does so and otherwise defers to transformers' SDPA
(docs/performance.md has the measurements).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

log = logging.getLogger(__name__)

NAME = "sdpa_grouped_masked"


def grouped_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    batch, heads, length, dim = query.shape
    groups = heads // key.shape[1]
    if attention_mask is None or length != 1 or groups == 1 or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    # One new token per row: the query heads that share a key/value head become that head's query
    # positions, which all see the same keys under the same mask (the mask has no query axis).
    grouped = query.reshape(batch, key.shape[1], groups, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def use_grouped_attention(model: Any) -> bool:
    """Switch a model on transformers' SDPA with grouped key/value heads to the grouped version."""
    text = model.config.get_text_config(decoder=True)
    heads, kv_heads = text.num_attention_heads, getattr(text, "num_key_value_heads", None)
    if model.config._attn_implementation != "sdpa" or not kv_heads or kv_heads == heads:
        return False
    AttentionInterface.register(NAME, grouped_sdpa_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    log.info("masked attention over grouped key/value heads without repeating them")
    return True
