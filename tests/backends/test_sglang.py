"""The SGLang engine against a stand-in SGLang server (sglang_standin.py: SGLang's HTTP API on a
fake model, checking every request body against sglang's real GenerateReqInput), plus the
managed-server lifecycle; the real engine runs only where CUDA and sglang are present."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import engine_rows, require_engine_library

require_engine_library("sglang")

from backends.errors import AdapterError, GrammarError, RequestRejectedError  # noqa: E402
from backends.sglang.engine import ScatterError, SglangEngine, scatter_row  # noqa: E402
from backends.sglang.processor import PROCESSOR  # noqa: E402
from backends.sglang.transport import ManagedServer, SglangError  # noqa: E402
from backends.types import EngineConfig, Grammar, SamplingParams  # noqa: E402
from bench.launcher import free_port  # noqa: E402
from tests.backends.sglang_standin import distribution  # noqa: E402

STANDIN = [sys.executable, str(Path(__file__).with_name("sglang_standin.py"))]


def _config(model_dir, **options) -> EngineConfig:
    return EngineConfig(model=str(model_dir), max_lora_rank=8, options=options)


@pytest.fixture(scope="module")
async def engine(model_dir):
    """A managed stand-in server, launched the way `sglang.launch_server` would be."""
    config = _config(model_dir, mode="server", server_command=STANDIN, startup_timeout_s=120)
    engine = await asyncio.to_thread(SglangEngine.load, config)
    yield engine
    server = engine.transport.server
    await engine.aclose()
    assert not server.alive() and not engine.status().healthy


@pytest.fixture
async def sent(engine):
    """The /generate bodies the stand-in receives during one test."""
    url = engine.transport.base_url + "/standin/requests"
    before = len(httpx.get(url).json())
    return lambda: httpx.get(url).json()[before:]


@pytest.fixture(scope="module")
async def adapter(engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("adapter")  # the stand-in only checks that it exists
    await engine.adapters.load("a", str(path))
    return "a"


async def test_dense_rows_are_the_full_distribution_in_token_id_order(engine, sent):
    rows = [[1, 2, 3], [5], [7, 8, 9, 10]]
    out = await engine_rows(engine, rows)
    assert out.shape == (3, engine.info.vocab_size) and out.dtype == np.float32
    for row, got in zip(rows, out, strict=True):  # the processor's own log_softmax, in float32
        np.testing.assert_allclose(got, distribution(row, None, engine.info.vocab_size), rtol=0, atol=2e-5)
    bodies = sent()
    assert sorted(b["input_ids"] for b in bodies) == sorted(rows)
    assert {b["custom_logit_processor"] for b in bodies} == {PROCESSOR}
    assert all(b["sampling_params"]["custom_params"] == {"b64": True} for b in bodies)  # JSON over HTTP
    assert {b["sampling_params"]["max_new_tokens"] for b in bodies} == {1}


async def test_lora_routing_is_per_request(engine, adapter, sent):
    out = await engine_rows(engine, [[4, 5], [4, 5]], [None, adapter])
    np.testing.assert_allclose(out[0], distribution([4, 5], None, engine.info.vocab_size), rtol=0, atol=2e-5)
    np.testing.assert_allclose(
        out[1], distribution([4, 5], adapter, engine.info.vocab_size), rtol=0, atol=2e-5
    )
    assert sorted(b["lora_path"] or "" for b in sent()) == ["", adapter]
    with pytest.raises(AdapterError):
        await engine_rows(engine, [[1]], ["missing"])


async def test_adapter_load_errors_and_unload(engine, tmp_path):
    with pytest.raises(AdapterError, match="no adapter"):
        await engine.adapters.load("broken", str(tmp_path / "absent"))
    await engine.adapters.load("b", str(tmp_path))
    await engine.adapters.unload("b")
    with pytest.raises(AdapterError):
        await engine_rows(engine, [[1]], ["b"])


async def test_prompt_logprobs(engine, adapter):
    ids = [3, 1, 4, 1, 5]
    scores = await engine.prompt_logprobs(ids, 3, adapter)
    dists = [distribution(ids[:i], adapter, engine.info.vocab_size) for i in range(1, len(ids))]
    np.testing.assert_allclose(scores.token_logprobs, [d[t] for d, t in zip(dists, ids[1:], strict=True)])
    for d, top_ids, top_values in zip(dists, scores.top_ids, scores.top_logprobs, strict=True):
        np.testing.assert_array_equal(top_ids, np.argsort(-d, kind="stable")[:3])
        np.testing.assert_array_equal(top_values, d[top_ids])
    bare = await engine.prompt_logprobs(ids, 0)
    assert bare.top_ids.shape == (4, 0) and bare.token_logprobs.shape == (4,)
    single = await engine.prompt_logprobs([7], 2)
    assert single.token_logprobs.shape == (0,) and single.top_ids.shape == (0, 2)


async def test_generation_streams_token_steps(engine, sent):
    params = SamplingParams(max_tokens=5, temperature=0.0, top_logprobs=2, seed=1, logit_bias={3: 1.0})
    steps = [step async for step in engine.generate([2, 7], params)]
    prefix = [2, 7]
    for step in steps:  # the stand-in decodes greedily
        d = distribution(prefix, None, engine.info.vocab_size)
        assert step.token_id == int(np.argmax(d)) and step.logprob == pytest.approx(d[step.token_id])
        np.testing.assert_array_equal(step.top_ids, np.argsort(-d, kind="stable")[:2])
        prefix.append(step.token_id)
    assert len(steps) == 5
    assert [s.finish_reason for s in steps] == [None] * 4 + ["length"]
    (body,) = sent()
    assert body["stream"] and body["sampling_params"]["logit_bias"] == {"3": 1.0}
    assert body["sampling_params"]["stop_token_ids"] == sorted(engine.info.eos_token_ids)


async def test_token_controls_are_sglangs_own_fields(engine, sent):
    """The stand-in builds SGLang's own SamplingParams from the body, which checks each field."""
    params = SamplingParams(
        max_tokens=3,
        temperature=0.0,
        top_k=4,
        min_p=0.1,
        repetition_penalty=1.5,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=frozenset({5}),
    )
    steps = [step async for step in engine.generate([2, 7], params)]
    assert steps
    (body,) = sent()
    sampling = body["sampling_params"]
    assert (sampling["top_k"], sampling["min_p"], sampling["repetition_penalty"]) == (4, 0.1, 1.5)
    assert (sampling["min_new_tokens"], sampling["ignore_eos"]) == (2, True)
    assert sampling["stop_token_ids"] == [5]  # end-of-sequence ends nothing under ignore_eos
    with pytest.raises(RequestRejectedError, match="bad_words"):
        [step async for step in engine.generate([2, 7], SamplingParams(bad_words=((5, 6),)))]
    with pytest.raises(RequestRejectedError, match="allowed_token_ids"):
        [step async for step in engine.generate([2, 7], SamplingParams(allowed_token_ids=(5,)))]


