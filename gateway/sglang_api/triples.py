"""Logprob triples of SGLang's /generate: `(logprob, token id, text or null)`, for prompt
positions (from logprob_start_len, the first entry null), generated tokens, their top-k, and the
ids a request names (`token_ids_logprob`, read off whole next-token rows: the dense service's, as
/v1/next_token_logprobs reads them, so the output cache and the engine's shared passes serve
them too)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice

import numpy as np

from backends.rows import PackedRows
from gateway.dense.service import DenseService
from gateway.schemas.sglang import Triple
from gateway.sglang_api.items import Item


class Triples:
    """Logprob triples of one item; token texts (only when asked for) as SGLang writes them:
    the tokenizer's decoding of each id alone."""

    def __init__(self, item: Item) -> None:
        self.item = item
        self.tokenizer = item.served.require_engine().info.tokenizer

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


async def input_scores(dense: DenseService, item: Item, triples: Triples) -> Scores:
    """Prompt positions start .. P-1; the first entry has no logprob (SGLang's `[None] + ...`).
    The caller holds the model's weights for reading."""
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
            *await token_ids_logprobs(dense, item, triples, (ids[:p] for p in range(start + 1, len(ids)))),
        ]
    return scores


async def next_token_rows(
    dense: DenseService, item: Item, prefixes: Iterable[Sequence[int]]
) -> AsyncIterator[np.ndarray]:
    """The model's whole next-token row (log_softmax of the logits, float32 [vocab]) after each
    prefix, in order, from the dense service: the output cache, then the engine, whose passes
    every other route's rows share. Asked one engine call (the model's max_batch_rows) at a time,
    and `prefixes` taken as lazily, so an item holds one call's rows however many positions it
    scores. The caller holds the model's weights for reading."""
    served, pending = item.served, iter(prefixes)
    while batch := list(islice(pending, served.settings.max_batch_rows)):
        placed, _ = await dense.logprobs(served, item.adapter, PackedRows.of(batch))
        for row in placed.logprobs:
            yield row


def at_temperature(row: np.ndarray, temperature: float) -> np.ndarray:
    """log_softmax(logits / temperature) from log_softmax(logits), which differs from the logits
    by a constant: SGLang's logprobs of sampled tokens. Greedy (0) and 1 keep the row as it is."""
    if temperature in (0.0, 1.0):
        return row
    scaled = row.astype(np.float64) / temperature
    top = scaled.max()
    return (scaled - top - np.log(np.exp(scaled - top).sum())).astype(np.float32)


async def token_ids_logprobs(
    dense: DenseService, item: Item, triples: Triples, prefixes: Iterable[Sequence[int]]
) -> list[list[Triple]]:
    """For each prefix, the triples of the ids `token_ids_logprob` names, from the model's whole
    next-token row after it (row i: the log-probabilities of the token after prefixes[i])."""
    assert item.token_ids is not None
    wanted = np.asarray(item.token_ids, dtype=np.int64)
    return [
        triples.make(row[wanted].tolist(), item.token_ids)
        async for row in next_token_rows(dense, item, prefixes)
    ]
