"""The vocabulary, tokenizer-files, tokenize and detokenize endpoints against the real server: the
exact bytes of every token id, byte-exact round trips of multi-byte UTF-8, the chat template, and a
tokenizer rebuilt offline from the served files that tokenizes like the model's own."""

from __future__ import annotations

import base64
from pathlib import Path

import msgspec
import pytest

from gateway.models.chat_template import chat_template_text
from gateway.settings import ModelSettings
from tests.conftest import MODEL

pytestmark = pytest.mark.slow

VOCAB = 49152
MSGPACK = "application/msgpack"
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld",
    "日本語",
    "🎉",
    "mixed: naïve café, 日本語 and 🎉🎉 emoji\n\ttabs  and   spaces",
    " leading space and trailing newline\n",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say héllo in 日本語 🎉"},
    {"role": "assistant", "content": "こんにちは"},
    {"role": "user", "content": "Thanks!"},
]


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: printable stand-in character -> byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


@pytest.fixture(scope="module")
def vocabulary(http) -> dict:
    response = http.get(f"/v1/models/{MODEL}/vocabulary")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    return response.json()


@pytest.fixture(scope="module")
def table(vocabulary) -> list[bytes]:
    return [base64.b64decode(t, validate=True) for t in vocabulary["tokens"]]


def tokenize(http, path: str = "/v1/tokenize", **fields) -> dict:
    response = http.post(path, json={"model": MODEL, **fields})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["count"] == len(body["tokens"])
    return body


def detokenize(http, tokens: list[int], path: str = "/v1/detokenize") -> str:
    response = http.post(path, json={"model": MODEL, "tokens": tokens})
    assert response.status_code == 200, response.text
    return response.json()["prompt"]


def test_the_model_card_reports_the_compute_dtype(http):
    card = http.get(f"/v1/models/{MODEL}").json()
    assert card["dtype"] == "float32" and card["vocab_size"] == VOCAB


def test_vocabulary_json_and_msgpack_agree(http, vocabulary, table, reference):
    assert vocabulary["object"] == "vocabulary"
    assert vocabulary["model"] == MODEL
    assert vocabulary["vocab_size"] == len(vocabulary["tokens"]) == len(table) == VOCAB
    assert vocabulary["tokenizer_size"] == len(reference.tokenizer)
    assert vocabulary["eos_token_ids"] == [2]
    assert vocabulary["bos_token_id"] == reference.tokenizer.bos_token_id
    assert set(reference.tokenizer.all_special_ids) <= set(vocabulary["special_token_ids"])
    assert 2 in vocabulary["special_token_ids"]
    marked = {i for i, t in reference.tokenizer.added_tokens_decoder.items() if t.special}
    assert set(vocabulary["special_token_ids"]) == marked | set(reference.tokenizer.all_special_ids)
    assert len(marked) == 17

    response = http.get(f"/v1/models/{MODEL}/vocabulary", headers={"Accept": MSGPACK})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith(MSGPACK)
    binary = msgspec.msgpack.decode(response.content)
    assert {k: v for k, v in binary.items() if k != "tokens"} == {
        k: v for k, v in vocabulary.items() if k != "tokens"
    }
    assert all(isinstance(t, bytes) for t in binary["tokens"])
    assert binary["tokens"] == table
    assert len(response.content) < len(http.get(f"/v1/models/{MODEL}/vocabulary").content)


def test_every_token_has_its_exact_bytes(table, reference):
    """Checked against the tokenizer's own token strings, decoded independently of the gateway."""
    decoder = byte_decoder()
    added = {i: t.content for i, t in reference.tokenizer.added_tokens_decoder.items()}
    tokens = reference.tokenizer.convert_ids_to_tokens(list(range(len(reference.tokenizer))))
    for i, token in enumerate(tokens):
        want = added[i].encode() if i in added else bytes(decoder[c] for c in token)
        assert table[i] == want, (i, token, table[i])
    assert table[2] == reference.tokenizer.convert_ids_to_tokens(2).encode() == b"<|im_end|>"
    assert len(set(table)) == len(table)  # every id spells different bytes


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_bytes_and_detokenize_round_trip(http, table, reference, text):
    body = tokenize(http, prompt=text, add_special_tokens=False)
    assert body["max_model_len"] == 8192
    ids = body["tokens"]
    assert ids == reference.tokenizer(text, add_special_tokens=False).input_ids
    assert b"".join(table[i] for i in ids) == text.encode()
    assert detokenize(http, ids) == text
    # the routes without /v1 (vLLM's spelling) answer the same
    assert tokenize(http, "/tokenize", prompt=text, add_special_tokens=False)["tokens"] == ids
    assert detokenize(http, ids, "/detokenize") == text


