"""Logprob triples of SGLang's /generate: `(logprob, token id, text or null)`, for prompt
positions (from logprob_start_len, the first entry null), generated tokens, their top-k, and the
ids a request names (`token_ids_logprob`, read off whole next-token rows of the engine)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from gateway.generation.choices import check_logprob_entries
from gateway.schemas.sglang import Triple
from gateway.settings import Limits

if TYPE_CHECKING:
    from gateway.sglang.generate import Item

ROWS_PER_CALL = 64  # next-token rows asked of the engine at once (vocab_size float32 each)


def logprob_entries(item: Item) -> int:
    """The triples an item's answer carries: per prompt position from `start` and per token it
    may generate (max_new_tokens = 0 reports one), its own, its top-k and its named ids."""
    if not item.return_logprob:
        return 0
    per_position = 1 + item.top_k + len(item.token_ids or ())
    return per_position * (len(item.ids) - item.start + max(item.max_new_tokens, 1))


def check_answer_size(items: Sequence[Item], names_token_ids: bool, limits: Limits) -> None:
    """Refuse a request whose answer would carry more triples than the limit (a 400)."""
    check_logprob_entries(
        sum(map(logprob_entries, items)),
        limits,
        "name fewer token_ids_logprob, ask a smaller top_logprobs_num, start later with "
        "logprob_start_len, split the batch, or ask /v1/next_token_logprobs for whole rows",
        "token_ids_logprob" if names_token_ids else "logprob_start_len",
    )


class Triples:
    """Logprob triples of one item; token texts (only when asked for) as SGLang writes them:
    the tokenizer's decoding of each id alone."""

    def __init__(self, item: Item) -> None:
        self.item = item
        self.tokenizer = item.served.require_engine().tokenizer

    def texts(self, ids: Sequence[int]) -> list[str | None]:
        if not self.item.with_text:
            return [None] * len(ids)
        return list(self.tokenizer.batch_decode([[int(i)] for i in ids]))

    def make(self, values: Sequence[float | None], ids: Sequence[int]) -> list[Triple]:
        ids = [int(i) for i in ids]
        return [
            (None if v is None else float(v), i, t)
            for v, i, t in zip(values, ids, self.texts(ids), strict=True)
        ]

    def top(self, ids: Sequence[int], values: Sequence[float]) -> list[Triple]:
        k = self.item.top_k
        return self.make(list(values[:k]), list(ids[:k]))


@dataclass
class Scores:
    input_tokens: list[Triple]
    input_top: list[list[Triple] | None]
    input_token_ids: list[list[Triple] | None] = field(default_factory=list)


async def input_scores(item: Item, triples: Triples) -> Scores:
    """Prompt positions start .. P-1; the first entry has no logprob (SGLang's `[None] + ...`)."""
    ids, start = item.ids, item.start
    if not item.return_logprob or start >= len(ids):
        return Scores([], [])
    values: list[float | None] = [None]
    top: list[list[Triple] | None] = [None]
    if start + 1 < len(ids):
        scores = await item.served.require_engine().prompt_logprobs(ids, item.top_k, item.adapter)
        # scores index token t (t >= 1) at t - 1
        values += [float(v) for v in scores.token_logprobs[start:]]
        if item.top_k:
            top += [
                triples.top(scores.top_ids[t], scores.top_logprobs[t]) for t in range(start, len(ids) - 1)
            ]
    scores = Scores(triples.make(values, ids[start:]), top if item.top_k else [])
    if item.token_ids is not None:
        scores.input_token_ids = [
            None,
            *await token_ids_logprobs(item, triples, [ids[:p] for p in range(start + 1, len(ids))]),
        ]
    return scores


async def next_token_rows(item: Item, prefixes: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """The engine's whole next-token row (log_softmax of the logits) after each prefix."""
    engine = item.served.require_engine()
    rows: list[np.ndarray] = []
    for begin in range(0, len(prefixes), ROWS_PER_CALL):
        chunk = [list(p) for p in prefixes[begin : begin + ROWS_PER_CALL]]
        rows.extend(np.asarray(await engine.next_token_logprobs(chunk, [item.adapter] * len(chunk))))
    return rows


def at_temperature(row: np.ndarray, temperature: float) -> np.ndarray:
    """log_softmax(logits / temperature) from log_softmax(logits), which differs from the logits
    by a constant: SGLang's logprobs of sampled tokens. Greedy (0) and 1 keep the row as it is."""
    if temperature in (0.0, 1.0):
        return row
    scaled = row.astype(np.float64) / temperature
    top = scaled.max()
    return (scaled - top - np.log(np.exp(scaled - top).sum())).astype(np.float32)


async def token_ids_logprobs(
    item: Item, triples: Triples, prefixes: Sequence[Sequence[int]]
) -> list[list[Triple]]:
    """For each prefix, the triples of the ids `token_ids_logprob` names, from the engine's whole
    next-token row after it (row i: the log-probabilities of the token after prefixes[i])."""
    assert item.token_ids is not None
    wanted = np.asarray(item.token_ids, dtype=np.int64)
    rows = await next_token_rows(item, prefixes)
    return [triples.make(row[wanted].tolist(), item.token_ids) for row in rows]
