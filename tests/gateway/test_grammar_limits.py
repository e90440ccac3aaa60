"""No grammar can kill the gateway, hold its event loop, or take more than its timeout of CPU:
compiles run in worker processes that are killed when they overrun or die (a 400 either way),
on a real gateway process (the mock engine: the grammar path is the same for every engine)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import uuid

import httpx
import jsonschema
import psutil
import pytest

from bench.launcher import start_mock_gateway
from tests.conftest import MODEL
from tests.gateway.grammar_families import (
    family,
    gbnf_chain,
    grammar_request,
    lark_chain,
    ref_chain,
    schema_request,
)

TIMEOUT_S = 1.0  # the gateway's grammar_compile_timeout_s here
# an answer's bound beyond the timeout: a worker's start after a crash (~1 s on 2 busy cores),
# converting and building the compiled grammar here
SLACK_S = 3.0
HEALTH_WITHIN_S = 0.3  # /health while hostile grammars compile (30 ms on an idle machine)


@pytest.fixture(scope="module")
def mock_gateway(tmp_path_factory):
    settings = f"[limits]\ngrammar_compile_timeout_s = {TIMEOUT_S}\n"
    gateway = start_mock_gateway(tmp_path_factory.mktemp("grammar-limits"), settings, slow_delay_s=0.0)
    yield gateway
    gateway.stop()


def complete(gateway, fields, *, timeout=60.0, **extra) -> tuple[httpx.Response, float]:
    """POST /v1/completions with grammar `fields` (response_format and structured_outputs are read
    there as on /v1/chat/completions, by the same code); the answer and how long it took."""
    body = {"model": "mock", "prompt": "hi", "max_tokens": 4, **fields, **extra}
    started = time.monotonic()
    answer = httpx.post(gateway.base_url + "/v1/completions", json=body, timeout=timeout)
    return answer, time.monotonic() - started


def assert_refused(answer: httpx.Response, *words: str) -> str:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"], error
    for word in words:
        assert word in error["message"], error
    return error["message"]


def assert_alive(gateway) -> None:
    assert gateway.process.poll() is None, gateway.log_tail()
    assert httpx.get(gateway.base_url + "/health", timeout=5).status_code == 200


def cpu_seconds(pid: int) -> float:
    """CPU time of the gateway and every process under it, the dead ones it waited for included."""
    process = psutil.Process(pid)
    total = sum(process.cpu_times()[:4])
    for child in process.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


class HealthProbe:
    """/health asked every 50 ms on a thread of its own; the slowest answer is `worst`."""

    def __init__(self, gateway) -> None:
        self._url = gateway.base_url + "/health"
        self._stop = threading.Event()
        self.latencies: list[float] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while True:
                started = time.monotonic()
                assert client.get(self._url).status_code == 200
                self.latencies.append(time.monotonic() - started)
                if self._stop.wait(0.05):
                    return

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def worst(self) -> float:
        return max(self.latencies)


@pytest.mark.parametrize(
    ("fields", "param", "why"),
    [
        (schema_request(ref_chain(1000)), "response_format", "crashed"),  # ~110 KB: SIGSEGV in llguidance
        (grammar_request(lark_chain(3000)), "structured_outputs", "crashed"),
        # its conversion to Lark takes about the timeout here, so either answer may come first,
        # and the gateway must outlive the compile's end (a timed-out compile used to run on)
        (grammar_request(gbnf_chain(4000)), "structured_outputs", "crashed|did not compile"),
    ],
    ids=["ref-chain-1000", "lark-3000-rules", "gbnf-4000-rules"],
)
def test_a_grammar_that_crashes_the_grammar_engine_is_a_400(mock_gateway, fields, param, why):
    answer, took = complete(mock_gateway, fields)
    message = assert_refused(answer)
    assert re.search(why, message) and message.startswith(param), message
    assert answer.json()["error"]["param"].startswith(param)
    assert took < TIMEOUT_S + SLACK_S
    if "did not compile" in message:
        time.sleep(3.0)  # where a compile left running would have crashed the gateway by now
    assert_alive(mock_gateway)


def test_a_crashing_grammar_is_refused_on_generate_too(mock_gateway):
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "ebnf": lark_chain(3000, tag="generate")}}
    answer = httpx.post(mock_gateway.base_url + "/generate", json=body, timeout=60)
    assert_refused(answer, "crashed")
    assert answer.json()["error"]["param"] == "sampling_params.ebnf"
    assert_alive(mock_gateway)


def test_choices_beyond_the_grammar_engine_row_limit_are_refused_before_streaming(mock_gateway):
    # counted before any compile: 5,000 refused as 50,000 are; a Lark grammar of as many
    # alternatives is refused by the grammar engine's own limit (tests/backends/test_grammar.py)
    fields = {"structured_outputs": {"choice": [f"option {i}" for i in range(5000)]}}
    answer, _ = complete(mock_gateway, fields, stream=True)
    assert_refused(answer, "at most 2000")  # a 400 before any event, not an error mid-stream
    assert "option 1" not in mock_gateway.log_tail(200)  # the request's text never reaches the log


def test_a_checked_grammar_generates_under_it(mock_gateway):
    # the mock's tokens are random: a grammar of one word shows they were held to it
    word = f"w{uuid.uuid4().hex[:8]}"
    answer, _ = complete(mock_gateway, {"structured_outputs": {"regex": word}}, max_tokens=32)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == word


@pytest.mark.parametrize(("name", "fields"), family(), ids=[name for name, _ in family()])
def test_deep_and_wide_grammars_answer_within_their_bound(mock_gateway, name, fields):
    with HealthProbe(mock_gateway) as health:
        answer, took = complete(mock_gateway, fields)
    if answer.status_code != 200:
        assert_refused(answer)
    assert took < TIMEOUT_S + SLACK_S, (name, took)
    assert health.worst < HEALTH_WITHIN_S, (name, health.worst)
    assert_alive(mock_gateway)


def test_hostile_compiles_cost_no_more_than_their_timeout(mock_gateway):
    """Eight distinct large GBNF grammars at once, each past the timeout (their conversion to
    Lark alone takes ~2 s): each answers a 400, /health stays quick, an ordinary grammar from
    another client compiles meanwhile, and no CPU is spent on them once answered."""
    warm, _ = complete(mock_gateway, {"structured_outputs": {"regex": "(warm|up)"}})  # workers started
    assert warm.status_code == 200, warm.text
    hostile = [grammar_request(gbnf_chain(2000, tag=f"{uuid.uuid4().hex[:6]}")) for _ in range(8)]
    answers: list[tuple[httpx.Response, float]] = []
    threads = [
        threading.Thread(target=lambda f=f: answers.append(complete(mock_gateway, f))) for f in hostile
    ]
    with HealthProbe(mock_gateway) as health:
        for thread in threads:
            thread.start()
        time.sleep(0.3)  # the hostile ones are compiling
        ordinary, ordinary_took = complete(
            mock_gateway, {"structured_outputs": {"regex": f"(yes|no){uuid.uuid4().hex[:6]}"}}
        )
        for thread in threads:
            thread.join()
    last_answer = time.monotonic()
    cpu_after = cpu_seconds(mock_gateway.process.pid)
    time.sleep(2.0)
    spent = cpu_seconds(mock_gateway.process.pid) - cpu_after
    assert ordinary.status_code == 200, ordinary.text
    assert ordinary_took < TIMEOUT_S + SLACK_S
    for answer, _ in answers:
        assert_refused(answer, f"did not compile within {TIMEOUT_S:g} s")
    # two workers, eight grammars: four rounds of one timeout each, and a worker's restart
    assert max(took for _, took in answers) < 4 * (TIMEOUT_S + SLACK_S)
    assert health.worst < HEALTH_WITHIN_S, health.worst
    assert spent < 0.5, spent  # measured over 2 s after the last answer at time.monotonic() = last_answer
    print(
        f"ordinary grammar {ordinary_took:.2f} s; hostile answers {sorted(round(t, 2) for _, t in answers)}; "
        f"/health worst {health.worst * 1000:.0f} ms; CPU after the last answer {spent:.2f} s ({last_answer:.0f})"
    )
    assert_alive(mock_gateway)


def test_more_grammars_than_the_queue_holds_are_told_to_retry(mock_gateway):
    hostile = [grammar_request(gbnf_chain(2000, tag=f"{uuid.uuid4().hex[:6]}")) for _ in range(14)]
    answers: list[httpx.Response] = []
    threads = [
        threading.Thread(target=lambda f=f: answers.append(complete(mock_gateway, f)[0])) for f in hostile
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    statuses = sorted(answer.status_code for answer in answers)
    assert statuses.count(429) >= 4 and set(statuses) <= {400, 429}, statuses  # 2 workers + 8 waiting
    busy = next(answer for answer in answers if answer.status_code == 429)
    assert busy.json()["error"]["type"] == "rate_limit_error" and "Retry-After" in busy.headers
    assert_alive(mock_gateway)


def test_compile_workers_end_with_the_gateway(tmp_path):
    gateway = start_mock_gateway(tmp_path, "", slow_delay_s=0.0)
    try:
        with HealthProbe(gateway) as health:
            answer, first_took = complete(gateway, {"structured_outputs": {"regex": "(yes|no)"}})
        assert answer.status_code == 200, answer.text
        assert first_took < 10.0 and health.worst < HEALTH_WITHIN_S, (first_took, health.worst)
        print(
            f"first grammar {first_took:.2f} s (a worker's start); /health worst {health.worst * 1000:.0f} ms"
        )
        workers = psutil.Process(gateway.process.pid).children(recursive=True)
        assert workers and all("backends.grammar.worker" in " ".join(w.cmdline()) for w in workers)
        os.kill(gateway.process.pid, signal.SIGKILL)  # no shutdown at all: the workers notice
        gateway.process.wait()
        gone, alive = psutil.wait_procs(workers, timeout=5)
        assert alive == [], alive
    finally:
        if gateway.process.poll() is None:
            gateway.stop()


def test_a_grammar_failing_mid_stream_is_a_grammar_error_event(monkeypatch, caplog):
    """A mask past a limit of the grammar engine at some later token (the checks take only the
    first ones) ends the stream with a 400's error event, not internal_error and a traceback."""
    import backends.grammar.constraint
    from backends.errors import GrammarError
    from tests.conftest import mock_app_client

    def fails(self):
        raise GrammarError("Parser Error: Current row has 3001 items; max is 2000")

    monkeypatch.setattr(backends.grammar.constraint.Constraint, "_allowed", fails)
    body = {
        "model": "mock",
        "prompt": "hi",
        "max_tokens": 4,
        "stream": True,
        "structured_outputs": {"regex": "(yes|no)"},
    }
    with mock_app_client() as (_, client), caplog.at_level("ERROR"):
        answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200  # the stream had begun
    error = [event["error"] for event in _events(answer.text) if "error" in event]
    assert error and error[0]["type"] == "invalid_request_error", answer.text
    assert "max is 2000" in error[0]["message"]
    assert answer.text.rstrip().endswith("data: [DONE]")
    assert not [r for r in caplog.records if r.exc_info], caplog.text  # no traceback logged


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_the_real_engine_refuses_what_crashes_and_generates_what_passed(http):
    """On the real model: the 1,000-deep `$ref` chain is a 400 and the gateway lives on, 50,000
    choices are refused before any event of their stream, and a `$ref` chain the check passed
    generates JSON that validates."""
    chain = {"model": MODEL, "prompt": "JSON:", "max_tokens": 4, **schema_request(ref_chain(1000))}
    assert_refused(http.post("/v1/completions", json=chain), "crashed")
    many = [f"option {i}" for i in range(50000)]
    choices = {"model": MODEL, "prompt": "Pick:", "stream": True, "structured_outputs": {"choice": many}}
    assert_refused(http.post("/v1/completions", json=choices), "at most 2000")
    schema = ref_chain(8, leaf={"enum": ["done"]})
    body = {"model": MODEL, "prompt": "JSON:", "max_tokens": 128, "temperature": 0, **schema_request(schema)}
    answer = http.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(answer.json()["choices"][0]["text"]), schema)
    assert http.get("/health").status_code == 200
