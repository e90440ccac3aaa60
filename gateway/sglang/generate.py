"""SGLang's POST /generate on this gateway's generation machinery (gateway/generation.py).

A request becomes a list of `Item`s (prompt-major: prompt i's n samples, then prompt i+1's),
each checked once here; an item runs as a stream of cumulative results, SGLang's shape in both
its streaming and its plain answers. Semantics follow SGLang 0.5.17 (`tokenizer_manager`,
`schedule_batch`, `logprob_result_processor`): stop strings cut `text` but not `output_ids`;
input logprobs cover prompt positions logprob_start_len .. P-1 with the first entry null;
max_new_tokens = 0 scores the prompt and reports one triple for the would-be next token.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np

from backends.types import SamplingParams, TokenStep
from backends.vocab import decode_text
from gateway.errors import ContextLengthError, InvalidRequestError
from gateway.generation import choices as gen
from gateway.prompts import check_text_chars, check_token_ids, tokenize
from gateway.registry import ServedModel
from gateway.schemas.sglang import (
    ABORTED,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    MetaInfo,
    SglangSamplingParams,
    Triple,
)
from gateway.settings import Limits
from gateway.sglang.triples import (
    Scores,
    Triples,
    at_temperature,
    check_answer_size,
    input_scores,
    next_token_rows,
)

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
    stop_ids: frozenset[int]
    no_stop_trim: bool
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


def _check_unsupported(sp: SglangSamplingParams, vocab_size: int) -> None:
    """What SGLang's sampler does and ours does not: refused, never silently ignored."""
    if sp.top_k is not None and sp.top_k not in (-1, 1) and sp.top_k < vocab_size:
        if sp.top_k < -1 or sp.top_k == 0:
            raise InvalidRequestError("top_k must be -1 or at least 1", param="sampling_params.top_k")
        raise _unsupported("top_k other than -1, 1 or the vocabulary size", "sampling_params.top_k")
    if sp.min_p:
        raise _unsupported("min_p other than 0", "sampling_params.min_p")
    if sp.repetition_penalty not in (None, 1.0):
        raise _unsupported("repetition_penalty other than 1", "sampling_params.repetition_penalty")
    if sp.min_new_tokens:
        raise _unsupported("min_new_tokens other than 0", "sampling_params.min_new_tokens")
    if sp.ignore_eos:
        raise _unsupported("ignore_eos", "sampling_params.ignore_eos")
    if sp.skip_special_tokens is False:
        raise _unsupported("skip_special_tokens = false", "sampling_params.skip_special_tokens")
    if sp.stop_regex:
        raise _unsupported("stop_regex", "sampling_params.stop_regex")
    constraints = [k for k in ("regex", "json_schema", "ebnf", "structural_tag") if getattr(sp, k)]
    if len(constraints) > 1:
        raise InvalidRequestError(
            "Only one of json_schema, regex, ebnf, or structural_tag can be set.", param="sampling_params"
        )
    if constraints:
        raise _unsupported(f"constrained decoding ({constraints[0]})", f"sampling_params.{constraints[0]}")


def sampling(
    served: ServedModel, sp: SglangSamplingParams | None, top_k: int, limits: Limits
) -> tuple[SamplingParams, int, list[str], frozenset[int]]:
    """Our sampling parameters for SGLang's, with max_new_tokens, the stop strings and stop ids."""
    sp = sp or SglangSamplingParams()
    vocab_size = served.require_engine().vocab_size
    _check_unsupported(sp, vocab_size)
    stop_ids = frozenset(sp.stop_token_ids or ())
    if stop_ids and max(stop_ids) >= vocab_size:
        raise InvalidRequestError(
            f"stop_token_ids must be below the vocabulary size {vocab_size}",
            param="sampling_params.stop_token_ids",
        )
    if sp.max_new_tokens is not None and sp.max_new_tokens > limits.max_tokens:
        raise InvalidRequestError(
            f"max_new_tokens must be at most {limits.max_tokens}", param="sampling_params.max_new_tokens"
        )
    max_new = sp.max_new_tokens
    if max_new is None:
        max_new = min(DEFAULT_MAX_NEW_TOKENS, limits.max_tokens)
    params = SamplingParams(
        max_tokens=max_new,
        temperature=0.0 if sp.top_k == 1 else (1.0 if sp.temperature is None else sp.temperature),
        top_p=1.0 if sp.top_p is None else sp.top_p,
        seed=None if sp.sampling_seed is None else sp.sampling_seed % 2**64,
        top_logprobs=top_k,
        presence_penalty=sp.presence_penalty or 0.0,
        frequency_penalty=sp.frequency_penalty or 0.0,
        logit_bias=gen.check_logit_bias(served, sp.logit_bias),
    )
    return params, max_new, gen.check_stop(sp.stop, limits), stop_ids


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
    n = gen.check_choices(ns.pop(), limits)
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
        if top_k > limits.max_top_logprobs:
            raise InvalidRequestError(
                f"top_logprobs_num must be at most {limits.max_top_logprobs}", param="top_logprobs_num"
            )
        params, max_new, stops, stop_ids = sampling(served, sps[i], top_k, limits)
        try:
            gen.check_context(served, len(prompt), max_new, limits)
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
                    gen.choice_params(params, j),
                    max_new,
                    stops,
                    stop_ids,
                    bool(sps[i] and sps[i].no_stop_trim),
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


