"""Masked attention over grouped key/value heads (backends/transformers/grouped_attention.py) computes what
transformers' SDPA computes, without repeating the heads."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from backends.transformers.grouped_attention import NAME, use_grouped_attention

IDS = torch.tensor([[0, 0, 504, 3458, 282, 4649], [1, 504, 3458, 282, 4649, 314]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
POSITIONS = torch.tensor([[0, 0, 0, 1, 2, 3], list(range(6))])


def padded_decode_step(model) -> torch.Tensor:
    """Logits of one new token per row after a left-padded prompt: a masked one-token pass."""
    prompt = model(IDS, attention_mask=MASK, position_ids=POSITIONS, use_cache=True)
    return model(
        torch.tensor([[279], [279]]),
        attention_mask=torch.cat([MASK, torch.ones(2, 1, dtype=MASK.dtype)], dim=1),
        position_ids=POSITIONS[:, -1:] + 1,
        past_key_values=prompt.past_key_values,
    ).logits[:, -1]


def test_a_masked_decode_step_equals_transformers_sdpa(model_dir, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    groups = model.config.num_attention_heads // model.config.num_key_value_heads  # SmolLM2: 9 / 3
    with torch.inference_mode():
        expected = padded_decode_step(model)
        assert use_grouped_attention(model) and model.config._attn_implementation == NAME
        queries = []
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def recording(query, *args, **kwargs):
            queries.append(tuple(query.shape))
            return sdpa(query, *args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
        got = padded_decode_step(model)
    # the step's layers ran with each group's query heads as query positions, not repeated keys
    assert queries.count((2, model.config.num_key_value_heads, groups, 64)) == model.config.num_hidden_layers
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_other_attention_is_left_alone(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    assert not use_grouped_attention(model) and model.config._attn_implementation == "eager"
