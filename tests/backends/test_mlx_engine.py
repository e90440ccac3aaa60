"""The MLX engine on the CPU build of MLX, against a direct transformers forward pass of the same weights."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

pytest.importorskip("mlx_lm")

from backends.errors import AdapterError, WeightsError  # noqa: E402
from backends.mlx.engine import MlxEngine  # noqa: E402
from backends.types import EngineConfig, SamplingParams  # noqa: E402
from tests.conftest import MODEL, engine_rows, load_peft_models, make_lora_adapter  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.mlx]
TEXTS = ["The capital of France is", "Hi", "A longer sentence about the weather in Paris today"]


@pytest.fixture(scope="module")
def engine(model_dir):
    return MlxEngine.load(EngineConfig(model=str(model_dir)))


@pytest.fixture(scope="module")
def bf16_engine(model_dir):
    return MlxEngine.load(EngineConfig(model=str(model_dir), dtype="bfloat16"))


def close_in_bfloat16(got, want, nats=0.1):
    """Within `nats` on the reference's top 100, and the same top 10 up to the reference's near-ties:
    the k-th token by `got` is within `nats` of the reference's k-th best."""
    top = np.argsort(-want)[:100]
    assert np.max(np.abs(got[top] - want[top])) <= nats
    ranked = np.argsort(-got)[:10]
    assert np.max(np.abs(want[ranked] - want[top[:10]])) <= nats


async def test_batched_rows_match_transformers(engine, reference):
    rows = [reference.tokenizer(t).input_ids for t in TEXTS]
    batched = await engine_rows(engine, rows)
    assert batched.shape == (3, 49152) and batched.dtype == np.float32
    for row, ids in zip(batched, rows, strict=True):
        want = reference.logprobs(ids)[-1]
        assert np.max(np.abs(row - want)) <= 1e-3  # float32 weights: equal up to kernel round-off
        close_in_bfloat16(row, want)
        alone = (await engine_rows(engine, [ids]))[0]
        assert np.max(np.abs(alone - row)) <= 1e-4  # padding and positions are right


async def test_concurrent_dense_calls_and_a_stream_share_a_pass(engine, reference):
    import asyncio

    rows = [reference.tokenizer(t).input_ids for t in TEXTS]
    alone = [await engine_rows(engine, [ids]) for ids in rows]
    before = engine.status().pass_stats
    generator = engine.generate(rows[0], SamplingParams(max_tokens=1, temperature=0))
    first, second, steps = await asyncio.gather(
        engine_rows(engine, rows[:2]), engine_rows(engine, rows[1:]), anext(generator)
    )
    await generator.aclose()
    after = engine.status().pass_stats
    assert after.passes - before.passes == 1 and after.largest >= 3
    assert after.rows - before.rows == 4  # the row both calls ask for once, and the stream's
    for got, want in ((first, alone[:2]), (second, alone[1:])):
        np.testing.assert_allclose(got, np.concatenate(want), rtol=0, atol=1e-4)
    assert steps.token_id == reference.greedy(rows[0], 1)[0]


async def test_generation_reuses_cached_prompt_prefixes(model_dir, reference, lora):
    paths, _ = lora
    engine = MlxEngine.load(EngineConfig(model=str(model_dir)))
    await engine.adapters.load("a", str(paths["a"]))
    prompt = reference.tokenizer(
        "A shared system prompt that many requests start with, then a question:"
    ).input_ids
    greedy = SamplingParams(max_tokens=4, temperature=0)

    async def run(ids, adapter=None):
        before = engine.prompt_tokens_computed
        tokens = [s.token_id async for s in engine.generate(ids, greedy, adapter)]
        return tokens, engine.prompt_tokens_computed - before

    first, computed = await run(prompt)
    assert computed == len(prompt) and first == reference.greedy(prompt, 4)
    again, computed = await run(prompt)  # exact hit: only the last token is recomputed
    assert computed == 1 and again == first
    longer = prompt + reference.tokenizer(" Why?", add_special_tokens=False).input_ids
    extended, computed = await run(longer)  # prefix hit: only the new tokens
    assert computed == len(longer) - len(prompt) and extended == reference.greedy(longer, 4)
    _, computed = await run(prompt, "a")  # another adapter never reuses the base's state
    assert computed == len(prompt)


async def test_flush_cache_forgets_the_prompt_cache(engine, reference):
    prompt = reference.tokenizer("A prompt that the flush test generates from twice").input_ids
    greedy = SamplingParams(max_tokens=2, temperature=0)

    async def computed() -> int:
        before = engine.prompt_tokens_computed
        [s async for s in engine.generate(prompt, greedy)]
        return engine.prompt_tokens_computed - before

    await computed()
    assert await computed() == 1  # an exact hit: only the last token
    await engine.prefix_cache.flush()
    assert await computed() == len(prompt)


