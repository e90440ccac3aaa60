"""The name transformers gives a forward pass's key/value cache, as argument and as output field:
`cache` in recent releases, where `past_key_values` still works but warns (removed in 5.40),
`past_key_values` in earlier ones. Read once from the installed transformers."""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers.modeling_outputs import CausalLMOutputWithPast

CACHE_ARGUMENT = (
    "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
)


def with_cache(cache: Any) -> dict[str, Any]:
    """The keyword argument that hands `cache` to a causal LM's forward pass."""
    return {CACHE_ARGUMENT: cache}


def output_cache(output: Any) -> Any:
    """The key/value cache a causal LM's forward pass returned."""
    return getattr(output, CACHE_ARGUMENT)
