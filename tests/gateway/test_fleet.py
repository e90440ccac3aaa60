"""A fleet on this machine (`logprob-gateway fleet`): two replicas of the real default model behind
the real SGLang model gateway (SMG), unchanged, sharing a real Redis. Through the router:
generation on OpenAI's routes and SGLang's `/generate` as one replica alone gives it, prompt
scores, dense rows bit for bit as a replica's own `/v1/next_token_logprobs`, an adapter's output
on every route, tokenize, the client library unchanged, routing keys that keep a job on one
replica and spread jobs, a row computed on one replica read from Redis by the other; a replica
killed under load is started again and taken back."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import numpy as np
import openai
import pytest

from bench.launcher import start_fleet
from gateway.fleet import free_port
from logprob_gateway_client import AsyncGatewayLM
from tests.conftest import MODEL, PROMPTS, dense_rows

pytestmark = pytest.mark.slow
START_S = 300.0
KEY = "x-smg-routing-key"


@pytest.fixture(scope="module")
def fleet(model_dir, lora_adapters, redis_server, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fleet")
    config = workdir / "gateway.toml"
    config.write_text(
        f'[[models]]\nname = "{MODEL}"\nmodel = "{model_dir}"\ndtype = "float32"\n'
        f'adapters = {{a = "{lora_adapters[1]["a"]}"}}\n\n[cache]\nredis_url = "{redis_server.url}"\n'
    )
    fleet = start_fleet(["--config", str(config)], workdir / "fleet.log", replicas=2, timeout=START_S)
    yield fleet
    fleet.stop()


def _served_rows(fleet) -> list[float]:
    """Dense rows each replica has served, in `fleet.workers()` order."""
    import re

    pattern = r"logprob_gateway_dense_rows_total\{[^}]*\} ([0-9.e+]+)"
    return [sum(map(float, re.findall(pattern, httpx.get(url + "/metrics").text))) for url in fleet.workers()]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    answer = httpx.post(url + path, json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer


def test_generation_through_the_router_is_one_replicas(fleet):
    replica = fleet.workers()[0]
    completion = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "logprobs": 2}
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    structured = {
        **chat,
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "c",
                "schema": {
                    "type": "object",
                    "properties": {"colour": {"type": "string"}},
                    "required": ["colour"],
                },
            },
        },
    }
    tool = {
        "type": "function",
        "function": {
            "name": "paint",
            "parameters": {
                "type": "object",
                "properties": {"colour": {"type": "string"}},
                "required": ["colour"],
            },
        },
    }
    forced = {
        **chat,
        "max_tokens": 24,
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "paint"}},
    }
    native = {
        "text": PROMPTS[1],
        "sampling_params": {"max_new_tokens": 12, "temperature": 0},
        "return_logprob": True,
    }
    routed, alone = (
        _post(fleet.base_url, "/v1/completions", completion).json(),
        _post(replica, "/v1/completions", completion).json(),
    )
    assert routed["choices"][0]["text"] == alone["choices"][0]["text"]
    # a replica's prefix cache may have computed the prompt in another batch: the same numbers, to rounding
    np.testing.assert_allclose(
        routed["choices"][0]["logprobs"]["token_logprobs"],
        alone["choices"][0]["logprobs"]["token_logprobs"],
        atol=1e-4,
    )
    for path, body, part in (
        ("/v1/chat/completions", chat, lambda a: a["choices"][0]["message"]),
        ("/v1/chat/completions", structured, lambda a: a["choices"][0]["message"]),
        (
            "/v1/chat/completions",
            forced,
            lambda a: [c["function"] for c in a["choices"][0]["message"]["tool_calls"]],
        ),
        ("/generate", native, lambda a: (a["text"], a["output_ids"])),
    ):
        routed, alone = _post(fleet.base_url, path, body).json(), _post(replica, path, body).json()
        assert part(routed) == part(alone), path
    streamed = httpx.post(
        fleet.base_url + "/v1/completions", json={**completion, "stream": True}, timeout=120
    )
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")


def _routed_rows(url: str, rows: list[list[int]], headers: dict | None = None) -> tuple[np.ndarray, int]:
    """Rows through `/generate` (the router forwards it), as MessagePack: the matrix and its cache hits."""
    body = {"model": MODEL, "input_ids": rows, "next_token_logprobs": {"layout": "matrix", "msgpack": True}}
    answer = httpx.post(url + "/generate", json=body, headers=headers, timeout=120)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("application/msgpack")
    document = msgspec.msgpack.decode(answer.content)
    matrix = np.frombuffer(document["logprobs"], "<f4").reshape(len(rows), -1)
    return matrix, document["usage"]["cache_hits"]


def test_a_routing_key_keeps_a_jobs_calls_on_one_replica_and_keys_spread(fleet):
    """The fleet's default: a key's calls all go where its first went; a new key goes to the
    replica with the fewest keys at work, so two jobs at once run on the two replicas. Key b
    then asks what key a's replica computed: the other replica reads it from the shared Redis,
    bit for bit."""

    def job(key: str, rows: int) -> None:
        for step in range(3):
            batch = [[11, 12, 13, int(key == "job-a"), step, row] for row in range(rows)]
            assert _routed_rows(fleet.base_url, batch, {KEY: key})[1] == 0

    before = _served_rows(fleet)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(job, "job-a", 64)  # long calls: job-a is at work when job-b comes
        time.sleep(0.2)
        second = pool.submit(job, "job-b", 1)
        first.result(), second.result()
    served = sorted(after - was for after, was in zip(_served_rows(fleet), before, strict=True))
    assert served == [3, 3 * 64], served  # each job on one replica, the two on two
    computed, _ = _routed_rows(fleet.base_url, [[21, 22, 23]], {KEY: "job-a"})
    assert _routed_rows(fleet.base_url, [[21, 22, 23]], {KEY: "job-a"})[1] == 1  # waits for the store
    read, hits = _routed_rows(fleet.base_url, [[21, 22, 23]], {KEY: "job-b"})
    assert hits == 1 and read.tobytes() == computed.tobytes()


def test_dense_rows_through_the_router_are_a_replicas_bit_for_bit(fleet, reference):
    rows = [[17, *reference.tokenizer(p).input_ids] for p in PROMPTS]  # rows no other test asks
    routed, hits = _routed_rows(fleet.base_url, rows)
    assert hits == 0  # computed for this call
    for url in fleet.workers():  # one replica computed them, the other reads them from Redis
        replica, _ = dense_rows(url, rows)
        assert routed.tobytes() == replica.tobytes()
    for row, ids in zip(routed, rows, strict=True):
        assert np.max(np.abs(row - reference.logprobs(ids)[-1])) <= 1e-4


def test_openai_clients_reach_an_adapter_through_the_router_by_lora_path(fleet):
    """SMG routes by base model name and refuses `base:adapter`; SGLang's `lora_path` field,
    which it forwards, reaches the adapter on OpenAI's routes."""
    routed = openai.OpenAI(base_url=fleet.base_url + "/v1", api_key="none", max_retries=0)
    alone = openai.OpenAI(base_url=fleet.workers()[0] + "/v1", api_key="none", max_retries=0)
    ask = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "logprobs": 1}
    through = routed.completions.create(model=MODEL, extra_body={"lora_path": "a"}, **ask).choices[0]
    adapter = alone.completions.create(model=f"{MODEL}:a", **ask).choices[0]
    plain = alone.completions.create(model=MODEL, **ask).choices[0]
    assert through.text == adapter.text
    np.testing.assert_allclose(through.logprobs.token_logprobs, adapter.logprobs.token_logprobs, atol=1e-4)
    assert not np.allclose(through.logprobs.token_logprobs, plain.logprobs.token_logprobs, atol=1e-3)
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}
    through_chat = routed.chat.completions.create(model=MODEL, extra_body={"lora_path": "a"}, **chat)
    adapter_chat = alone.chat.completions.create(model=f"{MODEL}:a", **chat)
    assert through_chat.choices[0].message.content == adapter_chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        routed.completions.create(model=f"{MODEL}:a", **ask)