async def test_bfloat16_engine_keeps_rows_unquantised(bf16_engine, reference):
    """The whole network in bfloat16 moves top-100 logprobs by 0.2-0.5 nats on these prompts
    (measured), so bfloat16 is for speed, float32 for exact numbers. The output head stays in
    float32: rows are not bucketed to bfloat16 steps, and clear winners stay winners."""
    assert bf16_engine.info.dtype == "bfloat16"
    rows = [reference.tokenizer(t).input_ids for t in TEXTS]
    for row, ids in zip(await engine_rows(bf16_engine, rows), rows, strict=True):
        want = reference.logprobs(ids)[-1]
        first, second = np.sort(want)[::-1][:2]
        if first - second > 0.5:
            assert np.argmax(row) == np.argmax(want)
        assert len(np.unique(row[np.argsort(-row)[:100]])) > 90
        assert abs(np.exp(row.astype(np.float64)).sum() - 1) < 1e-4


async def test_prompt_logprobs_and_greedy_generation(engine, reference):
    ids = reference.tokenizer(TEXTS[2]).input_ids
    scores = await engine.prompt_logprobs(ids, 5)
    rows = reference.logprobs(ids)
    assert np.max(np.abs(scores.token_logprobs - rows[np.arange(len(ids) - 1), ids[1:]])) <= 1e-3
    assert scores.top_ids[:, 0].tolist() == np.argmax(rows[:-1], axis=-1).tolist()
    prompt = reference.tokenizer(TEXTS[0]).input_ids
    steps = [s async for s in engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0))]
    assert [s.token_id for s in steps] == reference.greedy(prompt, 8)


