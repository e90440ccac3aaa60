"""Choosing the next token from one row of logits, shared by the engines that sample themselves."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends import token_controls
from backends.errors import GrammarError
from backends.token_controls import TokenControls
from backends.types import GREEDY_BELOW, PromptLogprobs, SamplingParams, TokenStep

if TYPE_CHECKING:
    from backends.grammar.constraint import LLGuidanceGrammars


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 log_softmax along the last axis, computed in float64 for stability."""
    x = logits.astype(np.float64, copy=False)
    x = x - x.max(axis=-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(axis=-1, keepdims=True))).astype(np.float32)


def top_k(logprobs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest entries of each row, most likely first (ties: lower id first)."""
    if k <= 0:
        shape = logprobs.shape[:-1] + (0,)
        return np.zeros(shape, np.int64), np.zeros(shape, np.float32)
    if k == 1:  # the common case (logprobs=1), and argmax is many times faster than a partition
        ids = np.argmax(logprobs, axis=-1)[..., None]  # the first of equal maxima: the lower id
        return ids.astype(np.int64), np.take_along_axis(logprobs, ids, axis=-1).astype(np.float32)
    k = min(k, logprobs.shape[-1])
    part = np.argpartition(-logprobs, k - 1, axis=-1)[..., :k]
    vals = np.take_along_axis(logprobs, part, axis=-1)
    order = np.lexsort((part, -vals), axis=-1)
    ids = np.take_along_axis(part, order, axis=-1).astype(np.int64)
    return ids, np.take_along_axis(logprobs, ids, axis=-1).astype(np.float32)


@dataclass(frozen=True)
class Pick:
    """A greedy step chosen where its row was computed (the row itself never crosses to the
    host): the row's most likely token (the lowest id of equal maxima) and its k best entries."""

    token: int
    logprob: float
    top_ids: np.ndarray  # int64 [k], most likely first
    top_logprobs: np.ndarray  # float32 [k]


def greedy_alternatives(params: SamplingParams) -> int | None:
    """For a stream whose every token is its row's most likely one (greedy: no bias, penalty,
    grammar or control that changes the most likely token), how many of the row's best entries a
    Pick needs (at least the token's own); None where the sampler needs the whole row."""
    plain = not (
        params.logit_bias
        or params.presence_penalty
        or params.frequency_penalty
        or token_controls.greedy_changing(params)
    )
    if params.temperature < GREEDY_BELOW and plain and params.grammar is None:
        return max(1, params.top_logprobs)
    return None


class Sampler:
    """Per-request sampling state: the random generator, the tokens so far (for penalties and
    the token controls) and the tokens that end the stream."""

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        normalized: bool = False,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self.params = params
        self.ends = params.ending_tokens(eos_token_ids)
        wanted = token_controls.wanted(params)
        self.controls = TokenControls(params, prompt_ids, eos_token_ids) if wanted else None
        self.output: list[int] = []
        self.normalized = normalized  # rows are log-probabilities already (a log_softmax of the logits)
        # numpy refuses negative seeds: use the unsigned 64-bit seed they wrap to
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)
        self.counts: Counter[int] = Counter()

    def step(self, logits: np.ndarray | Pick, allowed: np.ndarray | None = None) -> TokenStep:
        """Pick a token from a [vocab] float32 row of logits (or of log-probabilities, when
        `normalized`), among the `allowed` ones (bool [vocab]) if given, and report it with the
        row's own log-probabilities, before the mask; or take the Pick the engine made."""
        p = self.params
        if isinstance(logits, Pick):
            k = p.top_logprobs
            return self._report(logits.token, logits.logprob, logits.top_ids[:k], logits.top_logprobs[:k])
        logprobs = logits if self.normalized else log_softmax(logits)
        if allowed is not None:
            logits = np.where(allowed, logits, np.float32(-np.inf))
        penalised = bool(self.counts) and bool(p.presence_penalty or p.frequency_penalty)
        if p.temperature < GREEDY_BELOW and not p.logit_bias and not penalised and self.controls is None:
            token = int(np.argmax(logits))  # float32 orders as float64 does: no copy for greedy
        else:
            scores = logits.astype(np.float64)
            if p.logit_bias:
                ids = np.fromiter(p.logit_bias.keys(), np.int64)
                scores[ids] += np.fromiter(p.logit_bias.values(), np.float64)
            if penalised:
                ids = np.fromiter(self.counts.keys(), np.int64)
                counts = np.fromiter(self.counts.values(), np.float64)
                scores[ids] -= p.presence_penalty + p.frequency_penalty * counts
            if self.controls is not None:
                scores = self.controls.before_temperature(scores, self.output)
            token = int(np.argmax(scores)) if p.temperature < GREEDY_BELOW else self._sample(scores)
        return self._report(token, float(logprobs[token]), *top_k(logprobs, p.top_logprobs))

    @property
    def generated(self) -> int:
        return len(self.output)

    def _report(self, token: int, logprob: float, top_ids: np.ndarray, top_vals: np.ndarray) -> TokenStep:
        self.counts[token] += 1
        self.output.append(token)
        if token in self.ends:
            finish = "stop"
        elif self.generated >= self.params.max_tokens:
            finish = "length"
        else:
            finish = None
        return TokenStep(token, logprob, top_ids, top_vals, finish)

    def _sample(self, scores: np.ndarray) -> int:
        scores = scores / self.params.temperature
        if self.controls is not None:
            scores = self.controls.keep_top_k(scores)
        probs = np.exp(log_softmax(scores).astype(np.float64))
        if self.params.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            keep = order[: int(np.searchsorted(cumulative, self.params.top_p)) + 1]
            kept = np.zeros_like(probs)
            kept[keep] = probs[keep]
            probs = kept
        if self.controls is not None:
            probs = self.controls.keep_min_p(probs)
        probs /= probs.sum()
        return int(self.rng.choice(probs.shape[0], p=probs))


