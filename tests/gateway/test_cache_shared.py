"""Two real gateway processes sharing one real Redis: hits across replicas, bit-identical rows,
outages invisible to clients, corrupted values recomputed, models never sharing entries."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import numpy as np
import pytest

from bench.launcher import start_gateway
from gateway.dense.row_cache import FORMAT, frame
from tests.conftest import MODEL

pytestmark = pytest.mark.slow
MSGPACK = {"Accept": "application/msgpack"}


@pytest.fixture(scope="module")
def replicas(redis_server, model_dir, lora_adapters, tmp_path_factory):
    """Two replicas of one model and a mock, sharing Redis. Each serves an adapter named "e" from
    another checkpoint of one LoRA config (a fleet midway through a rollout)."""
    workdir = tmp_path_factory.mktemp("replicas")
    _, checkpoints, _ = lora_adapters
    gateways = [
        start_gateway(
            [
                "--config",
                str(_config(workdir / f"gateway{i}.toml", model_dir, checkpoints[name], redis_server)),
            ],
            workdir / f"replica{i}.log",
        )
        for i, name in enumerate("ba")
    ]
    yield gateways
    for gateway in gateways:
        gateway.stop()


def _config(config, model_dir, adapter, redis_server):
    config.write_text(f"""
[[models]]
name = "{MODEL}"
model = "{model_dir}"
dtype = "float32"
adapters = {{e = "{adapter}"}}

[[models]]
name = "mock"
model = "{model_dir}"
backend = "mock"