@pytest.fixture(scope="module")
def lora(model_dir, tmp_path_factory):
    """Two PEFT adapters, and transformers+PEFT references for each."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("mlx-adapters")
    paths = {name: make_lora_adapter(model_dir, root / name, seed) for name, seed in (("a", 11), ("b", 12))}
    references = {}
    for name, path in paths.items():
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        references[name] = PeftModel.from_pretrained(base, path).eval()
    return paths, references


def peft_row(model, ids):
    import torch

    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1).numpy()


async def test_concurrent_streams_decode_together_each_as_if_alone(model_dir, lora, reference, monkeypatch):
    import asyncio

    paths, _ = lora
    engine = MlxEngine.load(EngineConfig(model=str(model_dir)))
    await engine.adapters.load("a", str(paths["a"]))
    prompts = [reference.tokenizer(t).input_ids for t in [*TEXTS, "Once upon a time", "def f(x):"]]
    adapters = [None, "a", None, "a", None]
    params = SamplingParams(max_tokens=12, temperature=0, top_logprobs=2)

    async def run(ids, adapter, stop_after=None):
        steps = []
        generator = engine.generate(ids, params, adapter)
        async for step in generator:
            steps.append(step)
            if stop_after is not None and len(steps) == stop_after:
                break
        await generator.aclose()
        return steps

    alone = [await run(ids, a) for ids, a in zip(prompts, adapters, strict=True)]
    sizes = []
    run_pass = engine.steps._run_pass

    async def recording(groups):
        sizes.append(sum(1 for steps in groups for stream, _ in steps if stream.cache))  # decoding in it
        return await run_pass(groups)

    monkeypatch.setattr(engine.steps, "_run_pass", recording)
    together = await asyncio.gather(
        *(run(ids, a) for ids, a in zip(prompts, adapters, strict=True)), run(prompts[0], None, stop_after=3)
    )
    for batched, single in zip(together, alone, strict=False):
        assert [s.token_id for s in batched] == [s.token_id for s in single]
        np.testing.assert_allclose(
            [s.logprob for s in batched], [s.logprob for s in single], rtol=0, atol=1e-4
        )
    assert [s.token_id for s in together[-1]] == [s.token_id for s in alone[0][:3]]
    assert max(sizes) == len(prompts) + 1  # every stream decoding in one pass
    assert len(sizes) < sum(len(steps) for steps in alone) / 3


async def test_lora_rows_match_peft_in_mixed_batches(model_dir, lora, reference):
    paths, references = lora
    engine = MlxEngine.load(EngineConfig(model=str(model_dir)))
    for name, path in paths.items():
        await engine.adapters.load(name, str(path))
    rows = [reference.tokenizer(t).input_ids for t in TEXTS]
    adapters = ["a", None, "b"]
    mixed = await engine_rows(engine, rows, adapters)  # one forward pass, three "models"
    for row, ids, adapter in zip(mixed, rows, adapters, strict=True):
        want = reference.logprobs(ids)[-1] if adapter is None else peft_row(references[adapter], ids)
        assert np.max(np.abs(row - want)) <= 1e-3
    base = (await engine_rows(engine, [rows[0]]))[0]
    assert np.max(np.abs(mixed[0] - base)) > 0.5  # the adapter changes the model
    prompt = rows[0]
    steps = [s async for s in engine.generate(prompt, SamplingParams(max_tokens=5, temperature=0), "a")]
    import torch

    tokens = torch.tensor([prompt])
    expected = (
        references["a"]
        .generate(
            input_ids=tokens,
            attention_mask=torch.ones_like(tokens),
            max_new_tokens=5,
            do_sample=False,
            eos_token_id=None,
        )[0, len(prompt) :]
        .tolist()
    )
    assert [s.token_id for s in steps] == expected
    await engine.adapters.unload("b")
    with pytest.raises(AdapterError, match="not loaded"):
        await engine_rows(engine, [rows[0]], ["b"])
    after = await engine_rows(engine, [rows[0]], ["a"])
    assert np.max(np.abs(after[0] - mixed[0])) <= 1e-4


async def test_bad_adapters_leave_the_engine_unchanged(model_dir, lora, reference, tmp_path):
    import json

    paths, _ = lora
    engine = MlxEngine.load(EngineConfig(model=str(model_dir)))
    bad = make_lora_adapter(model_dir, tmp_path / "bad", 13)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_model.safetensors").write_bytes(
        (paths["a"] / "adapter_model.safetensors").read_bytes()[:100]
    )
    with pytest.raises(AdapterError, match="cannot be read"):
        await engine.adapters.load("bad", str(bad))
    assert config["r"] == 4
    ids = reference.tokenizer(TEXTS[0]).input_ids
    assert np.max(np.abs((await engine_rows(engine, [ids]))[0] - reference.logprobs(ids)[-1])) <= 1e-3


def test_openai_sdk_through_the_mlx_backend(mlx_gateway, lora_adapters, model_dir, reference):
    _, paths, _ = lora_adapters
    client = openai.OpenAI(base_url=mlx_gateway.base_url + "/v1", api_key="unused", max_retries=0)
    ids = reference.tokenizer(TEXTS[0]).input_ids
    expected = reference.tokenizer.decode(reference.greedy(ids, 6))
    out = client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=6, temperature=0, logprobs=1)
    assert out.choices[0].text == expected
    stream = client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    dense = httpx.post(
        mlx_gateway.base_url + "/v1/next_token_logprobs", json={"model": f"{MODEL}:a", "input": [ids]}
    )
    row = np.array(dense.json()["data"][0]["logprobs"], dtype=np.float32)
    peft_a = load_peft_models(model_dir, {"a": paths["a"]})["a"]
    assert np.max(np.abs(row - peft_row(peft_a, ids))) <= 1e-3


async def test_new_weights_load_in_place_and_bad_ones_change_nothing(
    model_dir, scaled_dir, scaled, reference, tmp_path
):
    engine = MlxEngine.load(EngineConfig(model=str(model_dir)))
    rows = [reference.tokenizer(t).input_ids for t in TEXTS]
    before = await engine_rows(engine, rows)
    greedy = SamplingParams(max_tokens=5, temperature=0)
    old = [s async for s in engine.generate(rows[2], greedy)]  # the prompt's keys/values now cached
    assert [s.token_id for s in old] == reference.greedy(rows[2], 5)
    with pytest.raises(WeightsError, match="has no .safetensors weights"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text((scaled_dir / "config.json").read_text())
        await engine.weights.load(str(tmp_path / "empty"))
    with pytest.raises(WeightsError, match="is not a directory"):
        await engine.weights.load(str(tmp_path / "nowhere"))
    assert np.array_equal(await engine_rows(engine, rows), before)
    await engine.weights.load(str(scaled_dir))
    after = await engine_rows(engine, rows)
    for row, ids in zip(after, rows, strict=True):
        assert np.max(np.abs(row - scaled.logprobs(ids)[-1])) <= 1e-3
    assert np.max(np.abs(after - before)) > 0.01
    steps = [s async for s in engine.generate(rows[2], greedy)]
    tokens = [s.token_id for s in steps]
    assert tokens == scaled.greedy(rows[2], 5)
    want = scaled.logprobs(rows[2] + tokens)[len(rows[2]) - 1 : -1]
    got = [s.logprob for s in steps]
    np.testing.assert_allclose(got, [w[t] for w, t in zip(want, tokens, strict=True)], rtol=0, atol=1e-3)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(old, steps, strict=True)) > 0.01
