"""Exact token bytes and incremental text."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from backends.vocab import IncrementalText, decode_text, token_bytes_table, token_display

TEXTS = [
    "Hello, world!",
    "  spaces\tand\nnewlines  ",
    "héllo wörld",
    "日本語のテキスト",
    "emoji 🎉🚀 ok",
    "naïve café ✓",
]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def table(tokenizer):
    return token_bytes_table(tokenizer, 49152)


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_text(tokenizer, table, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert b"".join(table[i] for i in ids) == text.encode()
    assert decode_text(table, ids) == text


def test_table_covers_the_logits_width_and_special_tokens(tokenizer, table):
    assert len(token_bytes_table(tokenizer, 49160)) == 49160  # ids past the tokenizer have no bytes
    assert table[tokenizer.convert_tokens_to_ids("<|im_end|>")] == b"<|im_end|>"
    assert table[tokenizer.convert_tokens_to_ids("Ġcapital")] == b" capital"


def test_incremental_text_holds_back_partial_utf8(tokenizer, table):
    ids = tokenizer("🎉", add_special_tokens=False).input_ids
    assert len(ids) > 1  # the emoji spans several byte tokens
    text = IncrementalText(table)
    deltas = [text.add(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🎉"
    assert token_display(table[ids[0]]).startswith("bytes:\\x")


def test_hidden_tokens_add_no_text(tokenizer, table):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer("Hi", add_special_tokens=False).input_ids + [end]
    assert decode_text(table, ids, hidden_ids={end}) == "Hi"
    assert decode_text(table, ids) == "Hi<|im_end|>"


class _SentencePieceLike:
    """The two SentencePiece conventions: '▁' for spaces and <0xNN> byte-fallback tokens."""

    added_tokens_decoder = {0: "<s>"}
    pieces = ["<s>", "▁Hello", "▁wor", "ld", "<0xE2>", "<0x9C>", "<0x93>"]

    def __len__(self):
        return len(self.pieces)

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]


def test_sentencepiece_spaces_and_byte_fallback():
    table = token_bytes_table(_SentencePieceLike(), 7)
    assert b"".join(table[1:4]) == b" Hello world"
    assert decode_text(table, [1, 4, 5, 6]) == " Hello✓"
    assert table[0] == b"<s>"