def _finish(item: Item, piece_text: str, steps: Sequence[TokenStep], reason: str) -> tuple[str, FinishReason]:
    """SGLang's finish reason, and the text as it ends (`no_stop_trim` keeps the stop string)."""
    if reason == "length":
        return piece_text, FinishReason(type="length", length=item.max_new_tokens)
    if reason == "abort":
        return piece_text, ABORTED
    served = item.served
    full = decode_text(served.token_bytes, [s.token_id for s in steps], served.special_ids)
    found = [(full.find(s, len(piece_text)), i, s) for i, s in enumerate(item.stops)]
    found = [f for f in found if f[0] == len(piece_text)]
    if found:  # a stop string: SGLang checks strings before ids
        matched = min(found)[2]
        return piece_text + matched if item.no_stop_trim else piece_text, FinishReason(
            type="stop", matched=matched
        )
    return piece_text, FinishReason(type="stop", matched=steps[-1].token_id)


class ItemRun:
    """One item as a stream of cumulative results (SGLang's default streaming mode)."""

    def __init__(self, item: Item) -> None:
        self.item = item
        self.triples = Triples(item)
        self.started = time.perf_counter()
        self.completion_tokens = 0
        self.output_token_ids: list[list[Triple]] = []  # token_ids_logprob's, per scored step
        self.rescored: list[TokenStep] = []  # scored steps with logprobs at the temperature

    def _rescales(self) -> bool:
        return self.item.params.temperature not in (0.0, 1.0)

    async def _score_rows(self, scored: Sequence[TokenStep]) -> list[TokenStep]:
        """The steps as reported: from the engine's whole row before each step when the request
        names token ids or samples at a temperature other than 0 and 1 (SGLang reports sampled
        tokens' logprobs at the temperature); as generated otherwise."""
        item = self.item
        if not item.return_logprob or not (self._rescales() or item.token_ids is not None):
            return list(scored)
        done = len(self.rescored)
        prefixes = [item.ids + [s.token_id for s in scored[:i]] for i in range(done, len(scored))]
        wanted = None if item.token_ids is None else np.asarray(item.token_ids, dtype=np.int64)
        for step, raw in zip(scored[done:], await next_token_rows(item, prefixes), strict=True):
            row = at_temperature(raw, item.params.temperature)
            if wanted is not None:
                self.output_token_ids.append(self.triples.make(row[wanted].tolist(), item.token_ids))
            if self._rescales():
                top = np.argsort(-row, kind="stable")[: item.top_k]
                step = replace(step, logprob=float(row[step.token_id]), top_ids=top, top_logprobs=row[top])
            self.rescored.append(step)
        return self.rescored[: len(scored)]

    def _result(
        self,
        text: str,
        steps: Sequence[TokenStep],
        scores: Scores,
        finish: FinishReason | None,
        scored: Sequence[TokenStep] = (),
    ) -> GenerateResponse:
        item = self.item
        output_ids = [s.token_id for s in steps]
        meta = MetaInfo(
            id=item.rid,
            finish_reason=finish,
            prompt_tokens=len(item.ids),
            completion_tokens=len(output_ids),
            weight_version=item.served.weight_version,  # the weights now: the last token's
        )
        if item.return_logprob:
            meta.input_token_logprobs = scores.input_tokens
            meta.output_token_logprobs = self.triples.make(
                [s.logprob for s in scored], [s.token_id for s in scored]
            )
            meta.output_token_logprobs_length = len(scored)
            if item.top_k:
                meta.input_top_logprobs = scores.input_top
                meta.output_top_logprobs = [self.triples.top(s.top_ids, s.top_logprobs) for s in scored]
            if item.token_ids is not None:
                meta.input_token_ids_logprobs = scores.input_token_ids
                meta.output_token_ids_logprobs = self.output_token_ids[: len(scored)]
        if finish is not None:
            meta.e2e_latency = time.perf_counter() - self.started
        return GenerateResponse(text=text, output_ids=output_ids, meta_info=meta)

    async def results(self, final_only: bool = False) -> AsyncIterator[GenerateResponse]:
        """Cumulative results, the last one finished; `final_only`: that one alone. Every number
        of a result comes from one set of weights."""
        async with self.item.served.weights.reading():
            results = self._results(final_only)
            try:
                async for result in results:
                    yield result
            finally:
                await results.aclose()

    async def _results(self, final_only: bool) -> AsyncIterator[GenerateResponse]:
        item = self.item
        scores = await input_scores(item, self.triples)
        if item.max_new_tokens == 0:
            yield await self._prefill_only(scores)
            return
        text, steps = "", []
        async for piece in gen.run_choice(
            item.served, item.ids, item.params, item.stops, item.adapter, item.stop_ids
        ):
            steps.extend(piece.steps)
            text += piece.text
            finish = None
            if piece.finish_reason is not None:
                text, finish = _finish(item, text, steps, piece.finish_reason)
            self.completion_tokens = len(steps)
            if finish is not None or not final_only:
                yield self._result(text, steps, scores, finish, await self._score_rows(steps))

    async def _prefill_only(self, scores: Scores) -> GenerateResponse:
        """No tokens; with logprobs, one triple for the token that would come next, drawn with
        the request's sampling (greedy: the most likely), as SGLang reports it."""
        finish = FinishReason(type="length", length=0)
        if not self.item.return_logprob:
            return self._result("", [], scores, finish)
        item = self.item
        params = replace(item.params, max_tokens=1)
        engine = item.served.require_engine()
        generator = engine.generate(item.ids, params, item.adapter)
        try:
            step = await anext(generator)
        finally:
            await generator.aclose()
        return self._result("", [], scores, finish, await self._score_rows([step]))


def encode(body: GenerateResponse | list[GenerateResponse]) -> bytes:
    return msgspec.json.encode(body)
