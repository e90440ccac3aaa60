"""POST /update_weights_from_disk: new weights in a running gateway, with two real replicas
sharing one real Redis, and the lock that keeps requests in flight on the weights they began with."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
from litestar.testing import TestClient
from safetensors.numpy import save_file

from bench.launcher import start_gateway
from gateway.app import serving_app
from gateway.settings import Limits, ModelSettings, Settings
from tests.conftest import MODEL, dense_rows, mock_app_client

pytestmark = pytest.mark.slow
ADMIN = {"Authorization": "Bearer admin-secret"}
PREFIXES = [[504, 3575, 282, 4649, 314], [410, 2251, 30]]


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory):
    """Where the replicas may load weights from: pytest's base directory, which holds scaled_dir."""
    return tmp_path_factory.getbasetemp()


@pytest.fixture(scope="module")
def replicas(redis_server, model_dir, weights_root, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("weights")
    config = workdir / "gateway.toml"
    config.write_text(f"""
admin_key = "admin-secret"

[[models]]
name = "{MODEL}"
model = "{model_dir}"
dtype = "float32"
weights_root = "{weights_root}"

[cache]
redis_url = "{redis_server.url}"
""")
    gateways = [start_gateway(["--config", str(config)], workdir / f"replica{i}.log") for i in range(2)]
    yield gateways
    for gateway in gateways:
        gateway.stop()


def update(base_url: str, body: dict, headers=ADMIN) -> httpx.Response:
    return httpx.post(base_url + "/update_weights_from_disk", json=body, headers=headers, timeout=300)


def test_an_update_serves_the_new_weights_and_no_replica_reads_an_old_row(
    replicas, scaled_dir, reference, scaled
):
    first, second = (g.base_url for g in replicas)
    old, _ = dense_rows(first, PREFIXES)  # stored in Redis under the old weights' keys
    assert dense_rows(first, PREFIXES)[1] == len(PREFIXES)  # (asked again: once they are stored)
    assert dense_rows(second, PREFIXES)[1] == len(PREFIXES)  # the other replica reads them
    for base_url in (first, second):  # an RL loop updates every replica
        answer = update(base_url, {"model_path": str(scaled_dir), "weight_version": "step-1"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["success"] is True and "step-1" in answer.json()["message"]
    info = httpx.get(first + "/get_model_info").json()
    assert info["weight_version"] == "step-1" and info["model_path"] == str(scaled_dir)
    new, hits = dense_rows(first, PREFIXES)
    assert hits == 0
    for row, ids in zip(new, PREFIXES, strict=True):
        np.testing.assert_allclose(row, scaled.logprobs(ids)[-1], rtol=0, atol=1e-4)
    assert np.abs(new - old).max() > 0.01
    assert dense_rows(first, PREFIXES)[1] == len(PREFIXES)
    again, hits = dense_rows(second, PREFIXES)  # the new rows, shared: the replicas' keys agree
    assert hits == len(PREFIXES) and np.array_equal(again, new)
    completion = httpx.post(
        first + "/v1/completions",
        json={"model": MODEL, "prompt": PREFIXES[0], "max_tokens": 6, "temperature": 0},
        timeout=120,
    ).json()
    tokens = reference.tokenizer(completion["choices"][0]["text"], add_special_tokens=False).input_ids
    assert tokens == scaled.greedy(PREFIXES[0], 6)[: len(tokens)]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"model_path": "/nowhere/at/all"}, 400, "inside this model's weights_root"),
        ({"model_path": "{scaled_dir}", "load_format": "gguf"}, 400, "load_format"),
        ({"model_path": "{scaled_dir}", "abort_all_requests": True}, 400, "abort_all_requests"),
        ({"model_path": "{scaled_dir}", "model": "nope"}, 404, "does not exist"),
        ({"load_format": "auto"}, 400, "model_path"),
        ({"model_path": "a\u0000b"}, 400, "inside this model's weights_root"),
        ({"model_path": "{scaled_dir}/config.json"}, 400, "inside this model's weights_root"),
    ],
)
def test_bad_updates_are_refused_and_change_nothing(replicas, scaled_dir, reference, body, status, words):
    base_url = replicas[0].base_url
    before, _ = dense_rows(base_url, [[9690, 2114, 7]])
    body = {k: (v.format(scaled_dir=scaled_dir) if isinstance(v, str) else v) for k, v in body.items()}
    answer = update(base_url, body)
    assert answer.status_code == status and words in answer.text
    if status != 422 and "model_path" in body:
        assert answer.json()["success"] is False
    after, _ = dense_rows(base_url, [[9690, 2114, 7]])
    assert np.array_equal(before, after)


def test_an_update_needs_the_admin_key(replicas, model_dir):
    answer = update(replicas[0].base_url, {"model_path": str(model_dir)}, headers={})
    assert answer.status_code == 401


