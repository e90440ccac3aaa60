"""The weight-sync endpoints at the gateway layer, on the mock engine in this process: who may
call them, bad requests, engines that cannot, and pausing. The real engine and a real trainer
process: test_weight_sync.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np
import pytest
from litestar.testing import TestClient

from gateway.app import serving_app
from gateway.settings import ModelSettings, Settings

ADMIN = {"Authorization": "Bearer admin-secret"}
INIT = {
    "master_address": "127.0.0.1",
    "master_port": 29500,
    "rank_offset": 1,
    "world_size": 2,
    "group_name": "g",
}
UPDATE = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2, 3]], "group_name": "g", "flush_cache": False}
MUTATING = [
    ("/init_weights_update_group", {**INIT, "group_name": "h"}),
    ("/update_weights_from_distributed", UPDATE),
    ("/destroy_weights_update_group", {"group_name": "g"}),
    ("/pause_generation", {"mode": "abort"}),
    ("/continue_generation", {"torch_empty_cache": True}),
]


@contextmanager
def gateway(model_dir, delay_s: float = 0.0, **settings: Any) -> Iterator[tuple[Any, TestClient]]:
    """The mock engine served in this process with `settings`: the app (its state) and a client."""
    models = [ModelSettings(name="mock", model=str(model_dir), backend="mock", options={"delay_s": delay_s})]
    app, served = serving_app(Settings(models=models, **settings))
    with TestClient(served) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the mock model did not load"
            time.sleep(0.05)
        yield app, client


def row(client: TestClient, ids: list[int]) -> np.ndarray:
    answer = client.post(
        "/v1/next_token_logprobs",
        json={"model": "mock", "input": [ids], "layout": "matrix"},
        headers={"Accept": "application/msgpack"},
    )
    assert answer.status_code == 200, answer.text
    return np.frombuffer(msgspec.msgpack.decode(answer.content)["logprobs"], "<f4").copy()


def load(client: TestClient) -> tuple[int, int]:
    """(running, waiting), as TorchRL reads /get_load."""
    (entry,) = client.get("/get_load").json()
    return entry["num_reqs"] - entry["num_waiting_reqs"], entry["num_waiting_reqs"]


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "admin-secret"}]
)
def test_without_the_admin_key_nothing_changes(model_dir, headers):
    with gateway(model_dir, admin_key="admin-secret") as (app, client):
        served = app.state.registry.models["mock"]
        assert client.post("/init_weights_update_group", json=INIT, headers=ADMIN).status_code == 200
        before = row(client, [5, 6, 7])
        for path, body in MUTATING:
            answer = client.post(path, json=body, headers=headers)
            assert answer.status_code == 401, (path, answer.text)
            assert answer.json()["error"]["type"] == "authentication_error"
        assert np.array_equal(row(client, [5, 6, 7]), before)  # not paused, same weights
        assert served.engine.weights.collective.groups == {"g": 0} and served.weights.paused is None
        assert (served.weight_version, served.weight_updates) == ("default", 0)
        assert client.get("/get_load").status_code == 200  # reads only: no admin key
        answer = client.post("/update_weights_from_distributed", json=UPDATE, headers=ADMIN)
        assert answer.status_code == 200 and answer.json()["success"] is True
        assert not np.array_equal(row(client, [5, 6, 7]), before)
        assert (served.weight_version, served.weight_updates) == ("1", 1)


def test_without_an_admin_key_configured_they_are_disabled(model_dir):
    with gateway(model_dir) as (app, client):
        for path, body in MUTATING:
            answer = client.post(path, json=body)
            assert answer.status_code == 403 and answer.json()["error"]["type"] == "permission_error", path
        assert app.state.registry.models["mock"].engine.weights.collective.groups == {}


def test_a_trusted_gateway_takes_a_trainers_keyless_calls(model_dir):
    """TorchRL's sequence, without a key: the gateway is dedicated to one trainer."""
    with gateway(model_dir, admin_key="admin-secret", trusted_weight_sync=True) as (app, client):
        before = row(client, [5, 6, 7])
        assert client.post("/init_weights_update_group", json=INIT).json()["success"] is True
        assert client.post("/pause_generation", json={"mode": "retract"}).json() == {
            "message": "Generation paused successfully.",
            "status": "ok",
        }
        assert load(client) == (0, 0)
        answer = client.post("/update_weights_from_distributed", json={**UPDATE, "weight_version": "step-7"})
        assert answer.json() == {
            "success": True,
            "message": "Succeeded to update parameter online. Weight version updated to step-7.",
            "error": None,
        }
        assert client.post("/continue_generation", json={"torch_empty_cache": True}).status_code == 200
        assert not np.array_equal(row(client, [5, 6, 7]), before)
        assert client.get("/get_model_info").json()["weight_version"] == "step-7"
        assert (
            client.post("/destroy_weights_update_group", json={"group_name": "g"}).json()["success"] is True
        )
        answer = client.post("/update_weights_from_distributed", json=UPDATE)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "group_name"


