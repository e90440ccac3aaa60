"""The generation engine's options in a composed model: its memory share on a GPU it shares with
the dense engine (backends/composed/memory.py), which value is set, in each engine's own terms
(backends/vllm/gpu_share.py, backends/sglang/gpu_share.py), and that a value the options give is
kept; vLLM without its row capture. No GPU here: the GPU's memory is given, and the engines are
mocks."""

from __future__ import annotations

import pytest

from backends.composed import engine as composed_engine
from backends.composed.engine import ComposedEngine
from backends.composed.memory import GIB, MARGIN, dense_gpu, fitted_options, generation_share
from backends.errors import EngineUnavailableError
from backends.mock import MockEngine
from backends.registry import composed_config
from backends.sglang.gpu_share import SGLANG_KV_CAP, sglang_headroom
from backends.types import EngineConfig, GpuMemory

H200 = 143_771 << 20  # bytes, as torch.cuda.mem_get_info gives an H200's total
# An H200 after a 1B model's dense engine loaded: its weights, context and activations in use
AFTER_DENSE = GpuMemory(free=H200 - 4 * GIB, total=H200, dense=3 * GIB)
CACHE = H200 // 10  # the dense engine's prefix cache budget by default


def test_vllm_gets_the_free_memory_less_the_dense_cache_and_the_margin_as_a_share_of_the_gpu():
    share = generation_share("vllm", AFTER_DENSE, CACHE)
    assert share == pytest.approx((AFTER_DENSE.free - CACHE - MARGIN) / H200, abs=1e-3)
    assert share * H200 <= AFTER_DENSE.free - CACHE - MARGIN  # rounded down, never over
    assert 0.8 < share < 0.86  # vLLM's default, 0.92, would not start beside the dense engine


def test_sglang_gets_the_same_room_with_its_own_headroom_as_a_share_of_what_is_free():
    assert sglang_headroom(H200) == 13_440 << 20  # SGLang's own default reserve on an H200
    assert sglang_headroom(80 << 30) == 13_440 << 20  # an H100: its chunked prefill and graphs
    assert sglang_headroom(24 << 30) == 3_760 << 20
    gpu = 24 << 30  # a GPU where the room left is below the K/V cap
    after_dense, cache = GpuMemory(free=14 * GIB, total=gpu, dense=3 * GIB), gpu // 10
    share = generation_share("sglang", after_dense, cache)
    static = share * after_dense.free  # SGLang's weights and K/V cache
    assert static + sglang_headroom(gpu) <= after_dense.free - cache - MARGIN
    assert static + sglang_headroom(gpu) > after_dense.free - cache - MARGIN - 0.001 * after_dense.free


def test_sglangs_k_v_cache_is_held_to_the_cap_where_the_gpu_has_more_room():
    share = generation_share("sglang", AFTER_DENSE, CACHE)
    weights = AFTER_DENSE.dense  # the dense engine's: as much as SGLang's weights
    assert share * AFTER_DENSE.free <= weights + SGLANG_KV_CAP
    assert share * AFTER_DENSE.free > weights + SGLANG_KV_CAP - 0.001 * AFTER_DENSE.free
    room = (AFTER_DENSE.free - CACHE - MARGIN - sglang_headroom(H200)) / AFTER_DENSE.free
    assert share < room - 0.4  # an H200 would have room for three times the cap
    # another process holding 43 GiB of the GPU leaves the cap where it was, in bytes
    shared = GpuMemory(free=AFTER_DENSE.free - 43 * GIB, total=H200, dense=AFTER_DENSE.dense)
    held = generation_share("sglang", shared, CACHE) * shared.free
    assert weights + SGLANG_KV_CAP - 0.001 * shared.free < held <= weights + SGLANG_KV_CAP


def test_a_gpu_without_room_for_the_generation_engine_is_refused_with_what_to_set():
    crowded = GpuMemory(free=20 * GIB, total=H200, dense=3 * GIB)
    with pytest.raises(EngineUnavailableError, match="options.mem_fraction_static"):
        generation_share("sglang", crowded, CACHE)
    with pytest.raises(EngineUnavailableError, match="prefix_cache_bytes"):
        generation_share("vllm", GpuMemory(free=10 * GIB, total=H200, dense=3 * GIB), 8 * GIB)


