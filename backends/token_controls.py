"""vLLM's and SGLang's token controls beyond OpenAI's (SamplingParams' `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `bad_words`, `allowed_token_ids`) on one row of scores, for the
engines that sample themselves (backends/sampling.py), through transformers' own logits
processors: each control means what `model.generate` makes of it.

The processors that change which token is most likely run before the temperature (as in vLLM:
allowed tokens, bad words, the minimum length, the repetition penalty); `top_k` and `min_p` narrow
the tokens sampled after it, around the sampler's own `top_p`, in transformers' order (top_k, top_p,
min_p). torch and transformers are imported only when a request asks for a control.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from backends.types import SamplingParams


def wanted(params: SamplingParams) -> bool:
    """Whether `params` asks for any of these controls."""
    return bool(greedy_changing(params) or params.top_k > 1 or params.min_p > 0.0)


def greedy_changing(params: SamplingParams) -> bool:
    """Whether a control may change which token is the most likely (top_k and min_p never do)."""
    return bool(
        params.repetition_penalty != 1.0
        or params.min_tokens
        or params.bad_words
        or params.allowed_token_ids is not None
    )


def needs_logits(params: SamplingParams) -> bool:
    """Whether the controls need the raw logits, not log-probabilities: the repetition penalty
    divides positive logits and multiplies negative ones, which a constant shift changes."""
    return params.repetition_penalty != 1.0


class TokenControls:
    """One stream's controls, from its prompt and the tokens it has generated so far."""

    def __init__(
        self, params: SamplingParams, prompt_ids: Sequence[int], eos_token_ids: Collection[int]
    ) -> None:
        import torch
        from transformers.generation import logits_process as hf

        self._torch = torch
        self.prompt = list(prompt_ids)
        # (processor, whether it reads the prompt too): vLLM matches bad words and counts the
        # minimum length in the output only, and penalises repeats of the prompt's tokens too.
        self.before: list[tuple[Any, bool]] = []
        if params.allowed_token_ids is not None:
            allowed = list(params.allowed_token_ids)
            self.before.append((hf.PrefixConstrainedLogitsProcessor(lambda _batch, _ids: allowed, 1), False))
        if params.bad_words:
            words = [list(word) for word in params.bad_words]
            self.before.append((hf.NoBadWordsLogitsProcessor(words), False))
        if params.min_tokens:
            # end-of-sequence too under ignore_eos, as vLLM holds back every stop token
            ends = sorted(set(eos_token_ids) | params.stop_token_ids)
            self.before.append((hf.MinNewTokensLengthLogitsProcessor(0, params.min_tokens, ends), False))
        if params.repetition_penalty != 1.0:
            self.before.append((hf.RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty)), True))
        self.top_k = hf.TopKLogitsWarper(params.top_k) if params.top_k > 1 else None
        self.min_p = hf.MinPLogitsWarper(params.min_p) if params.min_p > 0.0 else None

    def before_temperature(self, scores: np.ndarray, output: Sequence[int]) -> np.ndarray:
        """float64 [vocab] scores with the controls that come before the temperature applied,
        after the tokens `output` generated so far."""
        torch = self._torch
        row = torch.from_numpy(scores)[None]
        for processor, with_prompt in self.before:
            history = [*self.prompt, *output] if with_prompt else list(output)
            row = processor(torch.tensor([history], dtype=torch.long), row)
        return row[0].numpy()

    def keep_top_k(self, scores: np.ndarray) -> np.ndarray:
        """Scores (after the temperature) of all but the k most likely tokens set to -inf."""
        return scores if self.top_k is None else self._warp(self.top_k, scores)

    def keep_min_p(self, probs: np.ndarray) -> np.ndarray:
        """Probabilities (top_p applied, not renormalised) of the tokens below min_p times the most
        likely one's set to 0."""
        if self.min_p is None:
            return probs
        with np.errstate(divide="ignore"):
            return np.exp(self._warp(self.min_p, np.log(probs)))

    def _warp(self, warper: Any, scores: np.ndarray) -> np.ndarray:
        torch = self._torch
        no_ids = torch.zeros((1, 0), dtype=torch.long)  # warpers read no history
        return warper(no_ids, torch.from_numpy(scores)[None])[0].numpy()
