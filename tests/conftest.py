"""Shared fixtures: the real default model (converted once), a direct transformers reference,
and one real gateway server process per test session."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.builtin_models import DEFAULT_MODEL, resolve_model_dir
from bench.launcher import GatewayProcess, RedisServer, start_gateway

MODEL = DEFAULT_MODEL
# Short prompts of the tests that hold an engine to a forward pass of the same weights.
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
_VLLM_ENV = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}


def _restore_vllm_environment() -> None:
    for key in [k for k in os.environ if k.startswith("VLLM_")]:
        if _VLLM_ENV.get(key) != os.environ[key]:
            if key in _VLLM_ENV:
                os.environ[key] = _VLLM_ENV[key]
            else:
                del os.environ[key]


@pytest.fixture(autouse=True)
def _clean_vllm_environment():
    """Importing genlm-backend's vLLM module sets VLLM_* variables for the whole process (an
    in-process engine mode); gateway processes started by tests must not inherit them. Restored
    before and after every test, so module fixtures that start gateways see a clean environment."""
    _restore_vllm_environment()
    yield
    _restore_vllm_environment()


def require_engine_library(name: str) -> None:
    """Skip a module whose engine library is not installed, except in CI, which installs them all:
    there a missing library fails the run instead of silently skipping the engine's tests."""
    if importlib.util.find_spec(name) is None:
        if os.environ.get("CI"):
            raise RuntimeError(f"CI must install {name!r} (see .ci/run)")
        pytest.skip(f"{name} is not installed", allow_module_level=True)


def requires_cuda(test: Callable) -> Callable:
    """Marked `cuda` (`pytest -m cuda` on a GPU machine), skipped without a CUDA GPU."""
    import torch

    return pytest.mark.cuda(
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test)
    )


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return resolve_model_dir(MODEL)


@pytest.fixture(scope="session")
def reference(model_dir: Path):
    """The same weights loaded directly with transformers in float32: the ground truth."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return Reference(model, tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights of a two-layer Llama 64 wide with the default model's tokenizer and chat
    template, for tests whose point is a mechanism (scheduling, batching, limits, the protocol)
    rather than the real model's answers: a token costs a few ms here instead of ~85. Its logits
    are spread (initializer_range) so that greedy picks are far from ties, as a trained model's
    mostly are, and batched numerics never flip them."""
    import torch

    from bench.smc import random_model_dir

    directory = tmp_path_factory.mktemp("tiny-model")
    cpu = torch.device("cpu")
    return random_model_dir("llama-tiny", torch.float32, cpu, directory, model_dir, initializer_range=0.3)


@pytest.fixture(scope="session")
def tiny_reference(tiny_model_dir: Path) -> Reference:
    """The tiny model loaded directly with transformers in float32: its ground truth."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return Reference(model, AutoTokenizer.from_pretrained(tiny_model_dir))


class Reference:
    def __init__(self, model, tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer

    def logprobs(self, ids: list[int]):
        """log_softmax of the logits at every position: float32 numpy [len(ids), vocab]."""
        import torch

        with torch.inference_mode():
            logits = self.model(torch.tensor([ids])).logits[0].float()
            return torch.log_softmax(logits, dim=-1).numpy()

    def greedy(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy tokens, end-of-sequence ending nothing."""
        return self.generate(ids, max_new_tokens, eos_token_id=None)

    def generate(self, ids: list[int], max_new_tokens: int, **controls) -> list[int]:
        """transformers' own greedy `generate` under `controls` (its logits processors' arguments)."""
        import torch

        with torch.inference_mode():
            # An explicit mask: otherwise generate() masks every token equal to the pad id, and
            # SmolLM2's pad id is its end-of-turn token, which chat prompts contain.
            tokens = torch.tensor([ids])
            out = self.model.generate(
                tokens,
                attention_mask=torch.ones_like(tokens),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                **controls,
            )
        return out[0, len(ids) :].tolist()


