"""Prefix K/V reuse in the transformers engine's dense path, against uncached forward passes.

The first tests exercise the cache's data structure with small fake tensors; the others (slow)
run the real model and compare every row with the reference's direct float32 forward pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.transformers.batch_layout import plan_groups
from backends.transformers.engine import TransformersEngine, prefix_cache_bytes
from backends.transformers.prefix_cache import KVPrefixTrie
from backends.types import EngineConfig
from tests.conftest import engine_rows, last_row, load_peft_models, make_lora_adapter

TOL = 1e-4


# -- the data structure ------------------------------------------------------------------------


def fake_layers(rows: list[list[int]], layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K/V of right-aligned rows where position p of a row holds the row's token p (values: -token)."""
    width = max(len(r) for r in rows)
    keys = torch.zeros((len(rows), 1, width, 2))
    for i, row in enumerate(rows):
        keys[i, 0, width - len(row) :, :] = torch.tensor(row, dtype=torch.float32)[:, None]
    return [(keys.clone(), -keys.clone()) for _ in range(layers)]


def store(cache: KVPrefixTrie, rows: list[list[int]], adapter: str | None = None) -> None:
    cache.store([(adapter, r) for r in rows], fake_layers(rows))


def test_match_finds_the_longest_cached_prefix():
    cache = KVPrefixTrie(1 << 20)
    store(cache, [[1, 2, 3, 4], [1, 2, 7]])
    assert cache.match(None, [1, 2, 3, 4, 5])[1] == 4
    assert cache.match(None, [1, 2, 3])[1] == 3  # a prefix of a cached row is cached too
    assert cache.match(None, [1, 2, 9])[1] == 2
    assert cache.match(None, [9]) == (None, 0)
    assert cache.match("other", [1, 2, 3]) == (None, 0)


def test_gather_right_aligns_each_rows_cached_positions():
    cache = KVPrefixTrie(1 << 20)
    store(cache, [[5, 6, 7], [8, 9]])
    picks = [cache.match(None, [5, 6, 7, 1]), cache.match(None, [8, 9, 1]), (None, 0)]
    (keys, values), _ = cache.gather([(e, n) for e, n in picks], 3)
    assert keys[:, 0, :, 0].tolist() == [[5, 6, 7], [0, 8, 9], [0, 0, 0]]
    assert torch.equal(values, -keys)
    # a shorter use of an entry, rows in another order than the block's
    (keys, _), _ = cache.gather([(picks[1][0], 2), (picks[0][0], 2)], 2)
    assert keys[:, 0, :, 0].tolist() == [[8, 9], [5, 6]]


def test_every_row_of_the_last_pass_extended_reads_its_block_without_a_copy():
    cache = KVPrefixTrie(1 << 20)
    rows = [[5, 6, 7], [8, 9]]
    layers = fake_layers(rows)
    layers[0][0][1, 0, 0, :] = 42.0  # the padding column before the shorter row: masked by the pass
    cache.store([(None, r) for r in rows], layers)
    picks = [cache.match(None, [5, 6, 7, 1]), cache.match(None, [8, 9, 1])]
    (keys, values), _ = cache.gather(picks, 3)
    assert keys.data_ptr() == layers[0][0].data_ptr()  # a view of the stored block
    assert keys[:, 0, :, 0].tolist() == [[5, 6, 7], [42, 8, 9]] and torch.equal(values, layers[0][1])
    (swapped, _), _ = cache.gather(picks[::-1], 3)  # another order: copied, zeros before
    assert swapped[:, 0, :, 0].tolist() == [[0, 8, 9], [5, 6, 7]]


def test_extending_a_row_replaces_its_entry():
    cache = KVPrefixTrie(1 << 20)
    store(cache, [[1, 2], [3, 4]])
    store(cache, [[1, 2, 5], [3, 4, 6]])
    assert len(cache) == 2  # the longer entries hold the shorter ones' tokens
    store(cache, [[1, 2]])  # already held by [1, 2, 5]: nothing new
    assert len(cache) == 2
    assert cache.nbytes == sum(k.nbytes + v.nbytes for k, v in fake_layers([[1, 2, 5], [3, 4, 6]]))


def test_byte_budget_evicts_least_recently_used_entries():
    block = sum(k.nbytes + v.nbytes for k, v in fake_layers([[1, 2, 3]]))
    cache = KVPrefixTrie(2 * block)
    store(cache, [[1, 2, 3]])
    store(cache, [[4, 5, 6]])
    cache.match(None, [1, 2, 3])  # now [4, 5, 6] is the least recently used
    store(cache, [[7, 8, 9]])
    assert cache.nbytes <= 2 * block and cache.stats.evictions == 1
    assert cache.match(None, [4, 5, 6]) == (None, 0)  # its trie path went with it
    assert cache.match(None, [1, 2, 3])[1] == 3 and cache.match(None, [7, 8, 9])[1] == 3


