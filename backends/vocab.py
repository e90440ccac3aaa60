"""The exact bytes of every token, and text built from them.

Concatenating the bytes of a token sequence gives the bytes of the text it encodes, which is
what constrained decoding needs (and what genlm's `decode_vocab` computes). Two vocabulary
families are understood:

- byte-level BPE (GPT-2, Llama 3, SmolLM): each byte is spelled by one printable unicode char;
- SentencePiece (Llama 2, Mistral): `▁` stands for a space and `<0xNN>` for a raw byte.

Added/special tokens are their literal text in UTF-8.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Sequence
from functools import cache
from typing import Any

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte -> printable char table, inverted."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_types(tokenizer: Any) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    found = {decoder.get("type", "")}
    for inner in decoder.get("decoders") or []:
        found.add(inner.get("type", ""))
    return found


def token_bytes_table(tokenizer: Any, vocab_size: int) -> list[bytes]:
    """Bytes of every token id in [0, vocab_size); ids the tokenizer does not know map to b""."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    kinds = _decoder_types(tokenizer)
    byte_level = "ByteLevel" in kinds
    table: list[bytes] = []
    for token_id, piece in enumerate(pieces):
        if piece is None:
            table.append(b"")
        elif token_id in added:
            table.append(piece.encode())
        elif byte_level:
            decoder = _byte_level_decoder()
            if all(ch in decoder for ch in piece):
                table.append(bytes(decoder[ch] for ch in piece))
            else:
                table.append(piece.encode())
        elif match := _BYTE_TOKEN.match(piece):
            table.append(bytes([int(match.group(1), 16)]))
        else:
            table.append(piece.replace("▁", " ").encode())
    table.extend(b"" for _ in range(vocab_size - len(table)))
    return table


def token_display(raw: bytes) -> str:
    """A token's text as OpenAI shows it: the UTF-8 text, or `bytes:\\xNN...` when not valid UTF-8."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class IncrementalText:
    """Turns a growing token sequence into text deltas, holding back incomplete UTF-8 sequences.

    Tokens in `hidden_ids` (end-of-sequence and other special tokens) add no text, like
    `skip_special_tokens=True`.
    """

    def __init__(self, table: Sequence[bytes], hidden_ids: Iterable[int] = ()) -> None:
        self._table = table
        self._hidden = frozenset(hidden_ids)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        if token_id in self._hidden:
            return ""
        return self._decoder.decode(self._table[token_id])

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def decode_text(table: Sequence[bytes], ids: Iterable[int], hidden_ids: Iterable[int] = ()) -> str:
    text = IncrementalText(table, hidden_ids)
    return "".join(text.add(i) for i in ids) + text.flush()