def test_the_share_is_set_where_the_options_leave_it_unset():
    vllm = fitted_options("vllm", {"enforce_eager": True}, AFTER_DENSE, CACHE)
    assert vllm == {
        "enforce_eager": True,
        "gpu_memory_utilization": generation_share("vllm", AFTER_DENSE, CACHE),
    }
    sglang = fitted_options("sglang", {"mode": "engine"}, AFTER_DENSE, CACHE)
    assert sglang["mem_fraction_static"] == generation_share("sglang", AFTER_DENSE, CACHE)
    assert "mem_fraction_static" in fitted_options("sglang", {}, AFTER_DENSE, CACHE)  # engine: the default
    server = fitted_options("sglang", {"mode": "server", "launch_args": ["--tp", 1]}, AFTER_DENSE, CACHE)
    share = str(generation_share("sglang", AFTER_DENSE, CACHE))
    assert server["launch_args"] == ["--tp", "1", "--mem-fraction-static", share]
    assert "mem_fraction_static" not in server


def test_a_share_the_options_give_is_kept():
    for backend, options in [
        ("vllm", {"gpu_memory_utilization": 0.3}),
        ("vllm", {"gpu_memory_utilization": 0.3, "kv_cache_memory_bytes": GIB}),
        ("sglang", {"mem_fraction_static": 0.5}),
        ("sglang", {"mode": "server", "launch_args": ["--mem-fraction-static", "0.5"]}),
    ]:
        assert fitted_options(backend, options, AFTER_DENSE, CACHE) == options
    # vLLM checks its share against free memory even when the K/V cache is sized in bytes
    assert "gpu_memory_utilization" in fitted_options(
        "vllm", {"kv_cache_memory_bytes": GIB}, AFTER_DENSE, CACHE
    )


def test_engines_that_hold_no_share_of_this_gpu_are_left_alone():
    url = {"url": "http://gpu-host:30000"}  # an SGLang server elsewhere holds its own memory
    assert fitted_options("sglang", url, AFTER_DENSE, CACHE) == url
    assert fitted_options("sglang", {"mode": "url", "url": "x"}, AFTER_DENSE, CACHE) == {
        "mode": "url",
        "url": "x",
    }
    assert fitted_options("transformers", {}, AFTER_DENSE, CACHE) == {}
    # a dense engine on the CPU, or of a backend without CUDA memory, shares no GPU
    assert dense_gpu("transformers", EngineConfig(model="m", device="cpu")) is None
    assert dense_gpu("mlx", EngineConfig(model="m", device="cuda")) is None
    assert dense_gpu("transformers", EngineConfig(model="m", device="cuda:1")) is None


class Recorded:
    """An engine class whose `load` records the config and gives a mock engine."""

    def __init__(self, engine: MockEngine) -> None:
        self.engine = engine
        self.configs: list[EngineConfig] = []

    def load(self, config: EngineConfig) -> MockEngine:
        self.configs.append(config)
        return self.engine


@pytest.fixture
def recorded(model_dir, monkeypatch):
    """(the generation engine's class, the dense engine's), in place of vLLM's and transformers'
    on a GPU of AFTER_DENSE's memory."""
    engine = MockEngine.load(EngineConfig(model=str(model_dir)))
    classes = {
        "vllm": Recorded(engine),
        "transformers": Recorded(MockEngine.load(EngineConfig(str(model_dir)))),
    }
    monkeypatch.setattr(composed_engine, "engine_class", classes.__getitem__)
    monkeypatch.setattr(composed_engine, "dense_gpu", lambda backend, config: (AFTER_DENSE, CACHE))
    return classes["vllm"], classes["transformers"]


def test_loading_on_a_gpu_sets_the_generation_engines_share_after_the_dense_engine_loaded(recorded):
    generation, dense = recorded
    config = composed_config(
        EngineConfig(model="m", options={"enforce_eager": True}), "vllm", "transformers", {}
    )
    ComposedEngine.load(config)
    assert dense.configs[0].options == {}
    assert generation.configs[0].options == {
        "enforce_eager": True,
        "dense_rows": "logprobs",  # vLLM's own rows, never asked: no logits processor
        "gpu_memory_utilization": generation_share("vllm", AFTER_DENSE, CACHE),
    }
    given = {"gpu_memory_utilization": 0.4, "dense_rows": "capture"}
    ComposedEngine.load(composed_config(EngineConfig(model="m", options=given), "vllm", "transformers", {}))
    assert generation.configs[1].options == given
