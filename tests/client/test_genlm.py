"""genlm-control runs unchanged on AsyncGatewayLM, with the numbers of its local transformers backend."""

from __future__ import annotations

import numpy as np
import pytest

from logprob_gateway_client import AsyncGatewayLM
from tests.conftest import MODEL

pytestmark = pytest.mark.slow
genlm_control = pytest.importorskip("genlm.control")
genlm_llm = pytest.importorskip("genlm.backend.llm")


def _weights(w) -> np.ndarray:
    return np.asarray(w.weights, dtype=np.float64)


async def test_prompted_llm_matches_local_genlm_backend(gateway, reference):
    remote = AsyncGatewayLM(gateway.base_url, MODEL)
    local = genlm_llm.AsyncTransformer(reference.model, reference.tokenizer)
    prompt = reference.tokenizer.encode("The capital of France is")
    weights = []
    for llm in (remote, local):
        potential = genlm_control.PromptedLLM(llm, prompt_ids=prompt)
        paris = [llm.byte_vocab[i] for i in reference.tokenizer.encode(" Paris", add_special_tokens=False)]
        weights.append(
            (
                _weights(await potential.logw_next([])),
                _weights(await potential.logw_next(paris)),
                await potential.prefix(paris),
            )
        )
    await remote.aclose()
    (remote_first, remote_next, remote_prefix), (local_first, local_next, local_prefix) = weights
    assert remote_first.shape == local_first.shape
    finite = np.isfinite(local_first)
    assert np.array_equal(finite, np.isfinite(remote_first))
    assert np.max(np.abs(remote_first[finite] - local_first[finite])) <= 1e-4
    assert np.max(np.abs(remote_next[np.isfinite(local_next)] - local_next[np.isfinite(local_next)])) <= 1e-4
    assert abs(remote_prefix - local_prefix) <= 1e-4
