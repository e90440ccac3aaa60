"""genlm's sampling calls on the gateway client: `sample` and `batch_sample` draw tokens one at a
time from the rows the client fetches, stopping before an end-of-sequence token (genlm's
`AsyncLM.sample`). A mixin of `logprob_gateway_client.AsyncGatewayLM`. Needs numpy; draws with
torch where it is installed, as genlm does.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Awaitable, Callable, Iterable, Sequence

import numpy as np

from logprob_gateway_client.wire import RowKey, pack_ids

HAS_TORCH = importlib.util.find_spec("torch") is not None


def _sampler(seed: int | None) -> Callable[[np.ndarray, float], int]:
    """genlm's `AsyncLM.sample` draw, operation for operation, where torch is installed (so a seed
    gives its tokens); numpy's generator seeded with `seed` otherwise."""
    if not HAS_TORCH:
        rng = np.random.default_rng(seed)

        def draw_numpy(logprobs: np.ndarray, temperature: float) -> int:
            scaled = logprobs.astype(np.float64) / temperature
            probs = np.exp(scaled - scaled.max())
            return int(rng.choice(probs.shape[0], p=probs / probs.sum()))

        return draw_numpy
    import torch

    generator = None if seed is None else torch.Generator().manual_seed(seed)

    def draw(logprobs: np.ndarray, temperature: float) -> int:
        probs = torch.softmax(torch.from_numpy(logprobs) / temperature, dim=-1)
        return int(torch.multinomial(probs, num_samples=1, generator=generator).item())

    return draw


class Sampling:
    """genlm-backend's `sample` and `batch_sample`. Uses the client's `_row` (one row, through its
    cache and request batching) and `_model_for` (the model a call's `lora_name` selects)."""

    _row: Callable[[RowKey], Awaitable[np.ndarray]]
    _model_for: Callable[[str | None], str]

    async def sample(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        eos_token_ids: Iterable[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        """Up to `max_tokens` tokens drawn after the prompt from softmax(row / temperature),
        stopping before the first of `eos_token_ids`. With torch installed the draws are genlm's
        own (`torch.multinomial` with a `torch.Generator` seeded with `seed`, or torch's global
        generator when `seed` is None), so a seed gives the tokens genlm's `AsyncLM.sample` gives
        for the same rows. Without torch, numpy's `default_rng(seed)` draws: as reproducible,
        but not the same tokens as genlm's."""
        draw = _sampler(seed)
        eos = set(eos_token_ids)
        model = self._model_for(lora_name)
        generated: list[int] = []
        row = pack_ids(prompt_token_ids)
        for _ in range(max_tokens):
            logprobs = await self._row((model, row))
            token = draw(logprobs, temperature)
            if token in eos:
                break
            generated.append(token)
            row += pack_ids([token])
        return generated

    async def batch_sample(
        self,
        prompt_token_ids_list: Sequence[Sequence[int]],
        max_tokens: int,
        eos_token_ids: Iterable[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[list[int]]:
        eos = list(eos_token_ids)
        return list(
            await asyncio.gather(
                *(
                    self.sample(p, max_tokens, eos, temperature, seed, lora_name)
                    for p in prompt_token_ids_list
                )
            )
        )