async def test_generation_without_logprobs_in_bursts(engine, sent, monkeypatch):
    """A caller that reads no logprobs and takes the tokens whole: SGLang computes no logprobs and
    sends the tokens every `stream_interval` steps; the tokens are the same."""
    both = SamplingParams(max_tokens=12, temperature=0.0)
    plain = [s async for s in engine.generate([4, 9], both)]
    chunks, stream = [], engine.transport.stream

    async def counted(request):
        async for out in stream(request):
            chunks.append(len(out["output_ids"]))
            yield out

    monkeypatch.setattr(engine.transport, "stream", counted)
    bursts = [s async for s in engine.generate([4, 9], replace(both, logprobs=False, stream_interval=5))]
    assert chunks == [1, 5, 5, 1]  # the first token, every fifth after it, the finish
    assert [s.token_id for s in bursts] == [s.token_id for s in plain] and len(plain) == 12
    assert [s.finish_reason for s in bursts] == [None] * 11 + ["length"]
    assert all(np.isnan(s.logprob) and s.top_ids.size == 0 for s in bursts)
    assert not any(np.isnan(s.logprob) for s in plain)
    first, second = sent()
    assert first["return_logprob"] and first["sampling_params"]["stream_interval"] == 1
    assert not second["return_logprob"] and second["sampling_params"]["stream_interval"] == 5


async def test_grammars_go_to_sglangs_own_fields(engine, sent):
    """SGLang enforces grammars itself, with the llguidance backend the gateway's check uses; the
    stand-in builds each body into sglang's own SamplingParams, which refuses misspelled fields."""
    cases = [
        (Grammar("regex", r"\d{4}-[\d]{2}"), "regex", "[0-9]{4}-[0-9]{2}"),  # \d as ASCII digits
        (Grammar("json_schema", '{"type": "object"}'), "json_schema", '{"type": "object"}'),
        (Grammar("ebnf", 'root ::= "a" | "b"'), "ebnf", 'root ::= "a" | "b"'),
        (Grammar("lark", 'start: "a" | "b"'), "ebnf", 'start: "a" | "b"'),  # its llguidance reads Lark there
    ]
    for grammar, _, _ in cases:
        await engine.structured_outputs.check(grammar, 5.0)
        params = SamplingParams(max_tokens=2, temperature=0.0, grammar=grammar)
        assert len([s async for s in engine.generate([2, 7], params)]) == 2
    bodies = sent()
    for (_, field, value), body in zip(cases, bodies, strict=True):
        constraints = {
            k: v for k, v in body["sampling_params"].items() if k in ("regex", "json_schema", "ebnf")
        }
        assert constraints == {field: value}
    argv = httpx.get(engine.transport.base_url + "/server_info").json()["argv"]
    assert argv[argv.index("--grammar-backend") + 1] == "llguidance"
    assert "--constrained-json-disable-any-whitespace" in argv
    with pytest.raises(GrammarError, match="look-around"):
        await engine.structured_outputs.check(Grammar("regex", "(?<=a)b"), 5.0)


