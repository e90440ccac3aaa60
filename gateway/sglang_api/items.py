"""A /generate request as its `Item`s: one per prompt and sample, prompt-major (prompt i's n
samples, then prompt i+1's), each checked once here, before any engine work: its prompt, its
sampling (SGLang's fields on the shared builder, gateway/generation/sampling.py), its logprobs and
the size of its answer. Semantics follow SGLang 0.5.17 (`tokenizer_manager`, `io_struct`)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backends.types import Grammar, SamplingParams
from gateway.errors import ContextLengthError, InvalidRequestError
from gateway.generation import sampling
from gateway.models.served import ServedModel
from gateway.prompts import check_text_chars, check_token_ids, tokenize
from gateway.schemas.sglang import GenerateRequest, SglangSamplingParams
from gateway.settings import Limits

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's


@dataclass
class Item:
    """One prompt and one sample of a /generate request, checked."""

    served: ServedModel
    adapter: str | None
    ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stops: list[str]
    no_stop_trim: bool
    shown_ids: frozenset[int]  # special tokens whose text the output keeps (skip_special_tokens false)
    rid: str
    return_logprob: bool
    start: int  # first prompt position with an input logprob (P: none)
    top_k: int
    with_text: bool
    token_ids: list[int] | None  # token_ids_logprob: ids whose logprobs every position reports


def _unsupported(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"{message} is not supported by this gateway", param=param)


def _per_item(value: Any, count: int, param: str) -> list[Any]:
    """A scalar broadcast over the batch, or a list with one value per prompt."""
    if isinstance(value, list):
        if len(value) != count:
            raise InvalidRequestError(f"{param} has {len(value)} values for {count} prompts", param=param)
        return value
    return [value] * count


def _token_list(value: Any, param: str = "input_ids") -> list[int]:
    """A token-id list decoded as `list[Any]` (msgspec cannot tell list[int] from list[list[int]]);
    1.0 counts as 1, as JSON Schema and the typed fields of the other routes take it."""
    if isinstance(value, list):
        ids = [int(i) if isinstance(i, float) and i.is_integer() and abs(i) < 2**63 else i for i in value]
        if all(type(i) is int and i >= 0 for i in ids):
            return ids
    raise InvalidRequestError(
        "input_ids must be a list of token ids or a list of token-id lists", param="input_ids"
    )


def _token_ids_per_prompt(served: ServedModel, value: list[Any] | None, count: int) -> list[list[int] | None]:
    """`token_ids_logprob`: one id list for every prompt, or one per prompt; `[]` means none."""
    if not value:
        return [None] * count
    lists = _per_item(value, count, "token_ids_logprob") if isinstance(value[0], list) else [value] * count
    return [
        check_token_ids(served, _token_list(ids, "token_ids_logprob"), "token_ids_logprob") if ids else None
        for ids in lists
    ]


def prompt_ids(served: ServedModel, body: GenerateRequest, limits: Limits) -> tuple[list[list[int]], bool]:
    """The prompts' token ids, and whether the request is a batch. Text is tokenized with the
    tokenizer's special tokens (BOS), token ids are taken as they are: SGLang's rules. Tokenizes:
    call it off the event loop."""
    if body.image_data is not None:
        raise _unsupported("image_data", "image_data")
    if body.input_ids is not None:
        value = body.input_ids
        if not value:
            raise InvalidRequestError("input_ids cannot be empty.", param="input_ids")
        batch = isinstance(value[0], list)
        items = [_token_list(item) for item in (value if batch else [value])]
    elif body.text is not None:
        batch = isinstance(body.text, list)
        items = body.text if batch else [body.text]
        if not items or any(not t for t in items):
            raise InvalidRequestError("texts cannot be empty and tokenizer must be initialized", param="text")
    else:
        raise InvalidRequestError("Either text, input_ids or input_embeds should be provided.", param="text")
    if len(items) > limits.max_prompts:
        raise InvalidRequestError(f"at most {limits.max_prompts} prompts per request", param="text")
    check_text_chars(served, limits, max((len(i) for i in items if isinstance(i, str)), default=0), "text")
    ids = [
        tokenize(served, item, add_special_tokens=True, param="text")
        if isinstance(item, str)
        else check_token_ids(served, item, "input_ids")
        for item in items
    ]
    return ids, batch


def _check_unsupported(sp: SglangSamplingParams) -> None:
    """What SGLang's sampler does and ours does not: refused, never silently ignored."""
    if sp.top_k is not None and (sp.top_k < -1 or sp.top_k == 0):
        raise InvalidRequestError("top_k must be -1 or at least 1", param="sampling_params.top_k")
    if sp.spaces_between_special_tokens is False:
        raise _unsupported(
            "spaces_between_special_tokens = false", "sampling_params.spaces_between_special_tokens"
        )
    if sp.stop_regex:
        raise _unsupported("stop_regex", "sampling_params.stop_regex")
    constraints = [k for k in ("regex", "json_schema", "ebnf", "structural_tag") if getattr(sp, k)]
    if len(constraints) > 1:
        raise InvalidRequestError(
            "Only one of json_schema, regex, ebnf, or structural_tag can be set.", param="sampling_params"
        )
    if sp.structural_tag:
        raise _unsupported("structural_tag", "sampling_params.structural_tag")