def test_text_the_tokenizer_drops_tokenizes_to_nothing(http, reference):
    for text in ("", "\x04", "\x06\x13"):
        body = tokenize(http, prompt=text, add_special_tokens=False)
        assert body["tokens"] == reference.tokenizer(text, add_special_tokens=False).input_ids == []


def test_tokenize_with_special_tokens(http, reference):
    for text in TEXTS[:3]:
        assert tokenize(http, prompt=text)["tokens"] == reference.tokenizer(text).input_ids
        assert (
            tokenize(http, prompt=text, add_special_tokens=True)["tokens"]
            == reference.tokenizer(text, add_special_tokens=True).input_ids
        )
    assert tokenize(http, prompt="")["tokens"] == []
    special = reference.tokenizer("<|im_start|>user", add_special_tokens=False).input_ids
    assert special[0] == 1
    assert tokenize(http, prompt="<|im_start|>user", add_special_tokens=False)["tokens"] == special


def test_return_token_strs(http, table):
    text = "héllo 日本語 🎉"
    body = tokenize(http, prompt=text, add_special_tokens=False, return_token_strs=True)
    strs = body["token_strs"]
    assert len(strs) == body["count"] == len(body["tokens"])
    partial = 0
    for i, s in zip(body["tokens"], strs, strict=True):
        raw = table[i]
        try:
            assert s == raw.decode()
        except UnicodeDecodeError:  # a piece of a multi-byte character
            partial += 1
            assert s == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    assert partial > 0  # this text does split characters across tokens
    assert tokenize(http, prompt="Hello world", add_special_tokens=False, return_token_strs=True)[
        "token_strs"
    ] == ["Hello", " world"]
    assert tokenize(http, prompt=text, add_special_tokens=False)["token_strs"] is None


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_messages_uses_the_chat_template(http, table, reference, add_generation_prompt):
    text = reference.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    want = reference.tokenizer(text, add_special_tokens=False).input_ids
    body = tokenize(http, messages=MESSAGES, add_generation_prompt=add_generation_prompt)
    assert body["tokens"] == want
    assert b"".join(table[i] for i in body["tokens"]) == text.encode()
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    assert detokenize(http, body["tokens"]) == text


def test_tokenize_needs_exactly_one_of_prompt_or_messages(http):
    for fields in ({}, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}):
        response = http.post("/v1/tokenize", json={"model": MODEL, **fields})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt"
    response = http.post("/v1/detokenize", json={"model": MODEL, "tokens": [VOCAB]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"
    for path in ("vocabulary", "tokenizer"):
        response = http.get(f"/v1/models/no-such-model/{path}")
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_tokenizer_files_rebuild_the_tokenizer(http, reference, tmp_path: Path):
    from transformers import AutoTokenizer

    response = http.get(f"/v1/models/{MODEL}/tokenizer")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "tokenizer" and body["model"] == MODEL
    files = body["files"]
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    for name, text in files.items():
        assert "/" not in name and name not in ("", ".", "..")
        (tmp_path / name).write_text(text)

    rebuilt = AutoTokenizer.from_pretrained(tmp_path)
    assert len(rebuilt) == len(reference.tokenizer)
    assert rebuilt.eos_token_id == reference.tokenizer.eos_token_id
    assert rebuilt.bos_token_id == reference.tokenizer.bos_token_id
    for text in TEXTS:
        for special in (False, True):
            assert (
                rebuilt(text, add_special_tokens=special).input_ids
                == reference.tokenizer(text, add_special_tokens=special).input_ids
            )
        ids = reference.tokenizer(text, add_special_tokens=False).input_ids
        assert rebuilt.decode(ids) == reference.tokenizer.decode(ids) == text
    # the template served (the default model's is shipped with the gateway), which renders these
    # messages as the model's own does
    assert rebuilt.chat_template == chat_template_text(ModelSettings(model=MODEL))
    for add_generation_prompt in (True, False):
        assert rebuilt.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False
        ) == reference.tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False
        )
