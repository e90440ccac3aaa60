"""Choosing the next token from one row of logits, shared by the engines that sample themselves."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from backends.errors import GrammarError
from backends.types import GREEDY_BELOW, PromptLogprobs, SamplingParams, TokenStep

if TYPE_CHECKING:
    from backends.grammar import LLGuidanceGrammars


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
    k = min(k, logprobs.shape[-1])
    part = np.argpartition(-logprobs, k - 1, axis=-1)[..., :k]
    vals = np.take_along_axis(logprobs, part, axis=-1)
    order = np.lexsort((part, -vals), axis=-1)
    ids = np.take_along_axis(part, order, axis=-1).astype(np.int64)
    return ids, np.take_along_axis(logprobs, ids, axis=-1).astype(np.float32)


class Sampler:
    """Per-request sampling state: the random generator and the counts for penalties."""

    def __init__(
        self, params: SamplingParams, eos_token_ids: frozenset[int], normalized: bool = False
    ) -> None:
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.normalized = normalized  # rows are log-probabilities already (a log_softmax of the logits)
        # numpy refuses negative seeds: use the unsigned 64-bit seed they wrap to
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)
        self.counts: Counter[int] = Counter()
        self.generated = 0

    def step(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> TokenStep:
        """Pick a token from a [vocab] float32 row of logits (or of log-probabilities, when
        `normalized`), among the `allowed` ones (bool [vocab]) if given, and report it with the
        row's own log-probabilities, before the mask."""
        p = self.params
        logprobs = logits if self.normalized else log_softmax(logits)
        if allowed is not None:
            logits = np.where(allowed, logits, np.float32(-np.inf))
        penalised = bool(self.counts) and bool(p.presence_penalty or p.frequency_penalty)
        if p.temperature < GREEDY_BELOW and not p.logit_bias and not penalised:
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
            token = int(np.argmax(scores)) if p.temperature < GREEDY_BELOW else self._sample(scores)
        self.counts[token] += 1
        self.generated += 1
        top_ids, top_vals = top_k(logprobs, p.top_logprobs)
        if token in self.eos_token_ids:
            finish = "stop"
        elif self.generated >= p.max_tokens:
            finish = "length"
        else:
            finish = None
        return TokenStep(token, float(logprobs[token]), top_ids, top_vals, finish)

    def _sample(self, scores: np.ndarray) -> int:
        probs = np.exp(log_softmax(scores / self.params.temperature).astype(np.float64))
        if self.params.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            keep = order[: int(np.searchsorted(cumulative, self.params.top_p)) + 1]
            kept = np.zeros_like(probs)
            kept[keep] = probs[keep]
            probs = kept
        probs /= probs.sum()
        return int(self.rng.choice(probs.shape[0], p=probs))


async def sample_tokens(
    params: SamplingParams,
    eos_token_ids: frozenset[int],
    next_logits: Callable[[int | None], Awaitable[np.ndarray]],
    normalized: bool = False,
    grammars: LLGuidanceGrammars | None = None,
) -> AsyncIterator[TokenStep]:
    """The generation loop of the engines that sample themselves.

    `next_logits(None)` runs the prompt and returns its last logits row; `next_logits(token)`
    appends the sampled token and returns the next row (rows of log-probabilities if
    `normalized`). Nothing runs ahead of the consumer, so a caller that stops iterating (stop
    string, disconnect) wastes no forward pass. Under `params.grammar` (compiled by `grammars`)
    each token's mask is computed while its row is.
    """
    if params.max_tokens <= 0:
        return
    constraint = None
    if params.grammar is not None:
        if grammars is None:
            raise GrammarError("this engine does not hold generation to a grammar")
        constraint = await grammars.constraint(params.grammar)
    sampler = Sampler(params, eos_token_ids, normalized)
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


def prompt_scores(rows: np.ndarray, ids: Sequence[int], k: int) -> PromptLogprobs:
    """PromptLogprobs from the log-probability rows after each prompt token but the last."""
    targets = np.asarray(ids[1:], dtype=np.int64)
    chosen = rows[np.arange(len(targets)), targets]
    top_ids, top_vals = top_k(rows, k)
    return PromptLogprobs(chosen.astype(np.float32), top_ids, top_vals)