def grammar_of(sp: SglangSamplingParams | None) -> tuple[Grammar | None, str]:
    """The grammar SGLang's `regex`, `json_schema` or `ebnf` asks for, and its field."""
    for kind in ("regex", "json_schema", "ebnf"):
        source = getattr(sp, kind, None)
        if source:
            return Grammar(kind, source), f"sampling_params.{kind}"
    return None, "sampling_params"


def sampling_of(
    served: ServedModel,
    sp: SglangSamplingParams | None,
    top_k: int,
    limits: Limits,
    grammar: Grammar | None = None,
) -> tuple[SamplingParams, list[str]]:
    """Our sampling parameters for SGLang's (`top_k`: top_logprobs_num; the stop ids their
    `stop_token_ids`), with the stop strings; max_new_tokens is the parameters' max_tokens."""
    sp = sp or SglangSamplingParams()
    _check_unsupported(sp)
    if sp.max_new_tokens is not None and sp.max_new_tokens > limits.max_tokens:
        raise InvalidRequestError(
            f"max_new_tokens must be at most {limits.max_tokens}", param="sampling_params.max_new_tokens"
        )
    max_new = sp.max_new_tokens
    if max_new is None:
        max_new = min(DEFAULT_MAX_NEW_TOKENS, limits.max_tokens)
    params = sampling.sampling_params(
        served,
        limits,
        max_tokens=max_new,
        temperature=sp.temperature,
        top_p=sp.top_p,
        seed=sp.sampling_seed,
        top_logprobs=top_k,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        logit_bias=sp.logit_bias,
        grammar=grammar,
        top_logprobs_field="top_logprobs_num",
        controls=sampling.ControlFields(
            top_k=sp.top_k,
            min_p=sp.min_p,
            repetition_penalty=sp.repetition_penalty,
            min_tokens=sp.min_new_tokens,
            ignore_eos=sp.ignore_eos,
            stop_token_ids=sp.stop_token_ids,
            prefix="sampling_params.",
            min_tokens_field="min_new_tokens",
        ),
    )
    return params, sampling.check_stop(sp.stop, limits)


def _rids(rid: str | list[str] | None, count: int, batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, list):
        rids = _per_item(rid, count, "rid")
        if len(set(rids)) != len(rids):
            raise InvalidRequestError("rid must be unique within a batch", param="rid")
        return rids
    return [f"{rid}_{i}" for i in range(count)] if batch else [rid]


