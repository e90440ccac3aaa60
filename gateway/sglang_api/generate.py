"""SGLang's POST /generate on this gateway's generation machinery (gateway/generation/).

A request becomes a list of checked `Item`s (items.py); an item runs as a stream of cumulative
results, SGLang's shape in both its streaming and its plain answers; whole next-token rows, where
it needs them, come from the dense service (triples.py). Semantics follow SGLang 0.5.17 (`tokenizer_manager`,
`schedule_batch`, `logprob_result_processor`): stop strings cut `text` but not `output_ids`;
input logprobs cover prompt positions logprob_start_len .. P-1 with the first entry null;
max_new_tokens = 0 scores the prompt and reports one triple for the would-be next token.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import msgspec
import numpy as np

from backends.sampling import Sampler
from backends.types import TokenStep
from backends.vocab import decode_text
from gateway.dense.service import DenseService
from gateway.generation import choices as gen
from gateway.schemas.sglang import ABORTED, FinishReason, GenerateResponse, MetaInfo, Triple
from gateway.sglang_api.items import Item
from gateway.sglang_api.triples import Scores, Triples, at_temperature, input_scores, next_token_rows


def _finish(item: Item, piece_text: str, steps: Sequence[TokenStep], reason: str) -> tuple[str, FinishReason]:
    """SGLang's finish reason, and the text as it ends (`no_stop_trim` keeps the stop string)."""
    if reason == "length":
        return piece_text, FinishReason(type="length", length=item.max_new_tokens)
    if reason == "abort":
        return piece_text, ABORTED
    served = item.served
    full = decode_text(served.token_bytes, [s.token_id for s in steps], served.special_ids - item.shown_ids)
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

    def __init__(self, item: Item, dense: DenseService) -> None:
        self.item = item
        self.dense = dense  # whole next-token rows, as every route reads them
        self.triples = Triples(item)
        self.started = time.perf_counter()
        self.completion_tokens = 0
        self.output_token_ids: list[list[Triple]] = []  # token_ids_logprob's, per scored step
        self.rescored: list[TokenStep] = []  # scored steps with logprobs at the temperature
        self.wanted = None if item.token_ids is None else np.asarray(item.token_ids, dtype=np.int64)

    def _rescales(self) -> bool:
        return self.item.params.temperature not in (0.0, 1.0)

    async def _score_rows(self, scored: Sequence[TokenStep]) -> list[TokenStep]:
        """The steps as reported: from the model's whole row before each step when the request
        names token ids or samples at a temperature other than 0 and 1 (SGLang reports sampled
        tokens' logprobs at the temperature); as generated otherwise."""
        item = self.item
        if not item.return_logprob or not (self._rescales() or item.token_ids is not None):
            return list(scored)
        done = len(self.rescored)
        prefixes = (item.ids + [s.token_id for s in scored[:i]] for i in range(done, len(scored)))
        steps = iter(scored[done:])
        async for raw in next_token_rows(self.dense, item, prefixes):
            self._rescore(next(steps), raw)
        return self.rescored[: len(scored)]

    def _rescore(self, step: TokenStep, raw: np.ndarray) -> TokenStep:
        """`step` as reported from `raw`, the model's whole row before it (kept in `rescored`)."""
        item = self.item
        row = at_temperature(raw, item.params.temperature)
        if item.token_ids is not None:
            self.output_token_ids.append(self.triples.make(row[self.wanted].tolist(), item.token_ids))
        if self._rescales():
            top = np.argsort(-row, kind="stable")[: item.top_k]
            step = replace(step, logprob=float(row[step.token_id]), top_ids=top, top_logprobs=row[top])
        self.rescored.append(step)
        return step

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
        async with self.item.served.reading(self.item.adapter):
            results = self._results(final_only)
            try:
                async for result in results:
                    yield result
            finally:
                await results.aclose()

    async def _results(self, final_only: bool) -> AsyncIterator[GenerateResponse]:
        item = self.item
        scores = await input_scores(self.dense, item, self.triples)
        if item.max_new_tokens == 0:
            yield await self._prefill_only(scores)
            return
        text, steps = "", []
        async for piece in gen.run_choice(
            item.served, item.ids, item.params, item.stops, item.adapter, item.shown_ids
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
        the request's sampling (greedy: the most likely), as SGLang reports it. Drawn from the
        model's whole row after the prompt, as the prompt's scores are: a scoring request reaches
        no generation (of a composed model, only the dense engine). Under a grammar, whose mask
        the generating engine applies, the engine generates it."""
        finish = FinishReason(type="length", length=0)
        if not self.item.return_logprob:
            return self._result("", [], scores, finish)
        item = self.item
        params = replace(item.params, max_tokens=1)
        engine = item.served.require_engine()
        if params.grammar is not None:
            generator = engine.generate(item.ids, params, item.adapter)
            try:
                step = await anext(generator)
            finally:
                await generator.aclose()
            return self._result("", [], scores, finish, await self._score_rows([step]))
        rows = [row async for row in next_token_rows(self.dense, item, [item.ids])]
        step = Sampler(params, engine.info.eos_token_ids, normalized=True).step(rows[0])
        if self._rescales() or item.token_ids is not None:
            step = self._rescore(step, rows[0])
        return self._result("", [], scores, finish, [step])


def encode(body: GenerateResponse | list[GenerateResponse]) -> bytes:
    return msgspec.json.encode(body)