def test_drop_adapter_forgets_only_that_adapter():
    cache = KVPrefixTrie(1 << 20)
    store(cache, [[1, 2]], "a")
    store(cache, [[1, 2]], None)
    cache.drop_adapter("a")
    assert cache.match("a", [1, 2]) == (None, 0)
    assert cache.match(None, [1, 2])[1] == 2 and len(cache) == 1


def _entry_tokens(entry) -> list[int]:
    tokens, node = [], entry.leaf
    while node.parent is not None:
        tokens.append(node.token)
        node = node.parent
    return tokens[::-1]


def test_lookups_by_key_find_what_a_walk_of_the_trie_finds():
    """Streams growing a token per pass (found by their keys), rows branching, repeating and
    shrinking (found by the walk), two adapters, evictions: each match is the longest common
    prefix with a live entry, and the entry it returns holds that prefix."""
    rng = np.random.default_rng(0)
    block = sum(k.nbytes + v.nbytes for k, v in fake_layers([[1] * 40] * 4))
    cache = KVPrefixTrie(6 * block)
    streams = [[int(t) for t in rng.integers(0, 5, 3)] for _ in range(4)]
    for _ in range(200):
        for s in streams:
            choice = rng.random()
            if choice < 0.7:
                s.append(int(rng.integers(0, 5)))  # a generation step
            elif choice < 0.8 and len(s) > 2:
                del s[int(rng.integers(1, len(s))) :]  # back to a shorter row (resampling)
        adapter = [None, "a"][int(rng.integers(0, 2))]
        for row in streams + [[int(t) for t in rng.integers(0, 5, 5)]]:
            entry, depth = cache.match(adapter, row)
            live = [_entry_tokens(e) for e in cache._lru if e.adapter == adapter]
            want = max(
                (int(np.argmin(np.r_[np.equal(row[: len(t)], t[: len(row)]), False])) for t in live),
                default=0,
            )
            assert depth == want
            if depth:
                assert _entry_tokens(entry)[:depth] == row[:depth]
        store(cache, [list(s) for s in streams], adapter)
    assert cache.stats.evictions > 0


def test_prefix_cache_bytes_option():
    cpu = torch.device("cpu")
    assert prefix_cache_bytes({}, cpu) == 1 << 30
    assert prefix_cache_bytes({"prefix_cache_bytes": 0}, cpu) == 0
    for bad in (-1, "1GB", True):
        with pytest.raises(ValueError, match="prefix_cache_bytes"):
            prefix_cache_bytes({"prefix_cache_bytes": bad}, cpu)


def test_plan_groups_keeps_extensions_apart_from_fresh_prompts():
    assert plan_groups([1, 1, 300, 1, 2], 16384) == [[0, 1, 3, 4], [2]]
    assert plan_groups([40, 30, 20, 10], 16384) == [[3, 2], [1, 0]]  # a group's width <= 2x + 8 its first
    assert plan_groups([1] * 5, 2) == [[0, 1], [2, 3], [4]]  # at most max_tokens padded tokens
    assert plan_groups([5000], 16) == [[0]]  # a row wider than the budget still runs, alone


# -- the engine with the real model -------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(reference, model_dir):
    """An engine over the reference's own weights (no adapters are loaded into it)."""
    return TransformersEngine(
        reference.model,
        reference.tokenizer,
        max_model_len=2048,
        model_path=str(model_dir),
        prefix_cache_bytes=1 << 30,
    )


def ids(reference, text: str) -> list[int]:
    return reference.tokenizer(text).input_ids


async def check(engine, reference, rows, adapters=None, references=None) -> int:
    """Compute `rows` and compare each with its uncached forward pass; the tokens computed."""
    before = engine.prefix_kv.stats.computed_tokens
    got = await engine_rows(engine, rows, adapters)
    for i, row in enumerate(rows):
        model = (references or {}).get((adapters or [None] * len(rows))[i])
        expected = reference.logprobs(row)[-1] if model is None else last_row(model, row)
        assert np.max(np.abs(got[i] - expected)) <= TOL, f"row {i}"
    return engine.prefix_kv.stats.computed_tokens - before


@pytest.mark.slow
async def test_smc_steps_compute_one_token_per_particle(engine, reference):
    prompt = ids(reference, "The lighthouse keeper climbed the stairs and")
    assert await check(engine, reference, [prompt]) <= len(prompt)
    rng = np.random.default_rng(0)
    particles = [list(prompt) for _ in range(4)]
    for step in range(6):
        particles = [p + [int(rng.integers(100, 40000))] for p in particles]
        if step == 3:  # resampling: two particles continue the same prefix
            particles[3] = particles[0][:-1] + [int(rng.integers(100, 40000))]
        assert await check(engine, reference, particles) == len(particles)


