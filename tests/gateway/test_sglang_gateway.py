"""The SGLang engine behind the gateway, in managed-server mode, against the stand-in SGLang server
(tests/backends/sglang_standin.py): what a client sees through HTTP, the `openai` SDK and
`AsyncGatewayLM` equals what the stand-in's model says, token for token and bit for bit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import openai
import pytest

from bench.launcher import start_gateway
from logprob_gateway_client import AsyncGatewayLM
from tests.conftest import require_engine_library

require_engine_library("sglang")

from tests.backends.sglang_standin import distribution  # noqa: E402

STANDIN = Path(__file__).parents[1] / "backends" / "sglang_standin.py"


@pytest.fixture(scope="module")
def gateway(model_dir, tmp_path_factory):
    config = tmp_path_factory.mktemp("sglang") / "gateway.toml"
    command = json.dumps([sys.executable, str(STANDIN)])
    config.write_text(f"""
[[models]]
name = "sg"
model = "{model_dir}"
backend = "sglang"
options = {{mode = "server", server_command = {command}, startup_timeout_s = 120}}
""")
    gateway = start_gateway(["--config", str(config), "--no-cache"], config.parent / "gateway.log")
    yield gateway
    gateway.stop()


async def test_dense_rows_through_the_client(gateway):
    client = AsyncGatewayLM(gateway.base_url, "sg")
    try:
        rows = [[1, 2, 3], [4], [1, 2, 3, 4, 5, 6]]
        got = np.asarray(await client.batch_next_token_logprobs(rows))
        vocab = got.shape[1]
        want = np.stack([distribution(row, None, vocab) for row in rows])
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)  # SGLang's log_softmax in float32
    finally:
        await client.aclose()


def test_completion_and_echo_scores_through_the_openai_sdk(gateway, model_dir):
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    sdk = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="unused")
    prompt = [5, 6, 7]
    out = sdk.completions.create(
        model="sg", prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    ids, logprobs = list(prompt), []
    for _ in range(3):  # the stand-in's model, greedily
        dist = distribution(ids, None, vocab)
        ids.append(int(np.argmax(dist)))
        logprobs.append(float(dist[ids[-1]]))
    scores = out.choices[0].logprobs.token_logprobs
    assert scores[0] is None
    want_prompt = [float(distribution(prompt[:i], None, vocab)[prompt[i]]) for i in (1, 2)]
    np.testing.assert_allclose(scores[1:], want_prompt + logprobs, rtol=0, atol=1e-6)
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_unknown_adapter_is_a_404_not_a_500(gateway):
    sdk = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="unused")
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="sg:missing", prompt=[1], max_tokens=1)
