"""Whether two engines' token ids mean the same: one model's rows and generated tokens may come
from either, so their vocabularies and tokenizers must agree entry for entry."""

from __future__ import annotations

from typing import Any

from backends.types import ModelInfo


def special_tokens(tokenizer: Any) -> dict[str, Any]:
    """The named special tokens (bos, eos, pad, ...) and every added token, with whether it is
    special: what decides how text splits into ids beyond the vocabulary itself."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return {
        **dict(tokenizer.special_tokens_map),
        **{
            f"added token {int(i)}": (t.content, bool(getattr(t, "special", False))) for i, t in added.items()
        },
    }


def _first_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    key = min(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    return f"{key!r}: {ours.get(key)!r} for the generation engine, {theirs.get(key)!r} for the dense engine"


def vocabulary_difference(generation: ModelInfo, dense: ModelInfo) -> str | None:
    """Why the two engines' token ids would not mean the same (one line), or None when they do:
    the width of their rows, their tokenizers' vocabularies, their special tokens."""
    if generation.vocab_size != dense.vocab_size:
        return (
            f"their vocabulary sizes differ: the generation engine's rows have {generation.vocab_size} "
            f"entries, the dense engine's {dense.vocab_size}"
        )
    ours, theirs = generation.tokenizer, dense.tokenizer
    vocabulary, other = ours.get_vocab(), theirs.get_vocab()
    if vocabulary != other:
        return f"their tokenizers' vocabularies differ at token {_first_difference(vocabulary, other)}"
    specials, other_specials = special_tokens(ours), special_tokens(theirs)
    if specials != other_specials:
        return f"their tokenizers' special tokens differ at {_first_difference(specials, other_specials)}"
    return None
