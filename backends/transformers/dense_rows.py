"""The transformers engine's dense rows: next-token log-probabilities of batches of token rows.

A pass serves each row the cheapest way it can. Rows one token longer than rows of the last pass
take the decode lane (backends/transformers/decode_lane.py: one fixed-shape step). The others reuse the
attention keys/values of their longest cached prefix (backends/transformers/prefix_cache.py) and are grouped
into forward passes by how many tokens each must compute, at most `max_batch_tokens` padded
tokens per pass (backends/transformers/batch_layout.py); their K/V then fill the lane for the next pass.
Without a prefix cache (attention it cannot hold) every row runs whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from backends.transformers.batch_layout import left_padded, mask_if_padded, plan_groups
from backends.transformers.cache_argument import output_cache, with_cache
from backends.transformers.decode_lane import DecodeLane
from backends.transformers.host_copy import best_entries
from backends.transformers.prefix_cache import KVPrefixTrie


class DenseRows:
    def __init__(
        self,
        call: Callable[..., Any],
        config: Any,
        vocab_size: int,
        device: torch.device,
        *,
        max_batch_tokens: int,
        prefix_cache: KVPrefixTrie | None,
        lane: DecodeLane | None,
    ) -> None:
        self._call = call  # a forward pass, row i with adapter i (the engine's PEFT dispatch)
        self.config = config
        self.vocab_size = vocab_size
        self.device = device
        self.max_batch_tokens = max_batch_tokens
        self.prefix_cache = prefix_cache
        self.lane = lane

    @torch.inference_mode()
    def __call__(
        self,
        rows: Sequence[np.ndarray],
        keys: Sequence[bytes],
        adapters: Sequence[str | None],
        *,
        use_lane: bool,
    ) -> torch.Tensor:
        """float32 [len(rows), vocab] on the model's device, for rows of int32 ids and their keys
        (backends/rows.py); `use_lane`: the decode lane may serve rows without an adapter (the
        model is not wrapped by PEFT)."""
        out: torch.Tensor | None = None  # [rows, vocab] float32 on the model's device

        def place(group: list[int], logprobs: torch.Tensor) -> None:
            nonlocal out
            if group == list(range(len(rows))):
                out = logprobs  # one pass, rows in order: its result is the answer
                return
            if out is None:
                out = logprobs.new_empty((len(rows), self.vocab_size))
            out[torch.tensor(group, device=self.device)] = logprobs

        lane = self.lane if use_lane else None
        parents = lane.parents(keys) if lane is not None else [None] * len(rows)
        parents = [p if a is None else None for p, a in zip(parents, adapters, strict=True)]
        stepped = [i for i, p in enumerate(parents) if p is not None]
        if lane is not None and stepped and lane.fits(len(stepped), max(len(rows[i]) for i in stepped) + 1):
            part = [rows[i] for i in stepped]
            place(stepped, lane.step(part, [keys[i] for i in stepped], [parents[i] for i in stepped]))  # type: ignore[misc]
            self._count_tokens(sum(map(len, part)), reused=sum(map(len, part)) - len(part))
        else:
            stepped = []
        rest = [i for i in range(len(rows)) if not stepped or parents[i] is None]
        if not rest:
            assert out is not None
            return out
        cache = self.prefix_cache
        tokens = [rows[i] for i in rest]  # int32 views: the trie finds most by their keys
        matches = [
            cache.match(adapters[i], t, keys[i]) if cache else (None, 0)
            for i, t in zip(rest, tokens, strict=True)
        ]
        # Tokens each row must run through the model: those after its cached prefix, at least one.
        todo = [len(t) - min(depth, len(t) - 1) for t, (_, depth) in zip(tokens, matches, strict=True)]
        passes = []  # (K/V, keys of its rows) of each forward pass, for the decode lane
        for group in plan_groups(todo, self.max_batch_tokens):
            part = [tokens[j] for j in group]
            names = [adapters[rest[j]] for j in group]
            if cache is None:
                logprobs = self._uncached_logprobs(part, names)
            else:
                part_keys = [keys[rest[j]] for j in group]
                logprobs, layers = self._cached_logprobs(
                    part, names, part_keys, [matches[j] for j in group], cache
                )
                passes.append((layers, part_keys))
            place([rest[j] for j in group], logprobs)
        if lane is not None and passes:
            own = lane.own_rows() if stepped else lane.rows_beside(sum(len(keys) for _, keys in passes))
            lane.refill(([own] if own else []) + passes)
        assert out is not None
        return out

    @torch.inference_mode()
    def greedy_steps(
        self, rows: Sequence[np.ndarray], keys: Sequence[bytes], steps: int, k: int
    ) -> np.ndarray | None:
        """Up to `steps` greedy steps of rows that the decode lane extends (no adapter, every row's
        parent held there), each row's token fed back on the device: best_entries' rows of each
        step taken, [taken, rows, 1 + 2k], on the host. None where the lane cannot take them all."""
        lane = self.lane
        parents = lane.parents(keys) if lane is not None else []
        if lane is None or None in parents or not lane.fits(len(rows), max(map(len, rows)) + 1):
            return None
        host = lane.greedy_steps(rows, keys, parents, steps, lambda out: best_entries(out, k))  # type: ignore[arg-type]
        tokens = sum(map(len, rows))
        for extra in range(len(host)):  # each step computes one token of each row, reusing the rest
            self._count_tokens(tokens + extra * len(rows), reused=tokens + (extra - 1) * len(rows))
        return host

    def _count_tokens(self, tokens: int, reused: int) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.stats.reused_tokens += reused
            self.prefix_cache.stats.computed_tokens += tokens - reused

    def _uncached_logprobs(self, rows: Sequence[np.ndarray], adapters: Sequence[str | None]) -> torch.Tensor:
        # Left padding keeps every row's last token in the final position; explicit position ids
        # and the attention mask make each row's result equal to its unpadded forward pass.
        return self._last_logprobs(adapters, *left_padded(rows, [0] * len(rows)), None)[0]

    def _last_logprobs(
        self,
        adapters: Sequence[str | None],
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache | None,
    ) -> tuple[torch.Tensor, Any]:
        """The forward pass of a left-padded batch: the log-probabilities after each row's last
        token, and the model's output (its K/V when `cache` is given)."""
        out = self._call(
            adapters,
            input_ids=ids.to(self.device),
            attention_mask=mask_if_padded(mask, self.device),
            position_ids=positions.to(self.device),
            **with_cache(cache),
            use_cache=cache is not None,
            logits_to_keep=1,
        )
        return torch.log_softmax(out.logits[:, -1, :].float(), dim=-1), out

    def _cached_logprobs(
        self,
        rows: Sequence[np.ndarray],
        adapters: Sequence[str | None],
        row_keys: Sequence[bytes],
        matches: Sequence[tuple[Any, int]],
        prefix_cache: KVPrefixTrie,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        # The batch's layout is the uncached one, [pad][row], with the first `past` columns taken
        # from the cache: rows whose cached prefix ends earlier than their share of those columns
        # recompute the rest in the new-token window, where they would otherwise hold padding.
        # Every row keeps at least its last token to compute (its logits).
        new = max(len(r) - min(depth, len(r) - 1) for r, (_, depth) in zip(rows, matches, strict=True))
        reused = [max(len(r) - new, 0) for r in rows]
        past = max(reused)
        ids, mask, positions = left_padded(rows, reused)
        cache = DynamicCache(config=self.config)
        if past:
            picks = [(entry, n) for (entry, _), n in zip(matches, reused, strict=True)]
            for layer, (keys, values) in enumerate(prefix_cache.gather(picks, past)):
                cache.update(keys, values, layer)
        logprobs, out = self._last_logprobs(adapters, ids, mask, positions, cache)
        # Stored while the GPU still computes: the trie's bookkeeping overlaps the forward pass.
        layers = [(layer.keys, layer.values) for layer in output_cache(out).layers]
        prefix_cache.store(list(zip(adapters, rows, strict=True)), layers, row_keys)
        self._count_tokens(sum(map(len, rows)), sum(reused))
        return logprobs, layers
