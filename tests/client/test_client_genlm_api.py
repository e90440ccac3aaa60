"""The rest of genlm-backend's `AsyncLM` on AsyncGatewayLM, against real gateways: the type check,
adapter selection (set_lora/clear_lora) and management (add_new_lora/remove_lora through the
admin endpoints), the uncached row, and sample's seeds giving genlm's own tokens."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from logprob_gateway_client import AsyncGatewayLM, GatewayClientError
from logprob_gateway_client.wire import pack_ids
from tests.conftest import MODEL

pytestmark = pytest.mark.slow
genlm_llm = pytest.importorskip("genlm.backend.llm")
PROMPT = "The capital of France is"


@pytest.fixture()
def lm(gateway):
    client = AsyncGatewayLM(gateway.base_url, MODEL)
    yield client
    client.close()


def server_row(gateway, model: str, ids: list[int]) -> np.ndarray:
    """The gateway's row for `model`, asked directly over JSON."""
    r = httpx.post(
        gateway.base_url + "/v1/next_token_logprobs", json={"model": model, "input": [ids]}, timeout=60
    )
    assert r.status_code == 200, r.text
    return np.array(r.json()["data"][0]["logprobs"], dtype=np.float32)


def served_models(gateway) -> set[str]:
    return {m["id"] for m in httpx.get(gateway.base_url + "/v1/models").json()["data"]}


def test_a_client_is_a_genlm_async_lm(lm):
    assert isinstance(lm, genlm_llm.AsyncLM)


async def test_set_lora_and_clear_lora_choose_the_adapter_of_later_calls(lora_gateway, reference):
    ids = reference.tokenizer(PROMPT).input_ids
    with_a = server_row(lora_gateway, f"{MODEL}:a", ids)
    base = server_row(lora_gateway, MODEL, ids)
    assert np.max(np.abs(with_a - base)) > 0.5  # the adapter really changes the row
    longer = server_row(lora_gateway, f"{MODEL}:a", ids + [11])
    async with AsyncGatewayLM(lora_gateway.base_url, MODEL) as lm:
        lm.set_lora("ignored/path", "a")  # genlm's positional call: (lora_path, lora_name)
        assert np.max(np.abs(lm.next_token_logprobs_sync(ids).numpy() - with_a)) <= 1e-4
        assert np.max(np.abs((await lm.next_token_logprobs(ids + [11])).numpy() - longer)) <= 1e-4
        with pytest.raises(GatewayClientError) as unknown:  # a call's own lora_name wins
            lm.next_token_logprobs_sync(ids, lora_name="nope")
        assert unknown.value.status == 404 and "no adapter 'nope'" in unknown.value.message
        lm.clear_lora()
        assert np.max(np.abs(lm.next_token_logprobs_sync(ids).numpy() - base)) <= 1e-4
        lm.set_lora(lora_name="a")
        assert np.max(np.abs((await lm.batch_next_token_logprobs([ids]))[0].numpy() - with_a)) <= 1e-4
        assert np.max(np.abs(lm.next_token_logprobs_sync(ids, lora_name="a").numpy() - with_a)) <= 1e-4


