"""/init_weights_update_group answers within weight_sync_timeout_s, end to end, whatever the trainer's
address does: a real gateway (SmolLM2 on the CPU, gloo) joining a port where nobody listens, and
one where something accepts connections but never speaks; meanwhile and afterwards it serves."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from bench.launcher import GatewayProcess
from tests.conftest import dense_rows, start_real_gateway

pytestmark = pytest.mark.slow
TIMEOUT_S = 3.0
PENDING_JOINS = 2
MARGIN_S = 1.5  # an HTTP round trip and a loaded machine; torch's own retries took 2 s and more


@pytest.fixture(scope="module")
def impatient(model_dir, tmp_path_factory) -> Iterator[GatewayProcess]:
    workdir = tmp_path_factory.mktemp("weight-sync-timeout")
    settings = (
        "trusted_weight_sync = true\n"
        f"weight_sync_timeout_s = {TIMEOUT_S}\n"
        f"weight_sync_max_pending_joins = {PENDING_JOINS}"
    )
    gateway = start_real_gateway(model_dir, workdir, settings)
    yield gateway
    gateway.stop()


@pytest.fixture
def closed_port() -> int:
    """A port nobody listens on (bound once, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port where the kernel accepts connections for a listener that never reads or writes."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener.getsockname()[1]


def join(base_url: str, port: int, name: str) -> tuple[httpx.Response, float]:
    body = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": name,
        "backend": "gloo",
    }
    started = time.monotonic()
    answer = httpx.post(base_url + "/init_weights_update_group", json=body, timeout=TIMEOUT_S * 20)
    return answer, time.monotonic() - started


def joined_while_serving(base_url: str, port: int, name: str) -> tuple[httpx.Response, float]:
    """The join's answer and duration, /health asked all along (each within the join's bound)."""
    result: list[tuple[httpx.Response, float]] = []
    joining = threading.Thread(target=lambda: result.append(join(base_url, port, name)))
    joining.start()
    while joining.is_alive():
        assert httpx.get(base_url + "/health", timeout=TIMEOUT_S).status_code == 200
        time.sleep(0.2)
    joining.join()
    assert result, f"no answer within {TIMEOUT_S * 20:g} s"
    return result[0]


@pytest.mark.parametrize("port", ["closed_port", "silent_port"])
def test_a_trainer_that_is_not_there_is_a_400_within_the_timeout(impatient, request, port):
    port = request.getfixturevalue(port)
    before, _ = dense_rows(impatient.base_url, [[504, 3575, 282]])
    for _ in range(2):  # a join given up on leaves its name free for the next try
        answer, took = joined_while_serving(impatient.base_url, port, f"group-{port}")
        assert answer.status_code == 400, answer.text
        assert answer.json()["success"] is False and "Failed to initialize" in answer.json()["message"]
        assert took < TIMEOUT_S + MARGIN_S, f"answered after {took:.1f} s"
    after, _ = dense_rows(impatient.base_url, [[504, 3575, 282]])
    assert (after == before).all()
    destroyed = httpx.post(
        impatient.base_url + "/destroy_weights_update_group", json={"group_name": f"group-{port}"}
    )
    assert destroyed.status_code == 400 and "does not exist" in destroyed.text


def test_joins_held_by_a_silent_peer_are_bounded_by_the_setting(impatient, silent_port):
    """Each join a silent peer holds keeps a thread and a socket until the peer closes: beyond
    `weight_sync_max_pending_joins` of them a join is refused at once."""
    deadline = time.monotonic() + 30  # joins held by earlier tests' peers end once those closed
    while True:
        first, _ = join(impatient.base_url, silent_port, "held-0")
        if "still trying" not in first.text or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert first.status_code == 400 and "Failed to initialize" in first.json()["message"], first.text
    for i in range(1, PENDING_JOINS):
        held, _ = join(impatient.base_url, silent_port, f"held-{i}")
        assert held.status_code == 400 and "Failed to initialize" in held.json()["message"], held.text
    refused, took = join(impatient.base_url, silent_port, "one-more")
    assert refused.status_code == 400 and "still trying" in refused.json()["message"], refused.text
    assert took < MARGIN_S
