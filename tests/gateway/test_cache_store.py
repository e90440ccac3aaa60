"""The output cache's parts: value framing, keys, the in-process LRU, and Redis with outages."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time

import numpy as np

from gateway.cache import FORMAT, DenseRowCache, weights_fingerprint
from gateway.quiet_time import QuietTime
from gateway.row_stores import CacheStats, MemoryStore, RedisStore


def _row(seed: int, width: int = 1000) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(width).astype(np.float32)
    return x - np.log(np.exp(x.astype(np.float64)).sum()).astype(np.float32)


def test_values_read_back_bit_identical_and_corruption_is_detected():
    row = _row(0)
    value = DenseRowCache.encode(row)
    assert np.array_equal(DenseRowCache.decode(value, 1000).view(np.uint32), row.view(np.uint32))
    flipped = bytearray(value)
    flipped[100] ^= 1
    assert DenseRowCache.decode(bytes(flipped), 1000) is None  # checksum
    assert DenseRowCache.decode(value[:-4], 1000) is None  # length
    assert DenseRowCache.decode(value, 999) is None  # another vocabulary
    assert DenseRowCache.decode(b"garbage", 1000) is None


def test_keys_separate_models_adapters_and_prefixes():
    cache = DenseRowCache(MemoryStore(10**6))
    keys = {
        cache.key("model-a", None, [1, 2, 3]),
        cache.key("model-b", None, [1, 2, 3]),
        cache.key("model-a", "lora_1", [1, 2, 3]),
        cache.key("model-a", "lora_2", [1, 2, 3]),
        cache.key("model-a", None, [1, 2]),
        cache.key("model-a", None, [1, 2, 3, 0]),
    }
    assert len(keys) == 6
    assert all(k.startswith(f"lpg:v{FORMAT}:row:") for k in keys)
    assert cache.key("model-a", None, [1, 2, 3]) == cache.key("model-a", None, (1, 2, 3))
    # The documented derivation: replicas of other versions sharing one Redis find the same rows.
    ids = [0, 49151, 2**40]
    digest = hashlib.sha256(
        json.dumps(["model-a", "lora_1", "float32"]).encode() + np.asarray(ids, "<i8").tobytes()
    )
    assert cache.key("model-a", "lora_1", ids) == f"lpg:v{FORMAT}:row:{digest.hexdigest()}"


def test_in_process_keys_separate_what_digests_separate():
    cache = DenseRowCache(MemoryStore(10**6))
    inputs = [
        ("model-a", None, [1, 2, 3]),
        ("model-b", None, [1, 2, 3]),
        ("model-a", "lora_1", [1, 2, 3]),
        ("model-a", None, [1, 2]),
        ("model-a", None, [1, 2, 3, 0]),
    ]
    keys = [cache.keys(fingerprint, adapter, [ids])[0] for fingerprint, adapter, ids in inputs]
    assert len(set(keys)) == len(inputs)
    again = cache.keys("model-a", "lora_1", [(1, 2, 3)])[0]  # a new object of the same inputs
    assert again is not keys[2] and again == keys[2] and hash(again) == hash(keys[2])
    assert again != ("model-a", "lora_1", (1, 2, 3))  # a key is no tuple, and no digest
    redis = DenseRowCache(
        RedisStore("redis://127.0.0.1:1/0", ttl_s=60, timeout_s=0.1, retry_after_s=1, stats=CacheStats())
    )
    assert redis.keys("model-a", None, [[1, 2, 3]]) == [redis.key("model-a", None, [1, 2, 3])]


def test_weights_fingerprint_follows_config_and_weights(model_dir, tmp_path):
    base = weights_fingerprint(model_dir, "transformers", "float32")
    assert base == weights_fingerprint(model_dir, "transformers", "float32")
    assert base != weights_fingerprint(model_dir, "transformers", "bfloat16")
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text((model_dir / "config.json").read_text().replace("49152", "49153"))
    assert weights_fingerprint(copy, "transformers", "float32") != base


async def test_memory_store_is_an_lru_bounded_by_bytes():
    store = MemoryStore(max_bytes=300)
    await store.set_many([("a", b"x" * 100), ("b", b"y" * 100), ("c", b"z" * 100)])
    assert await store.get_many(["a"]) == [b"x" * 100]  # a is now the most recent
    await store.set_many([("d", b"w" * 100)])
    assert await store.get_many(["a", "b", "c", "d"]) == [b"x" * 100, None, b"z" * 100, b"w" * 100]
    assert store.size == 300
    await store.set_many([("huge", b"h" * 1000)])  # larger than the whole cache: not stored
    assert await store.get_many(["huge"]) == [None] and store.size == 300


async def test_corrupted_values_are_misses_and_deleted():
    store = MemoryStore(10**7)
    cache = DenseRowCache(store)
    keys = [cache.key("m", None, [i]) for i in range(3)]
    rows = np.stack([_row(i) for i in range(3)])
    await cache.store_rows(keys, rows)
    await store.set_many([(keys[1], b"not a row")])
    got = await cache.lookup(keys, 1000)
    assert np.array_equal(got[0], rows[0]) and got[1] is None and np.array_equal(got[2], rows[2])
    assert await store.get_many([keys[1]]) == [None]
    assert (cache.stats.hits, cache.stats.misses, cache.stats.corrupt) == (2, 1, 1)


async def test_redis_round_trip_pipelined_with_ttl(redis_server):
    stats = CacheStats()
    store = RedisStore(redis_server.url, ttl_s=1, timeout_s=0.5, retry_after_s=0.2, stats=stats)
    cache = DenseRowCache(store, namespace="test-ttl", stats=stats)
    keys = [cache.key("m", None, [i]) for i in range(20)]
    rows = np.stack([_row(i) for i in range(20)])
    await cache.store_rows(keys, rows)
    got = await cache.lookup(keys, 1000)
    assert all(np.array_equal(g.view(np.uint32), r.view(np.uint32)) for g, r in zip(got, rows, strict=True))
    assert redis_server.client().ttl(keys[0]) in (0, 1)
    await asyncio.sleep(1.6)
    assert await cache.lookup(keys[:3], 1000) == [None, None, None]
    assert stats.errors == 0
    await store.aclose()


async def test_redis_outage_is_a_miss_logged_once_and_recovers(redis_server, caplog):
    stats = CacheStats()
    store = RedisStore(redis_server.url, ttl_s=60, timeout_s=0.2, retry_after_s=0.3, stats=stats)
    cache = DenseRowCache(store, namespace="test-outage", stats=stats)
    key = cache.key("m", None, [1])
    await cache.store_rows([key], _row(1)[None])
    caplog.set_level(logging.WARNING, logger="gateway.row_stores")
    redis_server.stop()
    try:
        started = time.monotonic()
        for _ in range(20):  # many requests during the outage: misses, no exception, fast
            assert await cache.lookup([key], 1000) == [None]
            await cache.store_rows([key], _row(1)[None])
        assert time.monotonic() - started < 3
        assert sum("unavailable" in r.message for r in caplog.records) == 1
    finally:
        redis_server.start()
    await asyncio.sleep(0.35)
    await cache.store_rows([key], _row(1)[None])
    assert np.array_equal((await cache.lookup([key], 1000))[0], _row(1))
    assert sum("is back" in r.message for r in caplog.records) == 1
    await store.aclose()


async def test_background_stores_are_read_back_and_finished_on_close():
    store = MemoryStore(10**7)
    cache = DenseRowCache(store)
    rows = np.stack([_row(1), _row(2)])
    keys = [cache.key("m", None, [1]), cache.key("m", None, [2])]
    cache.store_in_background(keys, rows)
    assert store.size == 0  # not stored yet: the caller's response goes first
    found = await cache.lookup(keys, 1000)  # waits for the store of these keys
    assert all(np.array_equal(f, r) for f, r in zip(found, rows, strict=True))
    later = cache.key("m", None, [4])
    written = asyncio.get_running_loop().create_future()
    cache.store_in_background([later], _row(4)[None], after=written)  # once the response is written
    await asyncio.sleep(0.05)
    assert await store.get_many([later]) == [None]
    written.set_result(None)
    assert np.array_equal((await cache.lookup([later], 1000))[0], _row(4))
    other = cache.key("m", None, [3])
    cache.store_in_background([other], _row(3)[None])
    await cache.aclose()  # lets the store finish: nothing is lost at shutdown
    assert np.array_equal((await store.get_many([other]))[0], _row(3))


class _Landing:
    """Rows of `landing` arriving from a GPU after `delay_s`, as a CUDA event reports them."""

    def __init__(self, landing: np.ndarray, row: np.ndarray, delay_s: float) -> None:
        self.landing, self.row, self.delay_s = landing, row, delay_s
        self.waited_in: list[str] = []  # the threads that blocked until they landed

    def query(self) -> bool:
        return self.delay_s == 0 and self._land()

    def synchronize(self) -> None:  # blocks, as a CUDA event's does: off the event loop
        self.waited_in.append(threading.current_thread().name)
        time.sleep(self.delay_s)
        self._land()

    def _land(self) -> bool:
        self.landing[0] = self.row
        return True


async def test_rows_still_landing_are_stored_and_found_only_once_landed():
    cache = DenseRowCache(MemoryStore(10**7))
    keys = cache.keys("m", None, [[5]])
    landing = np.zeros((1, 1000), np.float32)  # an engine's own copy, still arriving from a GPU
    arriving = _Landing(landing, _row(5), delay_s=0.1)
    cache.store_in_background(keys, landing, landing=arriving)
    found = await cache.lookup(keys, 1000)  # waits for the store, which waits for the rows
    assert np.array_equal(found[0], _row(5))
    assert len(arriving.waited_in) == 1 and arriving.waited_in[0] != threading.current_thread().name


async def test_rows_that_have_landed_are_stored_without_waiting_in_a_thread():
    cache = DenseRowCache(MemoryStore(10**7))
    keys = cache.keys("m", None, [[6]])
    landing = np.zeros((1, 1000), np.float32)
    landed = _Landing(landing, _row(6), delay_s=0)
    cache.store_in_background(keys, landing, landing=landed)
    found = await cache.lookup(keys, 1000)
    assert np.array_equal(found[0], _row(6)) and landed.waited_in == []


async def test_stores_wait_for_the_next_engine_call_unless_a_lookup_needs_them():
    quiet = QuietTime(timeout_s=30)  # no store may happen by the timeout in this test
    store = MemoryStore(10**7)
    cache = DenseRowCache(store, quiet=quiet)
    first, second = cache.keys("m", None, [[1], [2]])
    cache.store_in_background([first], _row(1)[None])
    cache.store_in_background([second], _row(2)[None])
    await asyncio.sleep(0.05)
    assert await store.get_many([first, second]) == [None, None]  # a client may be sampling now
    quiet.now()  # an engine call begins
    await asyncio.sleep(0.01)
    assert [r.tobytes() for r in await store.get_many([first, second])] == [
        _row(1).tobytes(),
        _row(2).tobytes(),
    ]
    third = cache.keys("m", None, [[3]])
    cache.store_in_background(third, _row(3)[None])
    found = await asyncio.wait_for(cache.lookup(third, 1000), 5)  # read-your-writes: stored now
    assert found[0].tobytes() == _row(3).tobytes()


async def test_a_deferred_store_happens_after_the_timeout_without_engine_calls():
    store = MemoryStore(10**7)
    cache = DenseRowCache(store, quiet=QuietTime(timeout_s=0.05))
    keys = cache.keys("m", None, [[4]])
    cache.store_in_background(keys, _row(4)[None])
    await asyncio.sleep(0.01)
    assert await store.get_many(keys) == [None]
    await asyncio.sleep(0.2)
    assert (await store.get_many(keys))[0].tobytes() == _row(4).tobytes()


async def test_in_process_values_are_the_engine_rows_read_only_and_counted_once():
    store = MemoryStore(3 * 4 * 4000)  # room for three steps of four rows
    cache = DenseRowCache(store)
    rows = np.stack([_row(i) for i in range(4)])
    keys = [cache.key("m", None, [i]) for i in range(4)]
    await cache.store_rows(keys, rows)
    stored = await store.get_many(keys)
    assert all(np.shares_memory(v, rows) for v in stored)  # no copy
    assert not any(v.flags.writeable for v in stored)
    found = await cache.lookup(keys, 1000)
    assert all(f.tobytes() == r.tobytes() for f, r in zip(found, rows, strict=True))
    assert await cache.lookup([keys[0]], 999) == [None]  # another vocabulary: a miss
    assert store.size == rows.nbytes  # one matrix, counted once
    await store.delete_many(keys[:3])
    assert store.size == rows.nbytes  # the last row alone keeps the whole matrix
    for step in range(3):  # newer steps push the oldest out, matrix by matrix
        more = np.stack([_row(10 * step + i) for i in range(4)])
        await cache.store_rows([cache.key("m", None, [step, i]) for i in range(4)], more)
    assert await store.get_many(keys[3:]) == [None] and store.size == 3 * rows.nbytes
    huge = np.stack([_row(i) for i in range(13)])
    await cache.store_rows([cache.key("m", None, [99])], huge[:1])
    assert await store.get_many([cache.key("m", None, [99])]) == [None]  # its matrix alone is over the budget


async def test_values_bound_for_redis_are_framed_with_a_checksum():
    rows = np.stack([_row(i) for i in range(4)])
    values = DenseRowCache.encode_many(rows)
    assert [bytes(v) for v in values] == [DenseRowCache.encode(r) for r in rows]
    assert all(np.array_equal(DenseRowCache.decode(v, 1000), r) for v, r in zip(values, rows, strict=True))
    framed = DenseRowCache.encode(rows[0])
    assert framed[8:16] != bytes(8) and framed[16:] == rows[0].tobytes()
    flipped = bytearray(framed)
    flipped[-1] ^= 1
    assert DenseRowCache.decode(bytes(flipped), 1000) is None
