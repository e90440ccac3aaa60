"""A fleet on this machine (`logprob-gateway fleet`): two replicas of the real default model behind
the real SGLang model gateway (SMG), unchanged. Through the router: generation on OpenAI's routes
and SGLang's `/generate` as one replica alone gives it, dense rows bit for bit as a replica's own
`/v1/next_token_logprobs`, an adapter's rows, the client library unchanged; a replica killed
under load is started again and taken back."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from gateway.fleet import free_port
from logprob_gateway_client import AsyncGatewayLM
from tests.conftest import MODEL, PROMPTS, dense_rows

pytestmark = pytest.mark.slow
START_S = 300.0


class Fleet:
    def __init__(self, process: subprocess.Popen, base_url: str, log: Path) -> None:
        self.process, self.base_url, self.log = process, base_url, log

    def workers(self) -> list[str]:
        answer = httpx.get(self.base_url + "/workers", timeout=10).json()["workers"]
        return sorted(worker["url"] for worker in answer)

    def replica_pids(self) -> list[int]:
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        pids = []
        for pid in map(int, children):
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"serve" in command:
                pids.append(pid)
        return pids


def _ready(base_url: str, replicas: int) -> bool:
    try:
        workers = httpx.get(base_url + "/workers", timeout=2).json()["workers"]
        return len(workers) == replicas and httpx.get(base_url + "/readiness", timeout=2).status_code == 200
    except (httpx.HTTPError, ValueError, KeyError):
        return False


@pytest.fixture(scope="module")
def fleet(model_dir, lora_adapters, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fleet")
    config = workdir / "gateway.toml"
    config.write_text(
        f'[[models]]\nname = "{MODEL}"\nmodel = "{model_dir}"\ndtype = "float32"\n'
        f'adapters = {{a = "{lora_adapters[1]["a"]}"}}\n'
    )
    port = free_port()
    log = workdir / "fleet.log"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "fleet",
            "--replicas",
            "2",
            "--port",
            str(port),
            "--",
            "--config",
            str(config),
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    while not _ready(base_url, 2):
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    yield Fleet(process, base_url, log)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


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
        ("/generate", native, lambda a: (a["text"], a["output_ids"])),
    ):
        routed, alone = _post(fleet.base_url, path, body).json(), _post(replica, path, body).json()
        assert part(routed) == part(alone), path
    streamed = httpx.post(
        fleet.base_url + "/v1/completions", json={**completion, "stream": True}, timeout=120
    )
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")


def test_dense_rows_through_the_router_are_a_replicas_bit_for_bit(fleet, reference):
    rows = [reference.tokenizer(p).input_ids for p in PROMPTS]
    replica, _ = dense_rows(fleet.workers()[1], rows)
    body = {"model": MODEL, "input_ids": rows, "next_token_logprobs": {"layout": "matrix", "msgpack": True}}
    answer = httpx.post(fleet.base_url + "/generate", json=body, timeout=120)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("application/msgpack")
    import msgspec

    routed = np.frombuffer(msgspec.msgpack.decode(answer.content)["logprobs"], "<f4").reshape(len(rows), -1)
    assert routed.tobytes() == replica.tobytes()
    for row, ids in zip(routed, rows, strict=True):
        assert np.max(np.abs(row - reference.logprobs(ids)[-1])) <= 1e-4


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
    assert routed == replica and routed != plain


def test_the_client_library_reaches_dense_rows_through_the_router(fleet, reference):
    async def rows() -> np.ndarray:
        lm = AsyncGatewayLM(fleet.base_url, MODEL)
        try:
            found = await lm.batch_next_token_logprobs([reference.tokenizer(p).input_ids for p in PROMPTS])
            assert lm.routed
            return np.asarray(found)
        finally:
            await lm.aclose()

    found = asyncio.run(rows())
    for row, prompt in zip(found, PROMPTS, strict=True):
        assert np.max(np.abs(row - reference.logprobs(reference.tokenizer(prompt).input_ids)[-1])) <= 1e-4


def test_a_replica_killed_under_load_is_started_again_and_taken_back(fleet):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 4, "temperature": 0}
    victim = fleet.replica_pids()[0]
    statuses: list[int] = []
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    while time.monotonic() - killed < 20:
        statuses.append(httpx.post(fleet.base_url + "/v1/completions", json=body, timeout=30).status_code)
    assert statuses.count(200) >= len(statuses) - 2, statuses  # at most the requests on the victim fail
    deadline = time.monotonic() + START_S
    while victim in fleet.replica_pids() or len(fleet.replica_pids()) < 2 or not _ready(fleet.base_url, 2):
        assert time.monotonic() < deadline, fleet.log.read_text()[-3000:]
        time.sleep(0.5)
    replaced = next(pid for pid in fleet.replica_pids() if pid != victim)
    assert replaced and "starting it again" in fleet.log.read_text()
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
