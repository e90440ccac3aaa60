"""The shared sampler: greedy, top_p, seeds, penalties, logit bias, finish reasons."""

from __future__ import annotations

import numpy as np

from backends.sampling import Sampler, log_softmax, top_k
from backends.types import SamplingParams

LOGITS = np.array([1.0, 3.0, 2.0, -1.0, 2.5], dtype=np.float32)


def test_log_softmax_normalises():
    assert abs(np.exp(log_softmax(LOGITS).astype(np.float64)).sum() - 1) < 1e-6


def test_top_k_sorted_with_ids():
    ids, values = top_k(log_softmax(LOGITS), 3)
    assert ids.tolist() == [1, 4, 2]
    assert np.all(np.diff(values) <= 0)


def test_greedy_reports_raw_logprob_and_finish_reasons():
    sampler = Sampler(SamplingParams(max_tokens=2, temperature=0, top_logprobs=2), frozenset({3}))
    first = sampler.step(LOGITS)
    assert first.token_id == 1 and first.finish_reason is None
    assert abs(first.logprob - log_softmax(LOGITS)[1]) < 1e-6
    assert first.top_ids.tolist() == [1, 4]
    assert sampler.step(LOGITS).finish_reason == "length"
    eos = Sampler(SamplingParams(max_tokens=5, temperature=0, logit_bias={3: 100.0}), frozenset({3}))
    step = eos.step(LOGITS)
    assert step.token_id == 3 and step.finish_reason == "stop"
    assert abs(step.logprob - log_softmax(LOGITS)[3]) < 1e-6  # the bias does not change the report


def test_top_p_keeps_only_the_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    sampler = Sampler(SamplingParams(max_tokens=10_000, temperature=1.0, top_p=0.7, seed=0), frozenset())
    seen = {sampler.step(logits).token_id for _ in range(400)}
    assert seen == {0, 1}


def test_seed_reproduces_and_temperature_spreads():
    def draws(seed):
        s = Sampler(SamplingParams(max_tokens=10_000, temperature=1.0, seed=seed), frozenset())
        return [s.step(LOGITS).token_id for _ in range(50)]

    assert draws(5) == draws(5)
    assert draws(5) != draws(6)
    counts = np.bincount(draws(1) + draws(2) + draws(3), minlength=5) / 150
    expected = np.exp(log_softmax(LOGITS).astype(np.float64))
    assert np.max(np.abs(counts - expected)) < 0.15


def test_frequency_penalty_discourages_repeats():
    flat = np.zeros(3, dtype=np.float32)
    sampler = Sampler(SamplingParams(max_tokens=3, temperature=0, frequency_penalty=1.0), frozenset())
    assert [sampler.step(flat).token_id for _ in range(3)] == [0, 1, 2]
