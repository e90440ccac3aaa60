"""A trainer's weights over a collective into a real gateway (SmolLM2 in float32 on the CPU, gloo),
from a real trainer process that uses torch.distributed and TorchRL's own code
(tests/gateway/weight_sync_trainer.py): rows follow the trainer's weights, streams in flight are
held and resumed (or aborted), and announcements that do not fit change nothing and leave no
trainer waiting. Who may call, and bad requests: test_weight_sync_access.py."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import MODEL, dense_rows, start_real_gateway

pytestmark = pytest.mark.slow
TRAINER = Path(__file__).with_name("weight_sync_trainer.py")
PREFIXES = [[504, 3575, 282, 4649, 314], [410, 2251, 30]]
PROMPT = [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 28]  # "Once upon a time, in a small village,"
TOKENS = 48  # greedy: no end of text within them


class TrainerProcess:
    """The trainer script, one JSON command and answer at a time."""

    def __init__(self, url: str, model_dir: Path, log: Path) -> None:
        self.log = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, str(TRAINER), url, str(model_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(
            target=lambda: [self.lines.put(line) for line in self.process.stdout], daemon=True
        ).start()
        assert self._answer(120) == {"ready": True}

    def _answer(self, timeout: float) -> dict[str, Any]:
        try:
            return json.loads(self.lines.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"the trainer did not answer within {timeout} s") from None

    def send(self, op: str, **arguments: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self.process.stdin.flush()

    def call(self, op: str, timeout: float = 180, **arguments: Any) -> dict[str, Any]:
        self.send(op, **arguments)
        return self._answer(timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.send("exit")
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """A gateway dedicated to one trainer: keyless weight sync, though an admin key is set."""
    workdir = tmp_path_factory.mktemp("weight-sync")
    gateway = start_real_gateway(model_dir, workdir, 'admin_key = "admin-secret"\ntrusted_weight_sync = true')
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def trainer(served, model_dir, tmp_path_factory):
    process = TrainerProcess(served.base_url, model_dir, tmp_path_factory.mktemp("trainer") / "trainer.log")
    joined = process.call("init")
    assert joined["status"] == 200 and joined["body"]["success"] is True and joined["formed"], joined
    yield process
    process.stop()


def version(base_url: str) -> str:
    return httpx.get(base_url + "/get_model_info").json()["weight_version"]


class Stream(threading.Thread):
    """A streamed request read event by event: `events` (decoded JSON), `done` once [DONE] came."""

    def __init__(self, base_url: str, path: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = base_url + path, body
        self.events: list[dict] = []
        self.done = False
        self.started = threading.Event()

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=180) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    self.events.append(json.loads(line[6:]))
                    self.started.set()
        self.started.set()


def generate_stream(base_url: str) -> Stream:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0},
        "stream": True,
    }
    return Stream(base_url, "/generate", body)


def completion_stream(base_url: str) -> Stream:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return Stream(base_url, "/v1/completions", body)


def test_rows_follow_the_trainers_weights_and_a_stream_is_held_then_resumed_on_them(
    served, trainer, reference, scaled
):
    base_url = served.base_url
    trainer.call("update", scale=1.0, mode="retract")  # the default model's weights
    before, _ = dense_rows(base_url, PREFIXES)
    for row, ids in zip(before, PREFIXES, strict=True):
        np.testing.assert_allclose(row, reference.logprobs(ids)[-1], rtol=0, atol=1e-4)
    streams = [generate_stream(base_url), completion_stream(base_url)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(60)
    update = trainer.call("update", scale=1.5, mode="retract", version="step-1")
    assert update["status"] == 200 and update["body"]["success"] is True, update
    # TorchRL saw nothing running before it sent the weights, at its first look: the pause was
    # answered once the streams were held, so TorchRL never sleeps between polls
    assert update["polled"] == [0]
    for stream in streams:
        stream.join(120)
        assert stream.done and not stream.is_alive()
    after, hits = dense_rows(base_url, PREFIXES)
    assert hits == 0  # the old rows' keys are not the new weights'
    for row, ids in zip(after, PREFIXES, strict=True):
        np.testing.assert_allclose(row, scaled.logprobs(ids)[-1], rtol=0, atol=1e-4)
    assert np.abs(after - before).max() > 0.01
    assert version(base_url) == "step-1"
    # The /generate stream: tokens of the old weights up to where it was held, then of the new.
    last = streams[0].events[-1]
    tokens = last["output_ids"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": TOKENS}
    assert streams[0].events[0]["meta_info"]["weight_version"] != "step-1"
    assert last["meta_info"]["weight_version"] == "step-1"
    old = reference.greedy(PROMPT, TOKENS)
    split = next((i for i, (a, b) in enumerate(zip(tokens, old, strict=True)) if a != b), TOKENS)
    assert 0 < split < TOKENS, "the stream was not held across the update"
    assert tokens[split:] == scaled.greedy(PROMPT + tokens[:split], TOKENS - split)
    # The OpenAI stream: held and resumed too, to its end, not broken.
    chunks = streams[1].events
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == TOKENS


def test_abort_mode_ends_a_stream_in_flight_with_finish_reason_abort(served, trainer, reference, scaled):
    base_url = served.base_url
    trainer.call("update", scale=1.5, mode="retract")
    stream = completion_stream(base_url)
    stream.start()
    assert stream.started.wait(60)
    update = trainer.call("update", scale=1.0, mode="abort")
    assert update["status"] == 200 and update["body"]["success"] is True, update
    stream.join(60)
    assert stream.done  # ended with [DONE], the connection whole
    choices = [event["choices"][0] for event in stream.events if event["choices"]]
    assert choices[-1]["finish_reason"] == "abort"
    assert stream.events[-1]["usage"]["completion_tokens"] < TOKENS
    text = "".join(choice["text"] for choice in choices)
    old = reference.tokenizer.decode(scaled.greedy(PROMPT, TOKENS))
    assert old.startswith(text)  # what it generated, on the weights it began with
    rows, _ = dense_rows(base_url, PREFIXES)
    for row, ids in zip(rows, PREFIXES, strict=True):
        np.testing.assert_allclose(row, reference.logprobs(ids)[-1], rtol=0, atol=1e-4)
    after = generate_stream(base_url)  # continued: new requests run
    after.start()
    after.join(120)
    assert after.events[-1]["output_ids"] == reference.greedy(PROMPT, TOKENS)


@pytest.mark.parametrize(
    ("corrupt", "words"),
    [
        ("name", "this model has no parameter 'model.layers.0.mlp.gate_proj.weights'"),
        ("shape", "has shape [1535, 576], this model's has [1536, 576]"),
        ("dtype", "is announced as int32, this model's is float32"),
    ],
)
def test_an_announcement_that_does_not_fit_is_received_then_refused_and_changes_nothing(
    served, trainer, corrupt, words
):
    base_url = served.base_url
    before, _ = dense_rows(base_url, PREFIXES)
    weights = version(base_url)
    update = trainer.call("update", scale=3.0, mode="retract", corrupt=corrupt, timeout=60)  # it returned
    assert update["status"] == 400 and update["body"]["success"] is False, update
    assert words in update["body"]["message"] and "received and dropped" in update["body"]["message"]
    assert update["body"]["error"]["type"] == "invalid_request_error"
    after, _ = dense_rows(base_url, PREFIXES)
    assert np.array_equal(before, after) and version(base_url) == weights


def test_an_update_over_a_group_never_joined_is_a_400(served):
    body = {
        "names": ["lm_head.weight"],
        "dtypes": ["float32"],
        "shapes": [[49152, 576]],
        "group_name": "nope",
    }
    answer = httpx.post(served.base_url + "/update_weights_from_distributed", json=body, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "group_name"
    assert "no weights update group named 'nope'" in answer.json()["message"]


def test_a_trainer_that_dies_mid_broadcast_changes_nothing(served, model_dir, tmp_path):
    base_url = served.base_url
    before, _ = dense_rows(base_url, PREFIXES)
    weights = version(base_url)
    dying = TrainerProcess(base_url, model_dir, tmp_path / "trainer.log")
    try:
        group = dying.call("init")["group"]
        dying.send("update", scale=2.0, mode="retract", die_after=100)
        assert dying.process.wait(timeout=120) == 3
    finally:
        dying.stop()
    body = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[49152, 576]], "group_name": group}
    answer = httpx.post(base_url + "/update_weights_from_distributed", json=body, timeout=120)
    assert answer.status_code == 400  # once the failed transfer is over, the group is gone
    assert f"no weights update group named '{group}'" in answer.json()["message"]
    assert httpx.post(base_url + "/continue_generation", json={}, timeout=30).status_code == 200
    after, _ = dense_rows(base_url, PREFIXES)
    assert np.array_equal(before, after) and version(base_url) == weights
