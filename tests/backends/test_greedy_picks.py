"""A greedy stream's token and alternatives, chosen on the engine's device, are those the host's
sampler chooses from the whole row: ties included, for every number of alternatives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import backends.transformers.step_pass
from backends.sampling import Sampler, greedy_alternatives, top_k
from backends.transformers.engine import TransformersEngine
from backends.transformers.host_copy import greedy_picks
from backends.types import EngineConfig, Grammar, SamplingParams
from tests.conftest import engine_rows


def host_step(row: np.ndarray, alternatives: int):
    step = Sampler(SamplingParams(temperature=0.0, top_logprobs=alternatives), frozenset()).step(row)
    return step.token_id, step.logprob, step.top_ids.tolist(), step.top_logprobs.tolist()


@pytest.mark.parametrize("alternatives", [1, 2, 5, 20])
def test_picks_equal_the_host_sampler_on_the_row_ties_included(alternatives):
    rng = np.random.default_rng(alternatives)
    rows = rng.standard_normal((6, 1000)).astype(np.float32)
    rows[1, [7, 3, 900]] = rows[1].max() + 1  # the best value three times: the lowest id wins
    rows[2, :] = 0.0  # every entry equal
    rows[3, [10, 11, 12, 13]] = rows[3].max() + 1  # ties among the alternatives
    rows = np.log(np.exp(rows) / np.exp(rows).sum(axis=1, keepdims=True)).astype(np.float32)
    picks = greedy_picks(torch.from_numpy(rows), [alternatives] * len(rows))
    for row, pick in zip(rows, picks, strict=True):
        chosen = Sampler(SamplingParams(temperature=0.0, top_logprobs=alternatives), frozenset()).step(pick)
        token, logprob, ids, values = host_step(row, alternatives)
        assert (chosen.token_id, chosen.logprob, chosen.top_logprobs.tolist()) == (token, logprob, values)
        assert row[chosen.top_ids].tolist() == values and len(set(chosen.top_ids.tolist())) == alternatives
        if np.count_nonzero(row == values[-1]) == values.count(values[-1]):
            assert chosen.top_ids.tolist() == ids  # which of values equal to the last are left out is
            # either side's own choice; all else is the same
    assert picks[1].token == 3 and picks[2].token == 0


def test_mixed_numbers_of_alternatives_in_one_call():
    rows = torch.log_softmax(torch.randn(3, 500, generator=torch.Generator().manual_seed(0)), dim=-1)
    picks = greedy_picks(rows, [1, 4, 2])
    assert [len(p.top_ids) for p in picks] == [1, 4, 2]
    for row, pick in zip(rows.numpy(), picks, strict=True):
        ids, values = top_k(row, len(pick.top_ids))
        assert pick.top_ids.tolist() == ids.tolist() and pick.top_logprobs.tolist() == values.tolist()


def test_only_plain_greedy_streams_are_picked_on_the_device():
    assert greedy_alternatives(SamplingParams(temperature=0.0)) == 1
    assert greedy_alternatives(SamplingParams(temperature=0.0, top_logprobs=5)) == 5
    assert greedy_alternatives(SamplingParams(temperature=0.7)) is None
    assert greedy_alternatives(SamplingParams(temperature=0.0, logit_bias={3: 1.0})) is None
    assert greedy_alternatives(SamplingParams(temperature=0.0, presence_penalty=0.5)) is None
    assert greedy_alternatives(SamplingParams(temperature=0.0, grammar=Grammar("regex", "a+"))) is None


@pytest.fixture(scope="module")
def engine(model_dir):
    return TransformersEngine.load(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))


async def test_a_greedy_stream_equals_the_host_sampler_on_each_prefix_row(engine, monkeypatch):
    picked: list[int] = []

    def counting(logprobs, alternatives):
        picked.append(len(alternatives))
        return greedy_picks(logprobs, alternatives)

    monkeypatch.setattr(backends.transformers.step_pass, "greedy_picks", counting)
    prompt = engine.info.tokenizer("The capital of France is").input_ids
    params = SamplingParams(max_tokens=12, temperature=0.0, top_logprobs=3)
    steps = [step async for step in engine.generate(prompt, params)]
    assert sum(picked) == len(steps)  # every step chosen on the device
    prefixes = [prompt + [s.token_id for s in steps[:i]] for i in range(len(steps))]
    rows = await engine_rows(engine, prefixes)
    for row, step in zip(rows, steps, strict=True):
        token, logprob, ids, values = host_step(row, 3)
        assert step.token_id == token and step.top_ids.tolist() == ids
        np.testing.assert_allclose([step.logprob, *step.top_logprobs], [logprob, *values], rtol=0, atol=1e-4)