BAD = [
    ("/init_weights_update_group", {**INIT, "master_port": "x"}, "master_port"),
    ("/init_weights_update_group", {**INIT, "master_port": 0}, "master_port"),
    ("/init_weights_update_group", {**INIT, "master_port": 65536}, "master_port"),
    ("/init_weights_update_group", {**INIT, "rank_offset": -1}, "rank_offset"),
    ("/init_weights_update_group", {**INIT, "rank_offset": 0}, "rank_offset"),
    ("/init_weights_update_group", {**INIT, "rank_offset": 2}, "rank_offset"),
    ("/init_weights_update_group", {**INIT, "world_size": 1}, "world_size"),
    ("/init_weights_update_group", {**INIT, "master_address": ""}, "master_address"),
    ("/init_weights_update_group", {**INIT, "master_address": "a/b"}, "master_address"),
    ("/init_weights_update_group", {**INIT, "group_name": ""}, "group_name"),
    ("/init_weights_update_group", {**INIT, "backend": "mpi"}, "backend"),
    ("/init_weights_update_group", {key: v for key, v in INIT.items() if key != "world_size"}, None),
    ("/update_weights_from_distributed", {**UPDATE, "dtypes": ["float32", "float32"]}, "dtypes"),
    ("/update_weights_from_distributed", {**UPDATE, "shapes": []}, "shapes"),
    ("/update_weights_from_distributed", {**UPDATE, "names": []}, "names"),
    ("/update_weights_from_distributed", {**UPDATE, "dtypes": ["float8"]}, "dtypes"),
    ("/update_weights_from_distributed", {**UPDATE, "dtypes": ["torch.float32"]}, "dtypes"),
    ("/update_weights_from_distributed", {**UPDATE, "shapes": [[2, -3]]}, "shapes"),
    ("/update_weights_from_distributed", {**UPDATE, "shapes": [2, 3]}, "shapes"),
    ("/update_weights_from_distributed", {**UPDATE, "names": "w"}, "names"),
    ("/update_weights_from_distributed", {**UPDATE, "load_format": "flattened_bucket"}, "load_format"),
    ("/update_weights_from_distributed", {**UPDATE, "abort_all_requests": True}, "abort_all_requests"),
    ("/update_weights_from_distributed", {**UPDATE, "group_name": "nope"}, "group_name"),
    ("/destroy_weights_update_group", {"group_name": "nope"}, "group_name"),
    ("/init_weights_update_group", INIT, "group_name"),  # the name is taken
    ("/pause_generation", {"mode": "stop"}, "mode"),
    ("/continue_generation", {"torch_empty_cache": "yes"}, "torch_empty_cache"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), BAD, ids=[f"{p}:{param}:{i}" for i, (p, _, param) in enumerate(BAD)]
)
def test_bad_requests_are_400s_in_the_error_format_and_change_nothing(model_dir, path, body, param):
    with gateway(model_dir, trusted_weight_sync=True) as (app, client):
        served = app.state.registry.models["mock"]
        assert client.post("/init_weights_update_group", json=INIT).status_code == 200
        answer = client.post(path, json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error", error
        assert error["param"] == param or error["param"].startswith(f"{param}["), error
        assert served.engine.weights.collective.groups == {"g": 0} and served.weights.paused is None
        assert served.weight_updates == 0


@pytest.mark.parametrize("body", [b"", b"{", b"[]", b'"mode"', b"\xff"])
def test_bodies_that_are_no_request_are_400s(model_dir, body):
    with gateway(model_dir, trusted_weight_sync=True) as (_, client):
        for path, _ in MUTATING:
            answer = client.post(path, content=body, headers={"Content-Type": "application/json"})
            assert answer.status_code == 400 and "error" in answer.json(), (path, answer.text)


def test_an_unknown_model_is_a_404(model_dir):
    with gateway(model_dir, trusted_weight_sync=True) as (_, client):
        answer = client.post("/init_weights_update_group", json={**INIT, "model": "nope"})
        assert answer.status_code == 404 and answer.json()["success"] is False


def test_an_engine_without_collectives_answers_501(model_dir, monkeypatch):
    """What vLLM and MLX engines have (tests/backends/test_weight_sync.py checks that): no collective."""
    with gateway(model_dir, trusted_weight_sync=True) as (app, client):
        engine = app.state.registry.models["mock"].engine
        monkeypatch.setattr(engine.weights, "collective", None)
        for path, body in MUTATING[:3]:
            answer = client.post(path, json=body)
            assert answer.status_code == 501, answer.text
            assert answer.json()["success"] is False
            assert answer.json()["error"]["code"] == "not_supported"
            assert "cannot receive weights over a collective" in answer.json()["message"]


def test_paused_new_requests_wait_and_an_abort_ends_generation_cleanly(model_dir):
    with gateway(model_dir, delay_s=0.05, trusted_weight_sync=True) as (app, client):
        results: dict[str, Any] = {}

        def generate(name: str) -> None:
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 200, "temperature": 0}}
            results[name] = client.post("/generate", json=body).json()

        first = threading.Thread(target=generate, args=("in flight",))
        first.start()
        deadline = time.monotonic() + 30
        while load(client) != (1, 0):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert client.post("/pause_generation", json={"mode": "abort"}).status_code == 200
        assert load(client) == (0, 0)  # answered once what was in flight has ended
        first.join(timeout=30)
        meta = results["in flight"]["meta_info"]
        assert meta["finish_reason"] == {
            "type": "abort",
            "message": "Aborted by /pause_generation",
            "status_code": None,
            "err_type": None,
        }
        assert 0 < meta["completion_tokens"] < 200
        late = threading.Thread(target=lambda: results.update(rows=row(client, [5, 6, 7])))
        late.start()
        time.sleep(0.3)
        assert late.is_alive() and load(client) == (0, 1)  # a dense request waits at the door
        assert client.post("/continue_generation", json={}).status_code == 200
        late.join(timeout=30)
        assert np.array_equal(results["rows"], app.state.registry.models["mock"].engine.logits([5, 6, 7]))