@pytest.fixture(scope="session")
def gateway(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """The real gateway serving the default model (float32 on CPU), as a separate process."""
    log_path = tmp_path_factory.mktemp("gateway") / "gateway.log"
    process = start_gateway(["--model", MODEL, "--dtype", "float32"], log_path)
    yield process
    process.stop()


def sdk_client(gateway: GatewayProcess) -> Any:
    """The `openai` SDK's client of `gateway`, which never retries."""
    import openai  # here, not at the top: the GPU-only tests run where the SDK is not installed

    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def client(gateway: GatewayProcess) -> Any:
    return sdk_client(gateway)


@pytest.fixture(scope="session")
def async_client(gateway: GatewayProcess) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def tiny_gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """The real gateway serving the tiny random model (`tiny_model_dir`) under the default model's
    name, for tests of what the gateway makes of any model's output (a grammar holds it, the
    protocol carries it) rather than of the real model's answers."""
    gateway = start_real_gateway(tiny_model_dir, tmp_path_factory.mktemp("tiny-gateway"))
    yield gateway
    gateway.stop()


@pytest.fixture(scope="session")
def tiny_client(tiny_gateway: GatewayProcess) -> Any:
    return sdk_client(tiny_gateway)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@contextlib.contextmanager
def mock_app_client(
    timeout_s: float = 120.0, on_loaded: Callable[[], None] | None = None, settings: Any = None
) -> Iterator[tuple[Any, Any]]:
    """The app serving the mock engine in this process (`settings`: a model "mock" by default),
    once its model is ready (and `on_loaded` has run): the Litestar app (for its state) and a
    test client of what the server runs (guard and metrics included)."""
    from litestar.testing import TestClient

    from gateway.app import serving_app
    from gateway.settings import ModelSettings, Settings

    settings = settings or Settings(models=[ModelSettings(name="mock", backend="mock")])
    litestar_app, served = serving_app(settings, on_loaded=on_loaded)
    with TestClient(served) as client:
        deadline = time.monotonic() + timeout_s
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the mock model did not load"
            time.sleep(0.1)
        yield litestar_app, client


@pytest.fixture(scope="session")
def scaled_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model with one layer's MLP output scaled: same tensor names, shapes and
    safetensors headers, other numbers (new weights for updates in place)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.mul_(1.5)
    path = tmp_path_factory.mktemp("scaled")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def scaled(scaled_dir: Path, reference: Reference) -> Reference:
    """The scaled weights loaded directly with transformers in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(scaled_dir, dtype=torch.float32).eval()
    return Reference(model, reference.tokenizer)


@pytest.fixture(scope="session")
def composed_vllm_adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the composed vLLM gateway loads adapters from at run time."""
    return tmp_path_factory.mktemp("composed-adapters")


@pytest.fixture(scope="session")
def composed_vllm_starting(
    model_dir: Path, composed_vllm_adapters: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Future[GatewayProcess]]:
    """A gateway of the default model made of two real engines (`backend = "vllm"` generating,
    `dense_backend = "transformers"`), float32, started in the background (vLLM takes ~30 s to
    start here) while its first users' references load; its admin key "admin-secret" (a trainer's
    weight sync needs none), new weights from under pytest's base directory, adapters from
    `composed_vllm_adapters`. Shared by tests/gateway/test_composed_vllm.py and the SGLang clients
    of tests/gateway/test_sglang_native.py; whoever changes its weights puts them back."""
    workdir = tmp_path_factory.mktemp("composed")
    model = f"""backend = "vllm"
dense_backend = "transformers"
max_model_len = 2048
adapters_root = "{composed_vllm_adapters}"
weights_root = "{tmp_path_factory.getbasetemp()}"
"""
    with ThreadPoolExecutor(1) as pool:
        settings = 'admin_key = "admin-secret"\ntrusted_weight_sync = true'  # a trainer without the key
        gateway = pool.submit(start_real_gateway, model_dir, workdir, settings, model)
        yield gateway
        gateway.result().stop()


def memory_kib(pid: int, field: str) -> int:
    """A memory figure of process `pid` from /proc/<pid>/status, in KiB (VmRSS, VmHWM: its peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def start_real_gateway(
    model_dir: Path, workdir: Path, settings: str = "", model_settings: str = ""
) -> GatewayProcess:
    """The real model in float32, served with the config file's top-level `settings` and the
    model's own `model_settings` (TOML lines)."""
    config = workdir / "gateway.toml"
    config.write_text(
        f'{settings}\n[[models]]\nname = "{MODEL}"\nmodel = "{model_dir}"\ndtype = "float32"\n{model_settings}\n'
    )
    return start_gateway(["--config", str(config)], workdir / "gateway.log")


def start_admin_gateway(
    model_dir: Path,
    workdir: Path,
    adapters_root: Path,
    adapters: dict | None = None,
    admin_key: str = "admin-secret",
) -> GatewayProcess:
    """The real model in float32 with the admin endpoints on: an admin key, an adapters root for
    loads at run time, and `adapters` (name -> directory) loaded at start."""
    loaded = ", ".join(f'{name} = "{path}"' for name, path in (adapters or {}).items())
    return start_real_gateway(
        model_dir,
        workdir,
        f'admin_key = "{admin_key}"',
        f'adapters_root = "{adapters_root}"\nadapters = {{{loaded}}}',
    )


@pytest.fixture(scope="session")
def lora_adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, Path]:
    """An adapters root: (root, {"a", "b": real PEFT adapters}, a directory outside the root).
    Beside "a" and "b" lie the adapters a load must refuse (too large a rank, pickled, targeting no
    module, links leading outside the root)."""
    root = tmp_path_factory.mktemp("adapters")
    paths = {
        "a": make_lora_adapter(model_dir, root / "a", 1),
        "b": make_lora_adapter(model_dir, root / "b", 2),
    }
    make_lora_adapter(model_dir, root / "too_big", 3, rank=80)
    make_lora_adapter(model_dir, root / "pickled", 4, safe_serialization=False)
    mismatched = make_lora_adapter(model_dir, root / "mismatched", 5)
    config = json.loads((mismatched / "adapter_config.json").read_text())
    config["target_modules"] = ["no_such_module"]
    (mismatched / "adapter_config.json").write_text(json.dumps(config))
    outside = tmp_path_factory.mktemp("outside")
    make_lora_adapter(model_dir, outside / "evil", 6)
    (root / "link").symlink_to(outside / "evil")
    (root / "loop").symlink_to(root / "loop")
    # Adapter directories inside the root whose files lead outside it.
    for leaked in ("adapter_model.safetensors", "adapter_config.json"):
        leaky = make_lora_adapter(model_dir, root / f"leaky-{leaked}", 7)
        (leaky / leaked).unlink()
        (leaky / leaked).symlink_to(outside / "evil" / leaked)
    return root, paths, outside