async def test_stopping_a_stream_early(engine):
    stream = engine.generate([1, 2], SamplingParams(max_tokens=50, temperature=0.0))
    first = await anext(stream)
    await stream.aclose()
    assert first.finish_reason is None
    assert len([s async for s in engine.generate([1, 2], SamplingParams(max_tokens=0))]) == 0


async def test_refusals(engine):
    too_long = list(range(engine.info.max_model_len + 5))
    with pytest.raises(RequestRejectedError, match="context length"):
        await engine_rows(engine, [too_long])
    with pytest.raises(RequestRejectedError, match="context length"):
        [s async for s in engine.generate(too_long, SamplingParams(max_tokens=2))]
    # The stand-in builds a real GenerateReqInput: a field it does not have is refused.
    with pytest.raises(RequestRejectedError, match="unexpected keyword argument 'top_logprob_num'"):
        await engine.transport.generate({"input_ids": [1], "top_logprob_num": 2})


async def test_managed_server_arguments(engine):
    info = httpx.get(engine.transport.base_url + "/server_info").json()
    assert info["env"]["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"  # raw-distribution logprobs
    argv = info["argv"]
    assert argv[argv.index("--model-path") + 1] == engine.info.path
    assert argv[argv.index("--max-lora-rank") + 1] == "8" and "--enable-lora" in argv
    assert "--enable-custom-logit-processor" in argv  # dense rows through backends/sglang/processor.py


async def test_url_mode_connects_to_a_running_server(engine, model_dir, sent):
    other = SglangEngine.load(_config(model_dir, mode="url", url=engine.transport.base_url))
    try:
        assert other.status().healthy and other.transport.server is None
        # A server the gateway did not start may lack the processor: rows come sorted, exact.
        np.testing.assert_array_equal(
            (await engine_rows(other, [[9, 9]]))[0], distribution([9, 9], None, other.info.vocab_size)
        )
        assert [(b["input_ids"], b["top_logprobs_num"]) for b in sent()] == [
            ([9, 9, 0], other.info.vocab_size)
        ]
    finally:
        await other.aclose()
    assert engine.status().healthy  # closing a url-mode engine leaves the server alone
    told = SglangEngine.load(
        _config(model_dir, mode="url", url=engine.transport.base_url, dense_rows="processor")
    )
    try:
        np.testing.assert_allclose(
            (await engine_rows(told, [[9, 8]]))[0],
            distribution([9, 8], None, told.info.vocab_size),
            rtol=0,
            atol=2e-5,
        )
        assert sent()[-1]["custom_logit_processor"] == PROCESSOR
    finally:
        await told.aclose()


def test_a_server_without_the_processor_flag_refuses_processor_rows(model_dir, tmp_path):
    async def ask(url: str) -> None:
        engine = SglangEngine.load(_config(model_dir, mode="url", url=url, dense_rows="processor"))
        try:
            await engine_rows(engine, [[1, 2]])
        finally:
            await engine.aclose()

    command = [*STANDIN, "--model-path", str(model_dir)]
    server = ManagedServer(command, free_port(), tmp_path / "log", env={})
    try:
        server.wait_healthy(60)
        with pytest.raises(RequestRejectedError, match="enable-custom-logit-processor"):
            asyncio.run(ask(server.base_url))
    finally:
        server.stop(grace_s=0)


# -- chunk handling, without a server ------------------------------------------------------------


class _Chunks:
    """A transport that streams given chunks."""

    def __init__(self, chunks):
        self.chunks = chunks

    async def stream(self, request):
        for chunk in self.chunks:
            yield chunk


def _chunk(tokens, total, finish=None):
    top = [[[-0.1, t, None], [-2.0, 99, None]] for _, t in tokens]
    meta = {
        "completion_tokens": total,
        "output_token_logprobs": [[lp, t, None] for lp, t in tokens],
        "output_top_logprobs": top,
        "finish_reason": finish,
    }
    return {"meta_info": meta}


async def test_incremental_streaming_chunks(model_dir):
    engine = SglangEngine(_Chunks([]), None, model_path=model_dir, dtype="auto", max_model_len=None)
    engine.transport = _Chunks(
        [
            _chunk([(-0.1, 5), (-0.2, 6)], 2),
            _chunk([(-0.3, 7)], 3, {"type": "stop", "matched": 7}),
        ]
    )
    steps = [s async for s in engine.generate([1], SamplingParams(max_tokens=9, top_logprobs=2))]
    assert [(s.token_id, s.finish_reason) for s in steps] == [(5, None), (6, None), (7, "stop")]
    assert steps[2].logprob == pytest.approx(-0.3) and steps[2].top_ids.tolist() == [7, 99]


async def test_standin_answers_are_shaped_as_real_sglangs(engine):
    """The stand-in answers every request the engine sends (and two SGLang refuses) in the shape of
    SGLang 0.5.17's own answers, recorded on a GPU by `python -m bench.sglang_check --record`: the
    same keys, types and list lengths, chunk for chunk when streamed."""
    from bench.sglang_check import answer_shapes, recorded_requests

    real = json.loads(Path(__file__).with_name("sglang_real_answers.json").read_text())
    ids = engine.info.tokenizer(real["prompt"]).input_ids
    requests = recorded_requests(engine, ids)
    assert set(requests) == set(real["answers"])
    ours = await asyncio.to_thread(answer_shapes, engine.transport.base_url, requests)
    for name, answer in real["answers"].items():
        assert ours[name] == answer, name


def test_scatter_checks_every_id_once():
    values = np.array([-0.1, -1.0, -3.0], np.float32)
    np.testing.assert_array_equal(scatter_row(values, np.array([2, 0, 1]), 3), values[[1, 2, 0]])
    with pytest.raises(ScatterError):
        scatter_row(values, np.array([2, 0, 0]), 3)
    with pytest.raises(ScatterError):
        scatter_row(values[:2], np.array([2, 0]), 3)


# -- the managed server's lifecycle ---------------------------------------------------------------


def test_a_crashing_server_surfaces_its_log_tail(model_dir):
    config = _config(model_dir, mode="server", server_command=[*STANDIN, "--behaviour", "crash"])
    with pytest.raises(SglangError, match="(?s)exited with 3.*no kernel image"):
        SglangEngine.load(config)


def test_health_timeout_stops_the_server(model_dir, tmp_path):
    command = [*STANDIN, "--model-path", str(model_dir), "--no-validate", "--behaviour", "never-healthy"]
    server = ManagedServer(command, free_port(), tmp_path / "log", env={})
    with pytest.raises(SglangError, match="(?s)not healthy after 1.5 s.*serving on"):
        server.wait_healthy(1.5)
    assert not server.alive()


def test_stop_kills_a_server_that_ignores_terminate(model_dir, tmp_path):
    command = [*STANDIN, "--model-path", str(model_dir), "--no-validate", "--behaviour", "ignore-term"]
    server = ManagedServer(command, free_port(), tmp_path / "log", env={})
    try:
        server.wait_healthy(30)
        server.stop(grace_s=0.5)
        assert server.process.returncode == -9
    finally:
        server.stop(grace_s=0)


# -- the real engine ----------------------------------------------------------------------------


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.skipif(not _cuda(), reason="SGLang's engine needs CUDA")
async def test_real_engine_matches_transformers(model_dir, reference):
    # The Triton attention backend and PyTorch sampler: what scripts/stage.sh sglang packs.
    options = dict(attention_backend="triton", sampling_backend="pytorch", grammar_backend="none")
    engine = await asyncio.to_thread(
        SglangEngine.load, _config(model_dir, mode="engine", mem_fraction_static=0.3, **options)
    )
    try:
        ids = reference.tokenizer("The capital of France is")["input_ids"]
        row = (await engine_rows(engine, [ids]))[0]
        np.testing.assert_allclose(row, reference.logprobs(ids)[-1], atol=0.05)
        scores = await engine.prompt_logprobs(ids, 2)
        expected = reference.logprobs(ids)[np.arange(len(ids) - 1), ids[1:]]
        np.testing.assert_allclose(scores.token_logprobs, expected, atol=0.05)
        steps = [s async for s in engine.generate(ids, SamplingParams(max_tokens=4, temperature=0.0))]
        got, want = [s.token_id for s in steps], reference.greedy(ids, 4)
        # Random weights have near ties, which bfloat16 breaks its own way: where SGLang's greedy
        # token differs, the reference must rate both alike (and the texts part there).
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), len(got))
        assert len(got) == 4 and got[:at] == want[:at]
        if at < len(got):
            row = reference.logprobs(ids + want[:at])[-1]
            assert row[want[at]] - row[got[at]] <= 0.05
    finally:
        await engine.aclose()