def test_paths_outside_the_weights_root_are_answered_as_missing_ones(
    replicas, model_dir, weights_root, tmp_path
):
    """An existing directory outside the root (a real model), the root of another process, a
    symlink in the root leading out, a directory whose weights file leads out, and a missing
    directory: one answer, word for word, and nothing changes."""
    (weights_root / "leads-out").symlink_to(model_dir, target_is_directory=True)
    half = tmp_path / "half-outside"
    half.mkdir()
    (half / "config.json").write_text((model_dir / "config.json").read_text())
    (half / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    base_url = replicas[0].base_url
    before, _ = dense_rows(base_url, [[9690, 2114, 7]])
    paths = [
        str(model_dir),
        "/proc/1/root",
        "/proc/1/root/etc",
        "leads-out",
        str(weights_root / "leads-out"),
        str(half),
        str(weights_root / "no-such-checkpoint"),
        "no-such-checkpoint",
        "/no/such/dir",
        "../" * 40 + "etc",
    ]
    answers = [update(base_url, {"model_path": path}) for path in paths]
    assert answers[0].status_code == 400, answers[0].text
    assert answers[0].json()["success"] is False and "weights_root" in answers[0].json()["message"]
    for path, answer in zip(paths, answers, strict=True):
        assert (answer.status_code, answer.content) == (answers[0].status_code, answers[0].content), path
    after, _ = dense_rows(base_url, [[9690, 2114, 7]])
    assert np.array_equal(before, after)


@pytest.mark.parametrize("junk", ["not-safetensors", "a-directory"])
def test_unreadable_weights_inside_the_root_are_the_callers_error(replicas, scaled_dir, tmp_path, junk):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    for name in ("config.json", "model.safetensors"):
        (checkpoint / name).symlink_to(scaled_dir / name)
    if junk == "a-directory":
        (checkpoint / "extra.safetensors").mkdir()
    else:
        (checkpoint / "extra.safetensors").write_bytes(b"\xff" * 64)
    base_url = replicas[0].base_url
    before, _ = dense_rows(base_url, [[9690, 2114, 7]])
    answer = update(base_url, {"model_path": str(checkpoint)})
    assert answer.status_code == 400, answer.text
    assert answer.json()["success"] is False and "extra.safetensors" in answer.json()["message"]
    assert np.array_equal(before, dense_rows(base_url, [[9690, 2114, 7]])[0])


def test_without_a_weights_root_updates_are_off(model_dir, tmp_path):
    """As adapters without an adapters_root: 403, whatever the path."""
    settings = Settings(
        admin_key="admin-secret", models=[ModelSettings(name="mock", model=str(model_dir), backend="mock")]
    )
    _, served = serving_app(settings)
    with TestClient(served) as client:
        for path in (str(tmp_path), "/proc/1/root", "/no/such/dir"):
            answer = client.post("/update_weights_from_disk", json={"model_path": path}, headers=ADMIN)
            assert answer.status_code == 403 and answer.json()["success"] is False
            assert "no weights_root" in answer.json()["message"]
        adapter = client.post(
            "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path)}, headers=ADMIN
        )
        assert adapter.status_code == 403 and "no adapters_root" in adapter.text


def _new_weights(tmp_path) -> Path:
    """A weights directory under `tmp_path` that the mock engine loads as new weights."""
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    save_file({"w": np.ones(2, np.float32)}, weights / "model.safetensors")
    return weights


def _slow_mock(model_dir, tmp_path, delay_s: float, **settings) -> Settings:
    """The mock engine as "mock", each step taking `delay_s`, new weights from under `tmp_path`."""
    model = ModelSettings(
        name="mock",
        model=str(model_dir),
        backend="mock",
        options={"delay_s": delay_s},
        weights_root=str(tmp_path),
    )
    return Settings(admin_key="admin-secret", models=[model], **settings)


def test_requests_in_flight_finish_on_the_weights_they_began_with(model_dir, tmp_path):
    """The mock engine, slow: a dense request under way when an update arrives gets the old rows;
    the update waits for it, and a request after the update gets the new ones."""
    weights = _new_weights(tmp_path)
    with mock_app_client(settings=_slow_mock(model_dir, tmp_path, 0.5)) as (app, client):
        engine = app.state.registry.models["mock"].engine
        old_row = engine.logits([5, 6, 7])
        finished: dict[str, float] = {}
        results: dict[str, np.ndarray] = {}

        def ask(name: str, ids: list[int]) -> None:
            response = client.post(
                "/v1/next_token_logprobs",
                json={"model": "mock", "input": [ids], "layout": "matrix"},
                headers={"Accept": "application/msgpack"},
            )
            assert response.status_code == 200, response.text
            document = msgspec.msgpack.decode(response.content)
            results[name] = np.frombuffer(document["logprobs"], "<f4")
            finished[name] = time.monotonic()

        def change() -> None:
            answer = client.post(
                "/update_weights_from_disk", json={"model_path": str(weights)}, headers=ADMIN
            )
            assert answer.status_code == 200, answer.text
            finished["update"] = time.monotonic()

        in_flight = threading.Thread(target=ask, args=("in flight", [5, 6, 7]))
        in_flight.start()
        time.sleep(0.2)  # the request is in the engine
        updating = threading.Thread(target=change)
        updating.start()
        in_flight.join()
        updating.join()
        assert np.array_equal(results["in flight"], old_row)
        assert finished["in flight"] <= finished["update"]
        ask("after", [5, 6, 7])  # the same row: not the cached old one
        assert np.array_equal(results["after"], engine.logits([5, 6, 7]))
        assert not np.array_equal(results["after"], old_row)
        info = app.state.registry.models["mock"]
        assert info.weight_version == "1" and info.weight_updates == 1


@pytest.mark.hostile
def test_an_update_waits_for_a_long_stream_no_longer_than_its_bound(model_dir, tmp_path):
    """The mock engine: a stream of 400 steps of 20 ms holds the weights; an update from disk
    waits `weights_update_wait_s` for it, is refused (429, nothing changed), and a dense request
    held back behind it goes on at once; once the stream is done, the update goes through."""
    weights = _new_weights(tmp_path)
    settings = _slow_mock(model_dir, tmp_path, 0.02, limits=Limits(weights_update_wait_s=1.0))
    with mock_app_client(settings=settings) as (app, client):
        done: dict[str, tuple[int, float]] = {}

        def stream() -> None:
            body = {"model": "mock", "prompt": "hi", "max_tokens": 400, "stream": True}
            response = client.post("/v1/completions", json=body)
            done["stream"] = (response.status_code, time.monotonic())

        def change() -> None:
            answer = client.post(
                "/update_weights_from_disk", json={"model_path": str(weights)}, headers=ADMIN
            )
            done["update"] = (answer.status_code, time.monotonic())
            done["update message"] = answer.json()["message"]

        def dense() -> None:
            answer = client.post("/v1/next_token_logprobs", json={"model": "mock", "input": [[5, 6]]})
            done["dense"] = (answer.status_code, time.monotonic())

        streaming = threading.Thread(target=stream)
        streaming.start()
        time.sleep(0.5)  # the stream is under way
        began = time.monotonic()
        updating = threading.Thread(target=change)
        updating.start()
        time.sleep(0.2)  # the update waits, holding new requests back
        asking = threading.Thread(target=dense)
        asking.start()
        updating.join()
        asking.join()
        assert done["update"][0] == 429, done
        assert 1.0 <= done["update"][1] - began < 4.0, done
        assert "weights_update_wait_s" in done["update message"]
        assert done["dense"][0] == 200 and done["dense"][1] - began < 5.0, done
        assert "stream" not in done  # still running: 400 steps take 8 s
        info = app.state.registry.models["mock"]
        assert info.weight_updates == 0
        streaming.join()
        assert done["stream"][0] == 200
        change()
        assert done["update"][0] == 200, done
        assert info.weight_updates == 1


@pytest.mark.hostile
def test_the_version_follows_the_weights_when_the_admin_client_goes_away(model_dir, tmp_path):
    """A gateway process on the mock engine whose loads take 1 s: the admin client sends an
    update and disconnects 0.3 s in. The update still ends as a whole: the new weights are
    served under the version the update named, never the new weights under the old version."""
    weights = _new_weights(tmp_path)
    config = tmp_path / "gateway.toml"
    config.write_text(f"""
admin_key = "admin-secret"

[[models]]
name = "mock"
model = "{model_dir}"
backend = "mock"
weights_root = "{tmp_path}"
options = {{delay_s = 1.0}}
""")
    gateway = start_gateway(["--config", str(config)], tmp_path / "gateway.log")
    try:
        before, _ = dense_rows(gateway.base_url, [[5, 6, 7]], model="mock")
        body = msgspec.json.encode({"model_path": str(weights), "weight_version": "step-7"})
        address = httpx.URL(gateway.base_url)
        with socket.create_connection((address.host, address.port)) as admin:
            admin.sendall(
                b"POST /update_weights_from_disk HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + b"Authorization: Bearer admin-secret\r\nContent-Length: %d\r\n\r\n" % len(body)
                + body
            )
            time.sleep(0.3)
        deadline = time.monotonic() + 10
        while True:
            version = httpx.get(gateway.base_url + "/server_info", timeout=10).json()["weight_version"]
            after, _ = dense_rows(gateway.base_url, [[5, 6, 7]], model="mock")
            changed = not np.array_equal(after, before)
            then = httpx.get(gateway.base_url + "/server_info", timeout=10).json()["weight_version"]
            if version == then:  # else the update ended between the two reads
                assert changed == (version == "step-7"), (version, changed)
            if changed or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert then == "step-7"
    finally:
        gateway.stop()