@pytest.mark.parametrize("held", [True, False])
def test_a_retract_answers_once_streams_are_held_or_at_once_where_none_are(model_dir, held):
    """Held at its next step, a stream no longer runs, and the pause answers then: a trainer's first
    /get_load finds nothing running. An engine whose streams run ahead (vLLM, SGLang) holds none:
    the pause answers at once, and /get_load counts the stream until it ends."""
    with gateway(model_dir, delay_s=0.05, trusted_weight_sync=True) as (app, client):
        app.state.registry.models["mock"].weights.hold_at_steps = held
        results: dict[str, Any] = {}

        def generate() -> None:
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 40, "temperature": 0}}
            results["meta"] = client.post("/generate", json=body).json()["meta_info"]

        stream = threading.Thread(target=generate)
        stream.start()
        deadline = time.monotonic() + 30
        while load(client) != (1, 0):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        try:
            assert client.post("/pause_generation", json={"mode": "retract"}).status_code == 200
            assert load(client) == ((0, 1) if held else (1, 0))  # (running, waiting)
        finally:
            assert client.post("/continue_generation", json={}).status_code == 200
        stream.join(timeout=30)
        assert results["meta"]["finish_reason"]["type"] == "length"
        assert results["meta"]["completion_tokens"] == 40


def test_a_dense_request_in_flight_is_not_held_and_an_update_waits_for_it(model_dir):
    """Paused or not, one dense answer comes from one set of weights; a pause answers once it is
    done."""
    with gateway(model_dir, delay_s=0.5, trusted_weight_sync=True) as (app, client):
        engine = app.state.registry.models["mock"].engine
        old_row = engine.logits([5, 6, 7])
        assert client.post("/init_weights_update_group", json=INIT).status_code == 200
        finished: dict[str, float] = {}
        results: dict[str, np.ndarray] = {}

        def ask() -> None:
            results["in flight"] = row(client, [5, 6, 7])
            finished["in flight"] = time.monotonic()

        in_flight = threading.Thread(target=ask)
        in_flight.start()
        time.sleep(0.2)  # in the engine
        asked = time.monotonic()
        assert client.post("/pause_generation", json={"mode": "retract"}).status_code == 200
        # the dense request ran on, and the pause answered once it was done (0.3 s on)
        assert time.monotonic() - asked > 0.2 and load(client) == (0, 0)
        answer = client.post("/update_weights_from_distributed", json=UPDATE)
        finished["update"] = time.monotonic()
        assert answer.status_code == 200, answer.text
        in_flight.join(timeout=30)
        assert np.array_equal(results["in flight"], old_row) and finished["in flight"] <= finished["update"]
        assert client.post("/continue_generation", json={}).status_code == 200
        assert not np.array_equal(row(client, [5, 6, 7]), old_row)