async def plan(body: GenerateRequest, served_for: Any, limits: Limits) -> tuple[list[Item], bool]:
    """The request's items, prompt-major, and whether it answers a list (a batch, or n > 1).
    `served_for(lora_path)` resolves a prompt's model and adapter."""
    adapters = body.lora_path if isinstance(body.lora_path, list) else None
    first_served, _ = served_for(None if adapters is not None else body.lora_path)
    ids, batch = await asyncio.to_thread(prompt_ids, first_served, body, limits)
    count = len(ids)
    lora = _per_item(body.lora_path, count, "lora_path")
    sps = _per_item(body.sampling_params, count, "sampling_params")
    ns = {(sp.n if sp is not None and sp.n is not None else 1) for sp in sps}
    if len(ns) > 1:
        raise InvalidRequestError("n must be the same for every prompt", param="sampling_params.n")
    n = sampling.check_choices(ns.pop(), limits)
    per_item = ("return_logprob", "logprob_start_len", "top_logprobs_num")
    if n > 1 and any(isinstance(getattr(body, f), list) for f in per_item):
        raise InvalidRequestError(
            "return_logprob, logprob_start_len and top_logprobs_num must be scalars when n > 1",
            param="sampling_params.n",
        )
    token_ids = _token_ids_per_prompt(first_served, body.token_ids_logprob, count)
    if n > 1 and body.token_ids_logprob and isinstance(body.token_ids_logprob[0], list):
        raise InvalidRequestError("token_ids_logprob must be one list when n > 1", param="token_ids_logprob")
    want = _per_item(body.return_logprob, count, "return_logprob")
    starts = _per_item(body.logprob_start_len, count, "logprob_start_len")
    tops = _per_item(body.top_logprobs_num, count, "top_logprobs_num")
    rids = _rids(body.rid, count, batch)  # n > 1: children are <rid>_<hex>
    items = []
    for i, prompt in enumerate(ids):
        served, adapter = served_for(lora[i])
        top_k = tops[i] or 0
        grammar = await sampling.checked_grammar(served, limits, *grammar_of(sps[i]))
        params, stops = sampling_of(served, sps[i], top_k, limits, grammar)
        params = sampling.delivered(params, logprobs=bool(want[i]), streamed=bool(body.stream), stops=stops)
        try:
            sampling.check_context(served, len(prompt), params.max_tokens, limits)
        except ContextLengthError as exc:  # named as SGLang's fields
            exc.param = "input_ids" if exc.param == "prompt" else "sampling_params.max_new_tokens"
            raise
        start = -1 if starts[i] is None else starts[i]
        if start < -1:
            raise InvalidRequestError("logprob_start_len must be -1 or at least 0", param="logprob_start_len")
        if start > len(prompt):
            raise InvalidRequestError(
                f"req.logprob_start_len={start} is higher than the number of input tokens "
                f"{len(prompt)}. Please use a smaller logprob_start_len.",
                param="logprob_start_len",
            )
        for j in range(n):
            items.append(
                Item(
                    served,
                    adapter,
                    prompt,
                    sampling.choice_params(params, j),
                    params.max_tokens,
                    stops,
                    bool(sps[i] and sps[i].no_stop_trim),
                    served.special_ids if sps[i] and sps[i].skip_special_tokens is False else frozenset(),
                    rids[i] if n == 1 else f"{rids[i]}_{uuid.uuid4().hex}",
                    bool(want[i]),
                    len(prompt) if start == -1 else start,
                    top_k,
                    bool(body.return_text_in_logprobs),
                    token_ids[i],
                )
            )
    check_answer_size(items, bool(body.token_ids_logprob), limits)  # before any engine work
    return items, batch or n > 1


def logprob_entries(item: Item) -> int:
    """The triples an item's answer carries: per prompt position from `start` and per token it
    may generate (max_new_tokens = 0 reports one), its own, its top-k and its named ids."""
    if not item.return_logprob:
        return 0
    per_position = 1 + item.top_k + len(item.token_ids or ())
    return per_position * (len(item.ids) - item.start + max(item.max_new_tokens, 1))


def check_answer_size(items: Sequence[Item], names_token_ids: bool, limits: Limits) -> None:
    """Refuse a request whose answer would carry more triples than the limit (a 400)."""
    sampling.check_logprob_entries(
        sum(map(logprob_entries, items)),
        limits,
        "name fewer token_ids_logprob, ask a smaller top_logprobs_num, start later with "
        "logprob_start_len, split the batch, or ask /v1/next_token_logprobs for whole rows",
        "token_ids_logprob" if names_token_ids else "logprob_start_len",
    )
