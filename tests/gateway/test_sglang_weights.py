"""New weights for `--backend sglang` through the gateway's admin endpoints, against the stand-in
SGLang server (tests/backends/sglang_standin_weights.py) the gateway reaches by URL: rows follow the
new weights and the output cache's keys change with them, from disk and over a trainer's gloo
group; SGLang's refusals are 400s with its message; every call needs the admin key."""

from __future__ import annotations

import json
import shutil
import threading

import httpx
import numpy as np
import pytest
import torch

from bench.launcher import free_port, start_gateway
from tests.conftest import MODEL, dense_rows, require_engine_library

require_engine_library("sglang")

from backends.sglang.transport import ManagedServer  # noqa: E402
from tests.backends.sglang_standin import distribution  # noqa: E402
from tests.backends.sglang_standin_weights import directory_version  # noqa: E402
from tests.backends.test_sglang_weights import STANDIN, GlooTrainer, received_version  # noqa: E402

ADMIN = {"Authorization": "Bearer admin-secret"}
PREFIXES = [[504, 3575, 282, 4649, 314], [410, 2251, 30]]


@pytest.fixture(scope="module")
def standin(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("standin") / "standin.log"
    server = ManagedServer([*STANDIN, "--model-path", str(model_dir)], free_port(), log, env={})
    server.wait_healthy(120)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(standin, model_dir, tmp_path_factory):
    """The output cache in process; new weights from anywhere in pytest's base directory."""
    workdir = tmp_path_factory.mktemp("sglang-weights")
    config = workdir / "gateway.toml"
    config.write_text(f"""
admin_key = "admin-secret"

[[models]]
name = "{MODEL}"
model = "{model_dir}"
backend = "sglang"
weights_root = "{tmp_path_factory.getbasetemp()}"
options = {{mode = "url", url = "{standin.base_url}"}}
""")
    gateway = start_gateway(["--config", str(config)], workdir / "gateway.log")
    yield gateway
    gateway.stop()


def version(standin) -> str:
    """The weights the stand-in has now, as `distribution` takes them."""
    return httpx.get(standin.base_url + "/standin/weights").json()["version"]


def served_rows(gateway, weights: str, hits: int | None) -> np.ndarray:
    """The gateway's rows, checked: the stand-in's model with `weights`, `hits` of them cached
    (None: whichever were)."""
    rows, cached = dense_rows(gateway.base_url, PREFIXES)
    for row, prefix in zip(rows, PREFIXES, strict=True):
        np.testing.assert_allclose(row, distribution(prefix, None, rows.shape[1], weights), rtol=0, atol=2e-5)
    assert hits is None or cached == hits
    return rows


def post(gateway, path: str, body: dict, headers=ADMIN) -> httpx.Response:
    return httpx.post(gateway.base_url + path, json=body, headers=headers, timeout=120)


def test_every_weights_call_needs_the_admin_key(gateway, standin, scaled_dir):
    before = len(httpx.get(standin.base_url + "/standin/requests").json())
    for path, body in [
        ("/update_weights_from_disk", {"model_path": str(scaled_dir)}),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2},
        ),
        ("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}),
        ("/destroy_weights_update_group", {"group_name": "g"}),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            answer = post(gateway, path, body, headers)
            assert answer.status_code == 401, (path, answer.text)
    assert len(httpx.get(standin.base_url + "/standin/requests").json()) == before  # SGLang heard nothing


def test_weights_from_disk_are_served_under_new_cache_keys(gateway, standin, scaled_dir):
    old = version(standin)
    served_rows(gateway, old, None)
    served_rows(gateway, old, len(PREFIXES))  # cached under the old weights' keys
    answer = post(
        gateway, "/update_weights_from_disk", {"model_path": str(scaled_dir), "weight_version": "s1"}
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["success"] is True and "s1" in answer.json()["message"]
    new = directory_version(scaled_dir)
    assert version(standin) == new != old
    served_rows(gateway, new, 0)  # no old row read: the model's fingerprint changed
    served_rows(gateway, new, len(PREFIXES))
    info = httpx.get(gateway.base_url + "/get_model_info").json()
    assert info["weight_version"] == "s1" and info["model_path"] == str(scaled_dir)


def test_sglangs_refusal_is_a_400_with_its_message(gateway, standin, scaled_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(scaled_dir, broken)
    (broken / "extra.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"not json" * 2)
    weights = version(standin)
    served_rows(gateway, weights, None)
    served_rows(gateway, weights, len(PREFIXES))
    answer = post(gateway, "/update_weights_from_disk", {"model_path": str(broken)})
    assert answer.status_code == 400, answer.text
    assert answer.json()["success"] is False
    assert "deserializing header of extra.safetensors" in answer.json()["message"]
    assert "Rolling back" in answer.json()["error"]["message"]
    assert version(standin) == weights
    served_rows(gateway, weights, len(PREFIXES))  # nothing changed: the same keys


def test_weights_over_a_trainers_collective_are_served_under_new_cache_keys(gateway, standin):
    trainer = GlooTrainer("weight_update_group_gateway")
    try:
        answer = post(gateway, "/init_weights_update_group", trainer.join_body())
        assert answer.status_code == 200 and answer.json()["success"] is True, answer.text
        old = version(standin)
        served_rows(gateway, old, None)
        served_rows(gateway, old, len(PREFIXES))
        tensors = {"model.norm.weight": torch.rand(576)}
        body = {"names": list(tensors), "dtypes": ["float32"], "shapes": [[576]], "group_name": trainer.name}
        answers: list[httpx.Response] = []
        update = threading.Thread(
            target=lambda: answers.append(post(gateway, "/update_weights_from_distributed", body))
        )
        update.start()  # as TorchRL: the request under way while the trainer broadcasts
        trainer.broadcast(list(tensors.values())).join(60)
        update.join(60)
        assert answers[0].status_code == 200 and answers[0].json()["success"] is True, answers[0].text
        new = received_version(old, tensors)
        assert version(standin) == new
        served_rows(gateway, new, 0)
        answer = post(gateway, "/destroy_weights_update_group", {"group_name": trainer.name})
        assert answer.status_code == 200, answer.text
        again = post(gateway, "/destroy_weights_update_group", {"group_name": trainer.name})
        assert again.status_code == 400 and "does not exist" in again.json()["message"]
        unknown = post(gateway, "/update_weights_from_distributed", {**body, "group_name": "nobody"})
        assert unknown.status_code == 400 and "no weights update group" in unknown.json()["message"]
        assert standin.alive()  # never asked into a group it lacks (its scheduler would die)
    finally:
        trainer.close()


def test_the_stand_in_refuses_bodies_sglangs_types_refuse(standin, scaled_dir):
    """The stand-in's check is sglang's own request type: misspelled fields and wrong types fail."""
    for body in ({"model_path": str(scaled_dir), "flush_cash": True}, {"model_path": 3}):
        answer = httpx.post(standin.base_url + "/update_weights_from_disk", json=body)
        assert answer.status_code == 422, json.dumps(body)


def test_an_update_while_the_gateway_is_paused_never_pauses_sglang(gateway, standin, scaled_dir, tmp_path):
    """TorchRL's steps around an update: pause (retract), /get_load down to nothing running, the
    update, continue. The pause is the gateway's own: SGLang is never paused, so its cache flush
    after the update finds it idle."""
    checkpoint = tmp_path / "step-2"
    shutil.copytree(scaled_dir, checkpoint)
    (checkpoint / "config.json").write_text((scaled_dir / "config.json").read_text() + "\n")  # new bytes
    before = len(httpx.get(standin.base_url + "/standin/requests").json())
    assert post(gateway, "/pause_generation", {"mode": "retract"}).status_code == 200
    load = httpx.get(gateway.base_url + "/get_load").json()[0]
    assert load["num_reqs"] - load["num_waiting_reqs"] == 0
    answer = post(gateway, "/update_weights_from_disk", {"model_path": str(checkpoint)})
    assert answer.status_code == 200, answer.text
    assert post(gateway, "/continue_generation", {}).status_code == 200
    served_rows(gateway, directory_version(checkpoint), 0)
    paths = [body.get("path") for body in httpx.get(standin.base_url + "/standin/requests").json()[before:]]
    assert paths[0] == "/update_weights_from_disk" and "/pause_generation" not in paths
