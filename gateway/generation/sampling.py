"""A request's sampling fields, checked against the model and the limits, as the engine's
`SamplingParams`: one builder for /v1/completions, /v1/chat/completions and SGLang's /generate.

Each API names its fields its own way (`logprobs`, `top_logprobs`, `top_logprobs_num`;
`max_tokens`, `max_new_tokens`); its route reads them off its request and names them in the
errors it raises; the checks and the defaults are the same for all three.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

from backends.errors import GrammarError
from backends.grammar.pool import GrammarBusyError
from backends.types import Grammar, SamplingParams
from gateway.errors import ContextLengthError, InvalidRequestError, RateLimitError
from gateway.models.served import ServedModel
from gateway.settings import Limits


def sampling_params(
    served: ServedModel,
    limits: Limits,
    *,
    max_tokens: int,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    top_logprobs: int = 0,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    logit_bias: dict[str, float] | None = None,
    grammar: Grammar | None = None,
    top_logprobs_field: str = "top_logprobs",
    controls: ControlFields | None = None,
) -> SamplingParams:
    """The engine's parameters for a request's fields (None: the default, as OpenAI's). Raises
    InvalidRequestError naming `top_logprobs_field` (the API's name for the alternatives reported
    per token) beyond `limits.max_top_logprobs`, and for a logit_bias that is not the model's.
    `max_tokens` comes checked (check_context), `grammar` too (checked_grammar); a seed wraps to
    its unsigned 64-bit value. `controls`: vLLM's and SGLang's fields beyond OpenAI's
    (checked_controls)."""
    if top_logprobs > limits.max_top_logprobs:
        raise InvalidRequestError(
            f"{top_logprobs_field} must be at most {limits.max_top_logprobs}", param=top_logprobs_field
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        seed=None if seed is None else seed % 2**64,
        top_logprobs=top_logprobs,
        presence_penalty=presence_penalty or 0.0,
        frequency_penalty=frequency_penalty or 0.0,
        logit_bias=check_logit_bias(served, logit_bias),
        grammar=grammar,
        **({} if controls is None else checked_controls(served, limits, controls, max_tokens)),
    )


@dataclass(frozen=True)
class ControlFields:
    """vLLM's and SGLang's sampling controls beyond OpenAI's, as a request gives them (None: the
    default, which changes nothing), with the API's names for its errors: `prefix` before each
    field's name, `min_tokens_field` for the minimum length (SGLang's `min_new_tokens`)."""

    top_k: int | None = None  # -1 and 0 (vLLM) mean every token
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] | None = None
    allowed_token_ids: Sequence[int] | None = None
    prefix: str = ""
    min_tokens_field: str = "min_tokens"


def checked_controls(
    served: ServedModel, limits: Limits, fields: ControlFields, max_tokens: int
) -> dict[str, Any]:
    """SamplingParams' fields for `fields`, each checked as vLLM checks it; InvalidRequestError
    naming the field otherwise. `bad_words` become token sequences as vLLM tokenizes them."""
    vocab = served.require_engine().info.vocab_size

    def refuse(name: str, why: str) -> InvalidRequestError:
        return InvalidRequestError(f"{name} {why}", param=fields.prefix + name)

    top_k = fields.top_k or 0
    if top_k < -1:
        raise refuse("top_k", "must be -1, 0 (every token) or at least 1")
    min_p = fields.min_p or 0.0
    if not 0.0 <= min_p <= 1.0:
        raise refuse("min_p", "must be between 0 and 1")
    penalty = 1.0 if fields.repetition_penalty is None else fields.repetition_penalty
    if not (penalty > 0.0 and math.isfinite(penalty)):
        raise refuse("repetition_penalty", "must be a finite number above 0")
    # more than max_tokens: every token held from stopping (no stop token, no end-of-sequence)
    min_tokens = min(fields.min_tokens or 0, max_tokens)
    if min_tokens < 0:
        raise refuse(fields.min_tokens_field, "must be at least 0")
    allowed = fields.allowed_token_ids
    if allowed is not None and not allowed:
        raise refuse("allowed_token_ids", "must not be empty")
    for field, ids in (("stop_token_ids", fields.stop_token_ids), ("allowed_token_ids", allowed)):
        if ids and not all(0 <= i < vocab for i in ids):
            raise refuse(field, f"must be token ids in [0, {vocab})")
    return {
        "top_k": top_k if 1 <= top_k < vocab else 0,
        "min_p": min_p,
        "repetition_penalty": penalty,
        "min_tokens": min_tokens,
        "ignore_eos": bool(fields.ignore_eos),
        "stop_token_ids": frozenset(fields.stop_token_ids or ()),
        "bad_words": bad_words_token_ids(served, limits, fields.bad_words or (), fields.prefix),
        "allowed_token_ids": None if allowed is None else tuple(sorted(set(allowed))),
    }


def bad_words_token_ids(
    served: ServedModel, limits: Limits, words: Sequence[str], prefix: str = ""
) -> tuple[tuple[int, ...], ...]:
    """Each word as vLLM's `bad_words` tokenizes it: the word, and with a space before it where
    that is another token sequence of the same length (so the word is barred both at the start of
    a text and after a space); at most `limits.max_bad_words` words."""
    tokenizer = served.require_engine().info.tokenizer
    param = prefix + "bad_words"
    if len(words) > limits.max_bad_words:
        raise InvalidRequestError(f"at most {limits.max_bad_words} bad_words are allowed", param=param)
    sequences: list[tuple[int, ...]] = []
    for word in dict.fromkeys(words):
        if not word:
            raise InvalidRequestError("bad_words must not contain an empty string", param=param)
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise InvalidRequestError(f"bad word {word[:32]!r} is no token", param=param)
        sequences.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return tuple(sequences)


async def checked_grammar(
    served: ServedModel, limits: Limits, grammar: Grammar | None, param: str
) -> Grammar | None:
    """`grammar`, carrying what the engine compiled it into within the limit (its generation
    uses that); InvalidRequestError naming `param`, with the grammar engine's message, where it
    is invalid, unenforceable, crashes the grammar engine, is slower to compile, or the engine
    constrains nothing; RateLimitError where more grammars wait to compile than the queue holds."""
    if grammar is None:
        return None
    structured = served.require_engine().structured_outputs
    if structured is None:
        raise InvalidRequestError(
            f"model {served.name!r} runs on an engine that cannot constrain output", param=param
        )
    try:
        return await structured.check(
            grammar,
            limits.grammar_compile_timeout_s,
            workers=limits.grammar_compile_workers,
            max_waiting=limits.grammar_compile_queue,
        )
    except GrammarBusyError as exc:
        raise RateLimitError(str(exc), retry_after=limits.grammar_compile_timeout_s) from None
    except GrammarError as exc:
        raise InvalidRequestError(f"{param}: {exc}", param=param) from None


def check_stop(stop: str | list[str] | None, limits: Limits) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > limits.max_stop:
        raise InvalidRequestError(f"at most {limits.max_stop} stop sequences are allowed", param="stop")
    if any(s == "" for s in stops):
        raise InvalidRequestError("stop sequences must not be empty strings", param="stop")
    return stops


def check_logit_bias(served: ServedModel, bias: dict[str, float] | None) -> dict[int, float]:
    parsed: dict[int, float] = {}
    vocab = served.require_engine().info.vocab_size
    for key, value in (bias or {}).items():
        # ASCII digits only: str.isdigit() also accepts "²" and "١", and int() rejects very long keys
        if not (key.isascii() and key.isdigit()) or len(key) > 20 or int(key) >= vocab:
            raise InvalidRequestError(
                f"logit_bias key {key[:32]!r} is not a token id in [0, {vocab})", param="logit_bias"
            )
        if not -100.0 <= value <= 100.0:
            raise InvalidRequestError("logit_bias values must be between -100 and 100", param="logit_bias")
        parsed[int(key)] = value
    return parsed


def check_context(served: ServedModel, prompt_len: int, max_tokens: int | None, limits: Limits) -> int:
    """The number of tokens to generate (default: what the context and the limit allow); raises when
    prompt + completion exceed the context or max_tokens exceeds the configured limit."""
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise InvalidRequestError(f"max_tokens must be at most {limits.max_tokens}", param="max_tokens")
    context = served.require_engine().info.max_model_len
    too_long = prompt_len > context if max_tokens is not None else prompt_len >= context
    if too_long or (max_tokens is not None and prompt_len + max_tokens > context):
        asked = "" if max_tokens is None else f" and asks for {max_tokens} completion tokens"
        raise ContextLengthError(
            f"this model's maximum context length is {context} tokens; "
            f"the request has {prompt_len} prompt tokens{asked}",
            param="prompt" if too_long else "max_tokens",
        )
    if max_tokens is None:
        max_tokens = min(context - prompt_len, limits.max_tokens)
    return max_tokens


def check_choices(n: int, limits: Limits) -> int:
    if n > limits.max_n:
        raise InvalidRequestError(f"n must be at most {limits.max_n}", param="n")
    return n


def check_logprob_entries(entries: int, limits: Limits, instead: str, param: str | None) -> None:
    """Refuse, before any work, an answer of more than `limits.max_logprob_entries` logprob values
    (each position's own, its top logprobs, its named token ids); `instead` says what to ask."""
    if entries > limits.max_logprob_entries:
        raise InvalidRequestError(
            f"this request asks for {entries} logprob entries (prompts x choices x positions x "
            f"logprobs per position), more than the {limits.max_logprob_entries} one answer may carry; "
            f"{instead}",
            param=param,
        )


# A response sent whole takes its tokens from the engine in bursts of up to this many, as SGLang
# hands its own non-streamed requests' tokens from its scheduler to its tokenizer manager.
WHOLE_RESPONSE_INTERVAL = 50


def delivered(
    params: SamplingParams, *, logprobs: bool, streamed: bool, stops: Collection[object]
) -> SamplingParams:
    """`params` for what the answer needs of each token: its logprob only where the answer
    reports logprobs; tokens one at a time where the client reads them as they come or where a
    stop string or stop token may end the choice early (tokens of a burst past it would be
    generated for nothing), else in bursts."""
    interval = 1 if streamed or stops or params.stop_token_ids else WHOLE_RESPONSE_INTERVAL
    return replace(params, logprobs=logprobs, stream_interval=interval)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choices of one request differ: each gets its own seed derived from the request's seed."""
    if params.seed is None or index == 0:
        return params
    return replace(params, seed=(params.seed + index) % 2**64)