def test_add_new_lora_then_remove_lora_through_the_admin_endpoints(lora_gateway, reference):
    ids = reference.tokenizer(PROMPT).input_ids
    base = server_row(lora_gateway, MODEL, ids)
    with AsyncGatewayLM(lora_gateway.base_url, MODEL, admin_key="admin-secret") as lm:
        lm.add_new_lora("b", "b")  # genlm's order: (lora_path, lora_name); relative to adapters_root
        assert f"{MODEL}:b" in served_models(lora_gateway)
        rows = lm.next_token_logprobs_sync(ids, lora_name="b").numpy()
        assert np.max(np.abs(rows - server_row(lora_gateway, f"{MODEL}:b", ids))) <= 1e-4
        assert np.max(np.abs(rows - base)) > 0.5
        lm.remove_lora("b")
        assert f"{MODEL}:b" not in served_models(lora_gateway)
        with pytest.raises(GatewayClientError) as gone:  # its cached row is not served either
            lm.next_token_logprobs_sync(ids, lora_name="b")
        assert gone.value.status == 404 and "no adapter 'b'" in gone.value.message
        with pytest.raises(GatewayClientError) as taken:
            lm.add_new_lora(lora_path="b", lora_name="a")
        assert taken.value.status == 400 and "already loaded" in taken.value.message
        with pytest.raises(GatewayClientError) as outside:
            lm.add_new_lora("/etc", "c")
        assert outside.value.status == 403 and "adapters root" in outside.value.message
    with AsyncGatewayLM(lora_gateway.base_url, MODEL, admin_key="wrong") as lm:
        with pytest.raises(GatewayClientError) as refused:
            lm.remove_lora("a")
        assert refused.value.status == 401 and "admin key" in refused.value.message
    assert served_models(lora_gateway) == {MODEL, f"{MODEL}:a"}


def test_adapter_management_without_an_admin_key_fails_before_any_request(lora_gateway):
    sent: list[httpx.Request] = []
    with AsyncGatewayLM(lora_gateway.base_url, MODEL) as lm:
        lm._sync.event_hooks["request"].append(sent.append)
        with pytest.raises(PermissionError, match="add_new_lora needs the gateway's admin key"):
            lm.add_new_lora("b", "b")
        with pytest.raises(PermissionError, match="remove_lora needs the gateway's admin key"):
            lm.remove_lora("a")
        assert sent == []
        lm.next_token_logprobs_sync([1, 2])  # the hook sees the requests the client does send
        assert len(sent) == 1
    assert served_models(lora_gateway) == {MODEL, f"{MODEL}:a"}


def test_uncached_rows_come_from_the_gateway_never_from_the_clients_cache(lm, reference):
    ids = reference.tokenizer(PROMPT).input_ids
    want = reference.logprobs(ids)[-1]
    poison = np.zeros((1, lm.vocab_size), dtype=np.float32)
    lm._cache.put_rows([(MODEL, pack_ids(ids))], poison)
    assert torch.equal(lm.next_token_logprobs_sync(ids), torch.from_numpy(poison[0]))  # the cached path
    sent = lm.requests_sent
    for _ in range(2):
        uncached = lm.next_token_logprobs_uncached(ids)
        assert isinstance(uncached, torch.Tensor) and np.max(np.abs(uncached.numpy() - want)) <= 1e-4
    assert lm.requests_sent == sent + 2  # asked each time
    assert not lm._cache.get((MODEL, pack_ids(ids))).any()  # nor stored: the poisoned row stays
    lm.clear_cache()
    assert torch.equal(lm.next_token_logprobs_sync(ids), uncached)  # what the cached path gets


async def test_sample_gives_genlm_samples_tokens_for_a_seed(lm, reference):
    prompt = reference.tokenizer(PROMPT).input_ids
    eos = lm.eos_token_ids
    genlm_sample = genlm_llm.AsyncLM.sample  # genlm's own sampler, over this client's rows
    # each seed and each temperature once: all nine pairs made the same comparison, at nine times the cost
    for seed, temperature in ((0, 1.0), (3, 0.7), (11, 1.5)):
        ours = await lm.sample(prompt, 8, eos, temperature=temperature, seed=seed)
        theirs = await genlm_sample(lm, prompt, 8, eos, temperature=temperature, seed=seed)
        assert ours == theirs and len(ours) > 0
    prompts = [prompt, reference.tokenizer("Once upon a time").input_ids]
    ours = await lm.batch_sample(prompts, 6, eos, temperature=1.0, seed=5)
    assert ours == await genlm_llm.AsyncLM.batch_sample(lm, prompts, 6, eos, temperature=1.0, seed=5)
    torch.manual_seed(21)  # no seed: torch's global generator, as genlm draws from it
    ours = await lm.sample(prompt, 8, eos)
    torch.manual_seed(21)
    assert ours == await genlm_sample(lm, prompt, 8, eos)