@pytest.fixture(scope="session")
def lora_gateway(
    lora_adapters: tuple[Path, dict, Path], model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """The real model with the admin endpoints on (key "admin-secret"), adapter "a" of
    `lora_adapters` loaded at start and its root for loads at run time. Shared by the LoRA tests of
    tests/gateway (test_lora.py, test_sglang_native.py) and tests/client/test_client_genlm_api.py:
    whoever loads an adapter unloads it, so each finds only "a" served."""
    root, paths, _ = lora_adapters
    gateway = start_admin_gateway(model_dir, tmp_path_factory.mktemp("lora"), root, {"a": paths["a"]})
    yield gateway
    gateway.stop()


@pytest.fixture(scope="session")
def mlx_gateway(
    lora_adapters: tuple[Path, dict, Path], model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """The default model on the MLX engine (float32), adapter "a" of `lora_adapters` loaded at
    start. Shared by tests/backends/test_mlx_engine.py and the SGLang clients of
    tests/gateway/test_sglang_native.py, so that MLX starts once."""
    pytest.importorskip("mlx_lm")
    _, paths, _ = lora_adapters
    config = tmp_path_factory.mktemp("mlx-gateway") / "gateway.toml"
    config.write_text(
        f'[[models]]\nname = "{MODEL}"\nmodel = "{model_dir}"\nbackend = "mlx"\ndtype = "float32"\n'
        f'max_model_len = 2048\nadapters = {{a = "{paths["a"]}"}}\n'
    )
    gateway = start_gateway(["--config", str(config)], config.parent / "gateway.log")
    yield gateway
    gateway.stop()


def dense_rows(base_url: str, rows, model: str = MODEL) -> tuple[Any, int]:
    """A served model's rows (float32 numpy [rows, vocab]) and the answer's cache hits."""
    import msgspec
    import numpy as np

    response = httpx.post(
        base_url + "/v1/next_token_logprobs",
        json={"model": model, "input": rows, "layout": "matrix"},
        headers={"Accept": "application/msgpack"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    document = msgspec.msgpack.decode(response.content)
    matrix = np.frombuffer(document["logprobs"], "<f4").reshape(len(rows), -1)
    return matrix, document["usage"]["cache_hits"]


def make_lora_adapter(model_dir, path, seed, rank=4, **save):
    """A LoRA adapter with random (non-zero) B matrices, so it changes the model's outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    get_peft_model(base, config).save_pretrained(path, **save)
    return path


def load_peft_models(model_dir, paths):
    """Each adapter applied by PEFT to its own float32 copy of the base model: name -> model."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models = {}
    for name, path in paths.items():
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        models[name] = PeftModel.from_pretrained(base, path).eval()
    return models


def last_row(model, ids):
    """log_softmax after the last token of `ids`, by a direct forward pass of `model`."""
    import torch

    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1).numpy()


async def engine_rows(engine, rows, adapters=None, out=None) -> Any:
    """An engine's dense rows of token-id lists as every caller gets them (backends/placement.py:
    repeats computed once, placed in `out` when given), landed."""
    from backends.placement import outputs, place_rows
    from backends.rows import PackedRows

    placed = await place_rows(engine, PackedRows.of(rows), adapters, out)
    for array in outputs(out) if out is not None else ():
        placed.wait_landed(array)
    return placed.logprobs
