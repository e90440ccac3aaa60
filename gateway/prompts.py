"""Turning request inputs (strings, token ids, lists of either) into checked token-id lists."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import InvalidRequestError, too_many_inputs
from gateway.models.served import ServedModel
from gateway.settings import Limits


@dataclass
class TokenInput:
    ids: list[int]
    text: str | None  # the string it came from, when it came from one


# Characters per token of context that a text may have by default: 4x the densest natural text
# measured (code and docs make 3-4 characters a token), yet few enough that the worst text (a
# token per UTF-8 byte) holds the GIL only briefly while its token ids become Python objects.
DEFAULT_CHARS_PER_TOKEN = 16


def max_text_chars(served: ServedModel, limits: Limits) -> int:
    """The most characters one text may have: `limits.max_text_chars`, or by default
    DEFAULT_CHARS_PER_TOKEN per token of the model's context."""
    if limits.max_text_chars is not None:
        return limits.max_text_chars
    return served.require_engine().info.max_model_len * DEFAULT_CHARS_PER_TOKEN


def check_text_chars(served: ServedModel, limits: Limits, chars: int, param: str) -> None:
    """Refuses a text of `chars` characters over `max_text_chars`, before anything tokenizes it."""
    limit = max_text_chars(served, limits)
    if chars > limit:
        raise InvalidRequestError(
            f"{param} has a text of {chars} characters; at most {limit} are allowed per text",
            param=param,
            code="string_above_max_length",
        )


def has_text(value: str | list) -> bool:
    """Whether a request input in OpenAI's four forms holds strings (to tokenize off the event loop)."""
    return isinstance(value, str) or (bool(value) and isinstance(value[0], str))


def tokenize(
    served: ServedModel, text: str, *, add_special_tokens: bool, param: str, allow_empty: bool = False
) -> list[int]:
    """Blocks for as long as the text takes: call it off the event loop (asyncio.to_thread), where
    fast tokenizers release the GIL while they encode."""
    ids = list(served.require_engine().info.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    if not ids and not allow_empty:  # a model cannot continue nothing
        raise InvalidRequestError(f"{param} is empty after tokenization", param=param)
    return ids


def check_token_ids(served: ServedModel, ids: list[int], param: str) -> list[int]:
    """`ids` as they are, once each is known to the model (check_token_rows)."""
    return check_token_rows(served, [ids], param)[0]


def check_token_rows(served: ServedModel, rows: list[list[int]], param: str) -> list[list[int]]:
    """`rows` as they are, once every id is known to the model: they come decoded as the schemas'
    TokenId, never negative, so only the largest is compared (one pass in C over every row, not
    one in Python); the first row at fault is named."""
    vocab = served.require_engine().info.vocab_size
    if not all(rows) or max(map(max, rows)) >= vocab:
        fault = next(ids for ids in rows if not ids or max(ids) >= vocab)
        if not fault:
            raise InvalidRequestError(f"{param} must not contain an empty token list", param=param)
        bad = next(i for i in fault if i >= vocab)
        raise InvalidRequestError(
            f"token id {bad} in {param} is outside the vocabulary [0, {vocab})", param=param
        )
    return rows


def token_inputs(
    served: ServedModel,
    value: str | list,
    *,
    add_special_tokens: bool,
    limits: Limits,
    max_items: int,
    param: str,
) -> list[TokenInput]:
    """OpenAI's four input forms: a string, strings, a token-id list, or token-id lists. Tokenizes:
    call it off the event loop when `has_text(value)`."""
    if isinstance(value, str):
        items: list = [value]
    elif value and all(isinstance(v, int) for v in value):
        items = [value]
    elif value and (all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value)):
        items = value
    else:
        raise InvalidRequestError(
            f"{param} must be a non-empty string, list of strings, list of token ids, or list of token-id lists",
            param=param,
        )
    if len(items) > max_items:
        raise too_many_inputs(max_items, param)
    if not isinstance(items[0], str):  # token-id lists (all of them, as checked above)
        return [TokenInput(ids, None) for ids in check_token_rows(served, items, param)]
    check_text_chars(served, limits, max(map(len, items)), param)
    inputs = []
    for item in items:
        if not item:
            raise InvalidRequestError(f"{param} must not contain an empty string", param=param)
        inputs.append(
            TokenInput(tokenize(served, item, add_special_tokens=add_special_tokens, param=param), item)
        )
    return inputs