async def sample_tokens(
    params: SamplingParams,
    eos_token_ids: frozenset[int],
    next_logits: Callable[[int | None], Awaitable[np.ndarray | Pick]],
    normalized: bool = False,
    grammars: LLGuidanceGrammars | None = None,
    prompt_ids: Sequence[int] = (),
) -> AsyncIterator[TokenStep]:
    """The generation loop of the engines that sample themselves.

    `next_logits(None)` runs the prompt and returns its last logits row; `next_logits(token)`
    appends the sampled token and returns the next row (rows of log-probabilities if
    `normalized`), or the engine's Pick of it. Nothing runs ahead of the consumer, so a caller
    that stops iterating (stop string, disconnect) wastes no forward pass. Under `params.grammar`
    (compiled by `grammars`) each token's mask is computed while its row is. `prompt_ids`: what
    the repetition penalty counts besides the output.
    """
    if params.max_tokens <= 0:
        return
    constraint = None
    if params.grammar is not None:
        if grammars is None:
            raise GrammarError("this engine does not hold generation to a grammar")
        constraint = await grammars.constraint(params.grammar)
    sampler = Sampler(params, eos_token_ids, normalized, prompt_ids)
    token = None
    while True:
        mask = None if constraint is None else constraint.next_mask()
        logits = await next_logits(token)
        step = sampler.step(logits, None if mask is None else await mask)
        if constraint is not None and step.finish_reason is None:
            constraint.accept(step.token_id)
        yield step
        if step.finish_reason is not None:
            return
        token = step.token_id