def test_prompt_scores_and_tokenize_through_the_router_are_a_replicas(fleet):
    replica = fleet.workers()[1]
    echo = {
        "model": MODEL,
        "prompt": PROMPTS[2],
        "max_tokens": 1,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
    }
    scored = {
        "text": PROMPTS[2],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    for path, body, scores in (
        ("/v1/completions", echo, lambda a: a["choices"][0]["logprobs"]["token_logprobs"][1:]),
        ("/generate", scored, lambda a: [t[0] for t in a["meta_info"]["input_token_logprobs"][1:]]),
    ):
        routed, alone = _post(fleet.base_url, path, body).json(), _post(replica, path, body).json()
        assert len(scores(routed)) > 3
        np.testing.assert_allclose(scores(routed), scores(alone), atol=1e-4)
    for prompt in PROMPTS:
        tokens = _post(replica, "/v1/tokenize", {"model": MODEL, "prompt": prompt}).json()["tokens"]
        routed = _post(fleet.base_url, "/v1/tokenize", {"model": MODEL, "prompt": prompt}).json()
        assert routed["tokens"] == tokens and routed["count"] == len(tokens)
        text = _post(replica, "/v1/detokenize", {"model": MODEL, "tokens": tokens}).json()["prompt"]
        assert (
            _post(fleet.base_url, "/v1/detokenize", {"model": MODEL, "tokens": tokens}).json()["text"] == text
        )


def test_an_adapters_rows_through_the_router_are_its_own(fleet):
    rows = [[504, 3575, 282, 4649, 314]]
    base = {
        "model": MODEL,
        "input_ids": rows,
        "next_token_logprobs": {"layout": "matrix", "encoding_format": "base64"},
    }
    routed = _post(fleet.base_url, "/generate", {**base, "lora_path": "a"}).json()["logprobs"]
    replica = _post(
        fleet.workers()[0],
        "/v1/next_token_logprobs",
        {"model": f"{MODEL}:a", "input": rows, "layout": "matrix", "encoding_format": "base64"},
    ).json()["logprobs"]
    plain = _post(fleet.base_url, "/generate", base).json()["logprobs"]
    routed, replica, plain = (np.frombuffer(base64.b64decode(m), "<f4") for m in (routed, replica, plain))
    # either replica may have computed it, each batching its prompt its own way: equal to rounding
    assert np.max(np.abs(routed - replica)) <= 1e-4 and np.max(np.abs(routed - plain)) > 0.1


def test_the_client_library_reaches_dense_rows_through_the_router(fleet, reference):
    """Its first call goes through the router, which places it by the instance's routing key;
    later calls go straight to that replica, and back through the router when it is gone."""
    prompts = [reference.tokenizer(p).input_ids for p in PROMPTS]

    async def rows() -> np.ndarray:
        lm = AsyncGatewayLM(fleet.base_url, MODEL)
        try:
            first = await lm.batch_next_token_logprobs(prompts[:1])
            assert lm.routed and lm.replica_url in fleet.workers()
            placed, sent = lm.replica_url, lm.requests_sent
            rest = await lm.batch_next_token_logprobs(prompts[1:])
            assert lm.replica_url == placed and lm.requests_sent == sent + 1
            lm.replica_url = f"http://127.0.0.1:{free_port()}"  # a replica gone
            again = await lm.batch_next_token_logprobs([prompts[0] + [13]])
            assert lm.replica_url == placed  # the key's replica, as the router placed it again
            return np.concatenate([np.asarray(first), np.asarray(rest), np.asarray(again)])
        finally:
            await lm.aclose()

    before = _served_rows(fleet)
    found = asyncio.run(rows())
    served = [after - was for after, was in zip(_served_rows(fleet), before, strict=True)]
    assert sorted(served) == [0, len(PROMPTS) + 1]  # the instance's routing key: one replica
    for row, ids in zip(found, [*prompts, prompts[0] + [13]], strict=True):
        assert np.max(np.abs(row - reference.logprobs(ids)[-1])) <= 1e-4


def test_a_replica_killed_under_load_is_started_again_and_taken_back(fleet):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 4, "temperature": 0}
    url = fleet.workers()[0]
    victim = fleet.replica_pid(url)
    statuses: list[int] = []
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    while time.monotonic() - killed < 20:
        statuses.append(httpx.post(fleet.base_url + "/v1/completions", json=body, timeout=30).status_code)
    assert statuses.count(200) >= len(statuses) - 2, statuses  # at most the requests on the victim fail
    deadline = time.monotonic() + START_S
    while fleet.replica_pid(url) in (None, victim) or not fleet.ready(2):
        assert time.monotonic() < deadline, fleet.log_path.read_text()[-3000:]
        time.sleep(0.5)
    assert "starting it again in 1 s" in fleet.log_path.read_text()
    answers = [
        httpx.post(fleet.base_url + "/v1/completions", json=body, timeout=60).status_code for _ in range(6)
    ]
    assert answers == [200] * 6


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": True}, "stream"),
        ({"return_logprob": True}, "return_logprob"),
        ({"sampling_params": {"max_new_tokens": 3}}, "sampling_params"),
        ({"sampling_params": {"max_new_tokens": 0, "temperature": 0.5}}, "sampling_params"),
        ({"input_ids": None}, "input_ids"),
        ({"lora_path": ["a", "b"]}, "lora_path"),
    ],
)
def test_dense_rows_on_generate_refuse_what_would_generate(extra, param):
    from tests.conftest import mock_app_client

    body = {"model": "mock", "input_ids": [[1, 2, 3]], "next_token_logprobs": {}, **extra}
    with mock_app_client() as (_, client):
        answer = client.post("/generate", json=body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
        rows = client.post(
            "/generate",
            json={"input_ids": [[1, 2, 3]], "model": "unknown", "next_token_logprobs": {"layout": "matrix"}},
        )
        direct = client.post(
            "/v1/next_token_logprobs", json={"model": "mock", "input": [[1, 2, 3]], "layout": "matrix"}
        )
        assert rows.json()["logprobs"] == direct.json()["logprobs"]
