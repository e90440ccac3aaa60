"""The output cache's parts: value framing, keys, the in-process LRU, and Redis with outages."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time

import numpy as np

from backends.rows import PackedRows
from gateway.dense.quiet_time import QuietTime
from gateway.dense.redis_store import CacheStats, RedisStore
from gateway.dense.row_cache import FORMAT, MemoryRowCache, RedisRowCache, frame, frame_many, unframe
from gateway.models.fingerprint import weights_fingerprint
from logprob_gateway_client.wire import pack_ids


def _redis_cache(url: str = "redis://127.0.0.1:1/0", **kwargs) -> RedisRowCache:
    """A Redis cache; nothing connects before the first get or set."""
    stats = kwargs.pop("stats", CacheStats())
    store = RedisStore(url, ttl_s=kwargs.pop("ttl_s", 60), timeout_s=0.2, retry_after_s=0.3, stats=stats)
    return RedisRowCache(store, stats=stats, **kwargs)


def _peek(cache: MemoryRowCache, keys) -> list:
    """What the in-process cache holds under `keys`, without a lookup (which would run stores)."""
    return [cache._items.get(key) for key in keys]


def _row(seed: int, width: int = 1000) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(width).astype(np.float32)
    return x - np.log(np.exp(x.astype(np.float64)).sum()).astype(np.float32)


def test_values_read_back_bit_identical_and_corruption_is_detected():
    row = _row(0)
    value = frame(row)
    assert np.array_equal(unframe(value, 1000).view(np.uint32), row.view(np.uint32))
    flipped = bytearray(value)
    flipped[100] ^= 1
    assert unframe(bytes(flipped), 1000) is None  # checksum
    assert unframe(value[:-4], 1000) is None  # length
    assert unframe(value, 999) is None  # another vocabulary
    assert unframe(b"garbage", 1000) is None
    for poison in (np.nan, np.inf):
        assert unframe(frame(np.where(np.arange(1000) == 7, poison, row).astype(np.float32)), 1000) is None
    assert unframe(frame(np.full(1000, -np.inf, np.float32)), 1000) is not None  # masked, not poison


def test_keys_separate_models_adapters_and_prefixes():
    cache = _redis_cache()
    keys = {
        cache.key("model-a", None, pack_ids([1, 2, 3])),
        cache.key("model-b", None, pack_ids([1, 2, 3])),
        cache.key("model-a", "lora_1", pack_ids([1, 2, 3])),
        cache.key("model-a", "lora_2", pack_ids([1, 2, 3])),
        cache.key("model-a", None, pack_ids([1, 2])),
        cache.key("model-a", None, pack_ids([1, 2, 3, 0])),
    }
    assert len(keys) == 6
    assert all(k.startswith(f"lpg:v{FORMAT}:row:") for k in keys)
    assert cache.key("model-a", None, pack_ids([1, 2, 3])) == cache.key("model-a", None, pack_ids((1, 2, 3)))
    # The documented derivation: replicas of other versions sharing one Redis find the same rows.
    ids = [0, 49151, 2**31 - 1]
    digest = hashlib.sha256(
        json.dumps(["model-a", "lora_1", "float32"]).encode() + np.asarray(ids, "<i4").tobytes()
    )
    assert cache.key("model-a", "lora_1", pack_ids(ids)) == f"lpg:v{FORMAT}:row:{digest.hexdigest()}"


def test_in_process_keys_separate_what_digests_separate():
    cache = MemoryRowCache(10**6)
    inputs = [
        ("model-a", None, [1, 2, 3]),
        ("model-b", None, [1, 2, 3]),
        ("model-a", "lora_1", [1, 2, 3]),
        ("model-a", None, [1, 2]),
        ("model-a", None, [1, 2, 3, 0]),
    ]
    keys = [cache.keys(fingerprint, adapter, PackedRows.of([ids]))[0] for fingerprint, adapter, ids in inputs]
    assert len(set(keys)) == len(inputs)
    again = cache.keys("model-a", "lora_1", PackedRows.of([(1, 2, 3)]))[0]  # a new object of the same inputs
    assert again is not keys[2] and again == keys[2] and hash(again) == hash(keys[2])
    assert isinstance(again, bytes)  # hashed once, compared in C; no digest
    redis = _redis_cache()
    assert redis.keys("model-a", None, PackedRows.of([[1, 2, 3]])) == [
        redis.key("model-a", None, pack_ids([1, 2, 3]))
    ]


def test_weights_fingerprint_follows_config_and_weights(model_dir, tmp_path):
    base = weights_fingerprint(model_dir, "transformers", "float32")
    assert base == weights_fingerprint(model_dir, "transformers", "float32")
    assert base != weights_fingerprint(model_dir, "transformers", "bfloat16")
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text((model_dir / "config.json").read_text().replace("49152", "49153"))
    assert weights_fingerprint(copy, "transformers", "float32") != base


async def test_the_in_process_cache_is_an_lru_bounded_by_bytes():
    cache = MemoryRowCache(max_bytes=300)  # three rows of 25 floats, each its own matrix
    rows = {name: _row(i, 25)[None] for i, name in enumerate("abcd")}
    keys = {name: cache.keys("m", None, PackedRows.of([[i]]))[0] for i, name in enumerate("abcd")}
    for name in "abc":
        await cache.store_rows([keys[name]], rows[name])
    assert (await cache.lookup([keys["a"]], 25))[0] is not None  # a is now the most recent
    await cache.store_rows([keys["d"]], rows["d"])
    found = await cache.lookup([keys[name] for name in "abcd"], 25)
    assert [f is not None for f in found] == [True, False, True, True]
    assert cache.size == 300
    huge = cache.keys("m", None, PackedRows.of([[99]]))
    await cache.store_rows(huge, _row(9, 1000)[None])  # larger than the whole cache: not stored
    assert await cache.lookup(huge, 1000) == [None] and cache.size == 300


async def test_corrupted_values_are_misses_and_deleted(redis_server):
    cache = _redis_cache(redis_server.url, namespace="test-corrupt")
    keys = cache.keys("m", None, PackedRows.of([[i] for i in range(3)]))
    rows = np.stack([_row(i) for i in range(3)])
    await cache.store_rows(keys, rows)
    redis_server.client().set(keys[1], b"not a row")
    got = await cache.lookup(keys, 1000)
    assert np.array_equal(got[0], rows[0]) and got[1] is None and np.array_equal(got[2], rows[2])
    assert redis_server.client().get(keys[1]) is None
    assert (cache.stats.hits, cache.stats.misses, cache.stats.corrupt) == (2, 1, 1)
    await cache.aclose()


async def test_redis_round_trip_pipelined_with_ttl(redis_server):
    stats = CacheStats()
    cache = _redis_cache(redis_server.url, ttl_s=1, namespace="test-ttl", stats=stats)
    keys = [cache.key("m", None, pack_ids([i])) for i in range(20)]
    rows = np.stack([_row(i) for i in range(20)])
    await cache.store_rows(keys, rows)
    got = await cache.lookup(keys, 1000)
    assert all(np.array_equal(g.view(np.uint32), r.view(np.uint32)) for g, r in zip(got, rows, strict=True))
    assert redis_server.client().ttl(keys[0]) in (0, 1)
    await asyncio.sleep(1.6)
    assert await cache.lookup(keys[:3], 1000) == [None, None, None]
    assert stats.errors == 0
    await cache.aclose()


async def test_redis_outage_is_a_miss_logged_once_and_recovers(redis_server, caplog):
    cache = _redis_cache(redis_server.url, namespace="test-outage")
    key = cache.key("m", None, pack_ids([1]))
    await cache.store_rows([key], _row(1)[None])
    caplog.set_level(logging.WARNING, logger="gateway.dense.redis_store")
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
    await cache.aclose()


async def test_deferred_stores_are_read_back_and_finished_on_close():
    cache = MemoryRowCache(10**7)
    rows = np.stack([_row(1), _row(2)])
    keys = cache.keys("m", None, PackedRows.of([[1], [2]]))
    cache.store_later(keys, rows)
    assert cache.size == 0  # not stored yet: the caller's response goes first
    found = await cache.lookup(keys, 1000)  # waits for the store of these keys
    assert all(np.array_equal(f, r) for f, r in zip(found, rows, strict=True))
    other = cache.keys("m", None, PackedRows.of([[3]]))
    cache.store_later(other, _row(3)[None])
    await cache.aclose()  # lets the store finish: nothing is lost at shutdown
    assert np.array_equal(_peek(cache, other)[0], _row(3))


async def test_stores_wait_for_the_next_engine_call_unless_a_lookup_needs_them():
    quiet = QuietTime(timeout_s=30)  # no store may happen by the timeout in this test
    cache = MemoryRowCache(10**7, quiet=quiet)
    first, second = cache.keys("m", None, PackedRows.of([[1], [2]]))
    cache.store_later([first], _row(1)[None])
    cache.store_later([second], _row(2)[None])
    await asyncio.sleep(0.05)
    assert _peek(cache, [first, second]) == [None, None]  # a client may be sampling now
    quiet.now()  # an engine call begins
    await asyncio.sleep(0.01)
    assert [r.tobytes() for r in _peek(cache, [first, second])] == [
        _row(1).tobytes(),
        _row(2).tobytes(),
    ]
    third = cache.keys("m", None, PackedRows.of([[3]]))
    cache.store_later(third, _row(3)[None])
    found = await asyncio.wait_for(cache.lookup(third, 1000), 5)  # read-your-writes: stored now
    assert found[0].tobytes() == _row(3).tobytes()


async def test_a_deferred_store_happens_after_the_timeout_without_engine_calls():
    cache = MemoryRowCache(10**7, quiet=QuietTime(timeout_s=0.05))
    keys = cache.keys("m", None, PackedRows.of([[4]]))
    cache.store_later(keys, _row(4)[None])
    await asyncio.sleep(0.01)
    assert _peek(cache, keys) == [None]
    await asyncio.sleep(0.2)
    assert _peek(cache, keys)[0].tobytes() == _row(4).tobytes()


async def test_in_process_values_are_the_engine_rows_read_only_and_counted_once():
    cache = MemoryRowCache(3 * 4 * 4000)  # room for three steps of four rows
    rows = np.stack([_row(i) for i in range(4)])
    keys = cache.keys("m", None, PackedRows.of([[i] for i in range(4)]))
    await cache.store_rows(keys, rows)
    stored = _peek(cache, keys)
    assert all(np.shares_memory(v, rows) for v in stored)  # no copy
    assert not any(v.flags.writeable for v in stored)
    found = await cache.lookup(keys, 1000)
    assert all(f.tobytes() == r.tobytes() for f, r in zip(found, rows, strict=True))
    assert await cache.lookup([keys[0]], 999) == [None]  # another vocabulary: a miss
    assert cache.size == rows.nbytes  # one matrix, counted once
    await cache._delete(keys[:3])
    assert cache.size == rows.nbytes  # the last row alone keeps the whole matrix
    for step in range(3):  # newer steps push the oldest out, matrix by matrix
        more = np.stack([_row(10 * step + i) for i in range(4)])
        await cache.store_rows(cache.keys("m", None, PackedRows.of([[step, i] for i in range(4)])), more)
    assert _peek(cache, keys[3:]) == [None] and cache.size == 3 * rows.nbytes
    huge = np.stack([_row(i) for i in range(13)])
    await cache.store_rows(cache.keys("m", None, PackedRows.of([[99]])), huge[:1])
    assert _peek(cache, cache.keys("m", None, PackedRows.of([[99]]))) == [
        None
    ]  # its matrix alone is over the budget


async def test_values_bound_for_redis_are_framed_with_a_checksum():
    rows = np.stack([_row(i) for i in range(4)])
    values = frame_many(rows)
    assert [bytes(v) for v in values] == [frame(r) for r in rows]
    assert all(np.array_equal(unframe(v, 1000), r) for v, r in zip(values, rows, strict=True))
    framed = frame(rows[0])
    assert framed[8:16] != bytes(8) and framed[16:] == rows[0].tobytes()
    flipped = bytearray(framed)
    flipped[-1] ^= 1
    assert unframe(bytes(flipped), 1000) is None