async def sample_in_bursts(
    params: SamplingParams,
    eos_token_ids: frozenset[int],
    first: Sequence[Any],
    then: Callable[[Sequence[int], int], Sequence[Any]],
    run_steps: Callable[[Sequence[Any], Callable[[Any], Sequence[Any] | None]], Awaitable[None]],
    prompt_ids: Sequence[int] = (),
) -> AsyncIterator[TokenStep]:
    """sample_tokens for a caller that takes the tokens `params.stream_interval` at a time, under
    no grammar, on rows of log-probabilities: each burst's steps run inside the engine's step
    scheduler (`run_steps`, StepScheduler.run), which calls back after each pass, so the steps of a
    burst follow one another with no turn of this generator between them. `first`: the items of
    the prompt's step; `then(tokens, steps)`: those of the steps after `tokens`, appended, of which
    the response wants up to `steps` (a pass may answer with several Picks, in order; those past
    the burst's end go out with it, so a burst's end never shortens the engine's pass).

    The first token goes out alone, as SGLang sends it (the time to it is measured as streamed),
    while the stream's steps go on: it never misses the pass after its prompt's, where the engine
    holds its row. A full burst is handed to a consumer that waits for it, and the steps go on
    while the consumer takes it in, so concurrent streams stay in the engine's passes together
    (the engine keeps their rows) rather than leave them one by one at every burst's end. A
    burst that fills while its consumer is still busy with the one before (or held between two
    tokens, generation paused) waits for it, and the steps stop there: a held stream runs at most
    one burst past the token it is held at, and goes on when its consumer comes back."""
    if params.max_tokens <= 0:
        return
    loop = asyncio.get_running_loop()
    sampler = Sampler(params, eos_token_ids, normalized=True, prompt_ids=prompt_ids)
    first_step: asyncio.Future[TokenStep] = loop.create_future()
    burst: list[TokenStep] = []  # steps the consumer has not been handed
    unfed: list[int] = []  # tokens sampled since the last items were made: not in their row yet
    waiting: asyncio.Future[None] | None = None  # the consumer's, once it has taken every step

    def proceed(result: Any) -> Sequence[Any] | None:
        results = result if isinstance(result, list) else [result if isinstance(result, Pick) else result[0]]
        for one in results:
            step = sampler.step(one)
            unfed.append(step.token_id)
            if first_step.done():
                burst.append(step)
            else:
                first_step.set_result(step)
            if step.finish_reason is not None:
                hand_over()
                return None
        if len(burst) >= params.stream_interval:
            if waiting is None:
                return None  # the consumer has yet to take the burst before: wait for it
            hand_over()
        return following()

    def hand_over() -> None:
        nonlocal waiting
        if waiting is not None and not waiting.done():
            waiting.set_result(None)
        waiting = None

    def following() -> Sequence[Any]:
        """The items of the next steps, as many as the response has left."""
        tokens = unfed.copy()
        unfed.clear()
        return then(tokens, params.max_tokens - sampler.generated)

    run = asyncio.ensure_future(run_steps(first, proceed))
    try:
        await asyncio.wait((run, first_step), return_when=asyncio.FIRST_COMPLETED)
        if not first_step.done():
            await run  # it failed before the first token: its error
        step = first_step.result()
        yield step
        if step.finish_reason is not None:
            return
        while True:
            if len(burst) < params.stream_interval and not run.done():
                waiting = loop.create_future()
                await asyncio.wait((waiting, run), return_when=asyncio.FIRST_COMPLETED)
                waiting = None
            if run.done():
                run.result()  # its error, if it failed
            steps = burst.copy()
            burst.clear()
            if steps and steps[-1].finish_reason is not None:
                for step in steps:
                    yield step
                return
            if run.done():  # it stopped at a burst's end, waiting for this consumer: on again
                run = asyncio.ensure_future(run_steps(following(), proceed))
            for step in steps:
                yield step
    finally:
        run.cancel()
        if run.done() and not run.cancelled():
            run.exception()  # retrieved: a consumer that left does not hear a later pass's error


def prompt_scores(rows: np.ndarray, ids: Sequence[int], k: int) -> PromptLogprobs:
    """PromptLogprobs from the log-probability rows after each prompt token but the last."""
    targets = np.asarray(ids[1:], dtype=np.int64)
    chosen = rows[np.arange(len(targets)), targets]
    top_ids, top_vals = top_k(rows, k)
    return PromptLogprobs(chosen.astype(np.float32), top_ids, top_vals)