@pytest.mark.slow
async def test_mixed_cached_lengths_in_one_batch(engine, reference):
    a = ids(reference, "Once upon a time, in a land far away")
    b = ids(reference, "def fibonacci(n):")
    await check(engine, reference, [a, b])
    rows = [
        a + [11],  # one new token
        b + [12, 13, 14, 15],  # several new tokens
        a[:4],  # a cached prefix of a cached row: only its last token runs
        ids(reference, "Nothing of this is cached, and it is long enough to need its own pass. " * 3),
        [7],  # a single token
    ]
    # The long fresh prompt runs in a pass of its own; the others share one 4 tokens wide (a row
    # recomputes cached tokens that fall inside the window, where it would hold padding otherwise).
    assert await check(engine, reference, rows) == len(rows[3]) + 4 + 4 + 4 + 1


@pytest.mark.slow
async def test_prefix_of_another_row_and_duplicates_in_one_batch(engine, reference):
    base = ids(reference, "Paris is the capital of")
    rows = [base + [5, 6], base, base + [5, 6], base + [5], base + [5, 6, 7]]
    await check(engine, reference, rows)
    # the longest row holds all the others: each now costs one token
    assert await check(engine, reference, [base + [5], base + [5, 6, 7, 8]]) == 2


@pytest.mark.slow
async def test_eviction_under_a_tiny_byte_budget(reference, model_dir):
    config = reference.model.config
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4
    budget = per_token * 3 * 16  # one batch of 3 rows of <= 16 tokens, never two
    small = TransformersEngine(
        reference.model,
        reference.tokenizer,
        max_model_len=2048,
        model_path=str(model_dir),
        prefix_cache_bytes=budget,
    )
    rng = np.random.default_rng(1)
    rows = [ids(reference, "A tiny budget"), ids(reference, "keeps almost nothing")]
    for _ in range(4):
        fresh = [int(t) for t in rng.integers(100, 40000, 9)]
        rows = [r + [int(rng.integers(100, 40000))] for r in rows[:2]] + [fresh]
        await check(small, reference, rows)
        assert small.prefix_kv.nbytes <= budget
    assert small.prefix_kv.stats.evictions >= 3  # each earlier fresh row, for the next batch
    assert small.prefix_kv.match(None, rows[0])[1] == len(rows[0])


@pytest.mark.slow
async def test_disabled_cache_keeps_the_uncached_path(reference, model_dir):
    plain = TransformersEngine(
        reference.model, reference.tokenizer, max_model_len=2048, model_path=str(model_dir)
    )
    assert plain.prefix_kv is None and plain.prefix_cache is None
    rows = [ids(reference, "No cache here"), [3]]
    got = await engine_rows(plain, rows)
    for row, out in zip(rows, got, strict=True):
        assert np.max(np.abs(out - reference.logprobs(row)[-1])) <= TOL


@pytest.fixture(scope="module")
def lora_paths(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-lora")
    return {
        "a": make_lora_adapter(model_dir, root / "a", 11),
        "b": make_lora_adapter(model_dir, root / "b", 12),
    }


@pytest.mark.slow
async def test_adapters_keep_their_own_prefixes(model_dir, reference, lora_paths):
    engine = TransformersEngine.load(
        EngineConfig(model=str(model_dir), dtype="float32", device="cpu", max_lora_rank=8)
    )
    for name, path in lora_paths.items():
        await engine.adapters.load(name, str(path))
    references = load_peft_models(model_dir, lora_paths)
    prompt = ids(reference, "Adapters must never share keys and values")
    await check(engine, reference, [prompt], [None])
    # the same tokens under each adapter: nothing cached for them yet
    assert await check(engine, reference, [prompt, prompt], ["a", "b"], references) == 2 * len(prompt)
    for step in range(3):
        rows = [prompt + [20 + step] * (step + 1)] * 3
        await check(engine, reference, rows, [None, "a", "b"], references)
        prompt = rows[0]
    assert await check(engine, reference, [prompt + [9]] * 3, [None, "a", "b"], references) == 3
    await engine.adapters.unload("a")
    assert engine.prefix_kv.match("a", prompt) == (None, 0)
    assert await check(engine, reference, [prompt + [9]] * 2, [None, "b"], references) == 2
    await engine.aclose()


@pytest.mark.slow
async def test_flush_cache_forgets_every_prefix(engine, reference):
    prompt = ids(reference, "The flush test keeps this prefix for a while")
    await check(engine, reference, [prompt])
    assert await check(engine, reference, [prompt + [42]]) == 1  # the prefix is reused
    await engine.prefix_cache.flush()
    assert engine.prefix_kv.nbytes == 0
    assert await check(engine, reference, [prompt + [43]]) == len(prompt) + 1  # computed again
