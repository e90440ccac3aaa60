"""Turning request inputs (strings, token ids, lists of either) into checked token-id lists."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import InvalidRequestError
from gateway.registry import ServedModel


@dataclass
class TokenInput:
    ids: list[int]
    text: str | None  # the string it came from, when it came from one


def tokenize(
    served: ServedModel, text: str, *, add_special_tokens: bool, param: str, allow_empty: bool = False
) -> list[int]:
    ids = list(served.require_engine().tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    if not ids and not allow_empty:  # a model cannot continue nothing
        raise InvalidRequestError(f"{param} is empty after tokenization", param=param)
    return ids


def check_token_ids(served: ServedModel, ids: list[int], param: str) -> list[int]:
    """`ids` as they are, once each is known to the model: they come decoded as the schemas'
    TokenId, never negative, so only the largest is compared (one pass in C, not one in Python)."""
    vocab = served.require_engine().vocab_size
    if not ids:
        raise InvalidRequestError(f"{param} must not contain an empty token list", param=param)
    if max(ids) >= vocab:
        bad = next(i for i in ids if i >= vocab)
        raise InvalidRequestError(
            f"token id {bad} in {param} is outside the vocabulary [0, {vocab})", param=param
        )
    return ids


def token_inputs(
    served: ServedModel, value: str | list, *, add_special_tokens: bool, max_items: int, param: str
) -> list[TokenInput]:
    """OpenAI's four input forms: a string, strings, a token-id list, or token-id lists."""
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
        raise InvalidRequestError(f"at most {max_items} inputs per request in {param}", param=param)
    inputs = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise InvalidRequestError(f"{param} must not contain an empty string", param=param)
            inputs.append(
                TokenInput(tokenize(served, item, add_special_tokens=add_special_tokens, param=param), item)
            )
        else:
            inputs.append(TokenInput(check_token_ids(served, item, param), None))
    return inputs