[cache]
redis_url = "{redis_server.url}"
retry_after_s = 0.5
timeout_s = 0.2
""")
    return config


def dense(gateway, rows, model=MODEL, **options):
    response = httpx.post(
        gateway.base_url + "/v1/next_token_logprobs",
        headers=MSGPACK,
        timeout=60,
        json={"model": model, "input": rows, **options},
    )
    assert response.status_code == 200, response.text
    doc = msgspec.msgpack.decode(response.content)
    raw = [row["logprobs"] for row in doc["data"]]
    return raw, doc["usage"]["cache_hits"]


def stored(gateway, rows, model=MODEL):
    """Rows are stored after their response: asking the same replica again waits for that store
    (read-your-writes), after which every replica can read them."""
    _, hits = dense(gateway, rows, model)
    assert hits == len(rows)


def as_array(raw):
    return np.stack([np.frombuffer(r, dtype="<f4") for r in raw])


def test_second_replica_reads_rows_the_first_computed(replicas, reference):
    first, second = replicas
    rows = [reference.tokenizer(t).input_ids for t in ["Shared cache one", "Shared cache two, longer"]]
    computed, hits = dense(first, rows)
    assert hits == 0
    stored(first, rows)
    cached, hits = dense(second, rows)
    assert hits == 2
    assert cached == computed  # bytes, bit for bit
    for row, ids in zip(as_array(cached), rows, strict=True):
        assert np.max(np.abs(row - reference.logprobs(ids)[-1])) <= 1e-4


def test_a_request_without_the_cache_neither_reads_nor_writes_it(replicas, reference):
    """`cache: false` computes rows that the cache holds, and stores none; the client's
    `server_cache=False` sends it."""
    from logprob_gateway_client import AsyncGatewayLM

    first, second = replicas
    held = [reference.tokenizer("Held in the cache").input_ids]
    computed, _ = dense(first, held)
    stored(first, held)
    again, hits = dense(second, held, cache=False)
    assert hits == 0 and again == computed
    fresh = [reference.tokenizer("Never cached, asked without the cache").input_ids]
    for gateway in (first, second, first):
        _, hits = dense(gateway, fresh, cache=False)
        assert hits == 0
    assert dense(second, fresh)[1] == 0  # the uncached asks stored nothing

    def lookups() -> float:
        text = httpx.get(second.base_url + "/metrics").text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("logprob_gateway_cache_lookups_total")
        )

    async def ask() -> np.ndarray:
        lm = AsyncGatewayLM(second.base_url, MODEL, server_cache=False)
        try:
            return np.asarray(await lm.batch_next_token_logprobs(held))
        finally:
            await lm.aclose()

    before = lookups()
    row = asyncio.run(ask())
    # computed again, in its own pass: the same numbers, to rounding
    assert lookups() == before and np.max(np.abs(row - as_array(computed))) <= 1e-4


def test_models_never_share_entries(replicas, reference):
    first, second = replicas
    rows = [reference.tokenizer("Which model answers?").input_ids]
    real, _ = dense(first, rows)
    mock, hits = dense(second, rows, model="mock")
    assert hits == 0 and mock != real
    stored(second, rows, model="mock")
    again, hits = dense(first, rows, model="mock")
    assert hits == 1 and again == mock


def test_redis_outage_is_invisible_and_cache_resumes(replicas, redis_server, reference):
    first, second = replicas
    prefixes = [reference.tokenizer(f"During the outage, number {i}").input_ids for i in range(12)]
    redis_server.stop()
    try:
        for ids in prefixes:  # every request succeeds, with the right numbers
            raw, hits = dense(first, [ids])
            assert hits == 0
            assert np.max(np.abs(as_array(raw)[0] - reference.logprobs(ids)[-1])) <= 1e-4
    finally:
        redis_server.start()
    import time

    time.sleep(0.6)  # past retry_after_s: the replicas try Redis again
    computed, hits = dense(first, prefixes[:3])
    stored(first, prefixes[:3])
    cached, hits_second = dense(second, prefixes[:3])
    assert hits_second == 3 and cached == computed
    assert "unavailable" in first.log_path.read_text() and "is back" in first.log_path.read_text()


def test_corrupted_values_are_recomputed_and_replaced(replicas, redis_server, reference):
    first, second = replicas
    rows = [reference.tokenizer("Corrupt me").input_ids]
    computed, _ = dense(first, rows)
    stored(first, rows)
    client = redis_server.client()
    keys = list(client.scan_iter(f"lpg:v{FORMAT}:row:*"))
    assert keys
    for key in keys:
        value = client.get(key)
        client.set(key, value[:-8] + b"\x00" * 8)  # same length, wrong bytes
    again, hits = dense(second, rows)
    assert hits == 0 and again == computed
    stored(second, rows)
    _, hits = dense(first, rows)
    assert hits == 1  # the fresh value replaced the corrupted one


@pytest.mark.hostile
def test_a_forged_value_of_nan_is_a_corrupt_miss(replicas, redis_server, reference):
    """A value whose frame and checksum are right but whose row is no log-probabilities (NaN)
    is dropped as corrupt, not served: SGLang's prompt-only /generate samples from that row."""
    first, second = replicas
    ids = reference.tokenizer("Forge me").input_ids
    computed, _ = dense(first, [ids])
    stored(first, [ids])
    client = redis_server.client()
    width = reference.logprobs(ids).shape[-1]
    for key in client.scan_iter(f"lpg:v{FORMAT}:row:*"):
        client.set(key, frame(np.full(width, np.nan, dtype=np.float32)))
    answer = httpx.post(
        second.base_url + "/generate",
        json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    again, hits = dense(second, [ids])
    assert hits == 1 and again == computed


@pytest.mark.hostile
def test_one_adapter_name_on_two_checkpoints_never_shares_rows(replicas, reference):
    """Replica 0 serves "e" from checkpoint b and replica 1 from a: the rows each computes are its
    own checkpoint's, whichever replica stored its rows in Redis first."""
    first, second = replicas
    rows = [reference.tokenizer("One name across replicas").input_ids]
    with_b, _ = dense(first, rows, f"{MODEL}:e")
    stored(first, rows, f"{MODEL}:e")
    with_a, hits = dense(second, rows, f"{MODEL}:e")
    assert hits == 0 and np.max(np.abs(as_array(with_a) - as_array(with_b))) > 0.1
