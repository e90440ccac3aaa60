"""Hugging Face transformers engine: CPU by default, CUDA when available.

All model calls run on one worker thread per engine, so concurrent requests interleave at
forward-pass granularity without blocking the event loop.

Dense rows reuse the attention keys/values of their longest cached prefix (a KVPrefixTrie,
backends/transformers/prefix_cache.py), so a row one token longer than an earlier one costs one
decode step. Its byte budget is `options = {prefix_cache_bytes = N}`: 0 turns it off; by default
1 GiB on CPU and a tenth of the GPU's memory on CUDA; the decode lane's shapes count against it
too. Models with attention other than plain full attention (sliding windows, linear attention)
run without it. Rows are grouped into forward passes by how many tokens each
must compute, at most `max_batch_tokens` (16384) padded tokens per pass.

On CUDA, rows reach the host through page-locked memory, which the gateway's in-process output
cache then keeps (no copy). torch keeps every page-locked block it made for reuse, per
power-of-two size, so a mix of request sizes can leave a cache's worth of blocks per size behind:
past `options = {pinned_host_bytes = N}` (1 GiB) page-locked, the blocks in no use are released.
On CUDA the engine also offers `host_memory` (backends.engine.HostMemory): host memory registered
with the driver (a client's shared memory, as the gateway maps it), into which a request's rows
are copied from the GPU straight (backends/transformers/host_copy.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, DynamicLayer

from backends.builtin_models import resolve_model_dir
from backends.engine import Engine
from backends.errors import AdapterError
from backends.grammar.constraint import LLGuidanceGrammars
from backends.rows import GrowingRow, PackedRows
from backends.sampling import Pick, greedy_alternatives, sample_in_bursts, sample_tokens
from backends.step_scheduler import StepScheduler
from backends.token_controls import needs_logits
from backends.transformers.cache_argument import output_cache, with_cache
from backends.transformers.capabilities import (
    TransformersAdapters,
    TransformersHostMemory,
    TransformersPrefixCache,
    TransformersWeights,
)
from backends.transformers.decode_lane import DecodeLane, lane_supported
from backends.transformers.dense_rows import DenseRows
from backends.transformers.grouped_attention import use_grouped_attention
from backends.transformers.host_copy import release_pinned_memory
from backends.transformers.prefix_cache import KVPrefixTrie
from backends.transformers.step_pass import (
    DEFAULT_STEPS_AHEAD,
    GreedySteps,
    StepItem,
    StepResult,
    pass_results,
)
from backends.transformers.weights_collective import CollectiveGroups
from backends.types import (
    EngineConfig,
    EngineStatus,
    GpuMemory,
    ModelInfo,
    PromptLogprobs,
    SamplingParams,
    TokenStep,
    resolve_auto_dtype,
)

log = logging.getLogger(__name__)

DEFAULT_BATCH_TOKENS = 16384  # bounds a dense forward pass's activations, whatever the row count
DEFAULT_PINNED_BYTES = 1 << 30  # page-locked host memory kept cached, beyond which unused blocks go
DEFAULT_LANE_ROWS = 512  # most rows a decode-lane step holds (CUDA; off on the CPU)
T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PROMPT_CHUNK = 512  # positions whose full-vocabulary log_softmax is held at once


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    return _DTYPES[resolve_auto_dtype(dtype, on_gpu=device.type == "cuda")]


def _positive_int(options: Any, name: str, default: int, minimum: int = 1) -> int:
    value = options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"option {name} must be an integer >= {minimum}, got {value!r}")
    return value


def prefix_cache_bytes(options: Any, device: torch.device) -> int:
    if options.get("prefix_cache_bytes") is None:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory // 10
        return 1 << 30
    return _positive_int(options, "prefix_cache_bytes", 0, minimum=0)


def dense_gpu(config: EngineConfig) -> tuple[GpuMemory, int] | None:
    """(the GPU's memory now, the prefix cache's budget) of an engine loaded with `config` on the
    first visible GPU, where a composed model's generation engine starts; None elsewhere."""
    device = resolve_device(config.device)
    if device.type != "cuda" or (device.index or 0) != 0:
        return None
    free, total = torch.cuda.mem_get_info(device)
    memory = GpuMemory(free, total, torch.cuda.memory_reserved(device))
    return memory, prefix_cache_bytes(config.options, device)


def supports_prefix_cache(model: Any) -> bool:
    """Reused K/V must be the whole past of every layer: plain full attention only."""
    layers = DynamicCache(config=model.config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    found: set[int] = set()
    for value in (
        getattr(model.generation_config, "eos_token_id", None),
        model.config.eos_token_id,
        tokenizer.eos_token_id,
    ):
        if isinstance(value, int):
            found.add(value)
        elif value:
            found.update(value)
    return frozenset(found)


class _DecodeState:
    """The KV cache of one generation request."""

    cache: Any = None


BASE = "__base__"  # PEFT's name for "no adapter" in mixed-adapter batches


class TransformersEngine(Engine):
    structured_outputs: LLGuidanceGrammars

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_model_len: int,
        model_path: str,
        prefix_cache_bytes: int = 0,
        max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
        pinned_host_bytes: int = DEFAULT_PINNED_BYTES,
        decode_lane_rows: int = 0,
        decode_lane_compile: bool = False,
        steps_ahead: int = DEFAULT_STEPS_AHEAD,
    ) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.info = ModelInfo(
            tokenizer=tokenizer,
            vocab_size=int(model.get_output_embeddings().weight.shape[0]),
            eos_token_ids=eos_token_ids(model, tokenizer),
            max_model_len=max_model_len,
            path=model_path,
            dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="transformers-engine")
        self._peft: Any = None  # the PeftModel wrapping `model` once an adapter is loaded
        self.pinned_host_bytes = pinned_host_bytes
        self.host_memory = TransformersHostMemory(self) if self.device.type == "cuda" else None
        self.adapters = TransformersAdapters(self)
        self.weights = TransformersWeights(self)
        # Dense rows and generation steps of concurrent requests share forward passes.
        self.steps_ahead = steps_ahead
        self.steps: StepScheduler[StepItem, StepResult] = StepScheduler(self._pass)
        self.prefix_kv: KVPrefixTrie | None = None  # prefixes' keys/values, reused by dense rows
        if prefix_cache_bytes and supports_prefix_cache(model):
            self.prefix_kv = KVPrefixTrie(prefix_cache_bytes)
            self.prefix_cache = TransformersPrefixCache(self)
        elif prefix_cache_bytes:
            log.info("%s: no prefix K/V reuse for this attention type", model_path)
        self.lane: DecodeLane | None = None
        if decode_lane_rows and self.prefix_kv is not None and lane_supported():
            # One budget for both: the lane's shapes count against the prefix cache's bytes.
            self.lane = DecodeLane(
                model,
                max_slots=decode_lane_rows,
                max_bytes=prefix_cache_bytes,
                graphs=self.device.type == "cuda",
                compiled=decode_lane_compile,
                on_bytes=self.prefix_kv.hold_elsewhere,
            )
        self.structured_outputs = LLGuidanceGrammars(tokenizer, self.info.vocab_size, self.info.eos_token_ids)
        self.groups = CollectiveGroups(self.device)  # collectives new weights come over
        self.dense = DenseRows(
            self._call,
            model.config,
            self.info.vocab_size,
            self.device,
            max_batch_tokens=max_batch_tokens,
            prefix_cache=self.prefix_kv,
            lane=self.lane,
        )

    @classmethod
    def load(cls, config: EngineConfig) -> TransformersEngine:
        path = resolve_model_dir(config.model)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        log.info("loading %s with transformers on %s in %s", path, device, dtype)
        if device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
            # cuDNN attention, which SDPA prefers on recent GPUs, spends CPU time on every call and
            # builds a plan for every new sequence length, which dense rows bring at every step;
            # flash attention does neither (docs/performance.md). The
            # switch is process-wide: the engine owns its process.
            torch.backends.cuda.enable_cudnn_sdp(False)
            log.info("cuDNN attention turned off (flash / memory-efficient attention instead)")
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        if device.type == "cuda":
            use_grouped_attention(model)
        context = getattr(model.config, "max_position_embeddings", None) or 2048
        engine = cls(
            model,
            tokenizer,
            max_model_len=config.max_model_len or context,
            model_path=str(path),
            prefix_cache_bytes=prefix_cache_bytes(config.options, device),
            max_batch_tokens=_positive_int(config.options, "max_batch_tokens", DEFAULT_BATCH_TOKENS),
            pinned_host_bytes=_positive_int(config.options, "pinned_host_bytes", DEFAULT_PINNED_BYTES, 0),
            decode_lane_rows=_positive_int(
                config.options, "decode_lane_rows", DEFAULT_LANE_ROWS if device.type == "cuda" else 0, 0
            ),
            decode_lane_compile=bool(config.options.get("decode_lane_compile", device.type == "cuda")),
            steps_ahead=_positive_int(config.options, "greedy_steps_ahead", DEFAULT_STEPS_AHEAD),
        )
        if engine.lane is not None and engine.lane.compiled:
            log.info("compiling the decode lane's step (torch.compile)")
            started = time.perf_counter()
            with torch.inference_mode():
                engine.lane.prepare()
            log.info("decode lane's step ready in %.0f s", time.perf_counter() - started)
        return engine

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _call(self, adapters: Sequence[str | None], **kwargs: Any) -> Any:
        """A forward pass where row i uses adapter i: PEFT's mixed-adapter batches, never a global switch."""
        if self._peft is None:
            if any(adapters):
                raise AdapterError(f"no adapter is loaded (asked for {sorted(set(filter(None, adapters)))})")
            return self.model(**kwargs)
        return self._peft(**kwargs, adapter_names=[a or BASE for a in adapters])

    def _forget_old_weights(self) -> None:
        # Keys/values computed with the old weights; the lane's graphs read the weights in place.
        if self.prefix_kv is not None:
            self.prefix_kv.clear()
        if self.lane is not None:
            self.lane.clear()

    # -- dense rows -----------------------------------------------------------------------------

    async def next_token_logprobs(self, rows: PackedRows, adapters: Sequence[str | None]) -> np.ndarray:
        computed = await self.steps.submit(
            [(r, k, a, None) for r, k, a in zip(rows.views(), rows.keys, adapters, strict=True)]
        )
        assert isinstance(computed, np.ndarray)
        return computed

    async def _pass(self, groups: list[Sequence[StepItem]]) -> list[StepResult]:
        return await self._run(self._step_results, groups)

    def _step_results(self, groups: list[Sequence[StepItem]]) -> list[StepResult]:
        results = pass_results(
            self.dense,
            groups,
            use_lane=self._peft is None,
            stats=self.steps.stats,
            host_memory=self.host_memory,
        )
        self._release_pinned_memory()
        return results

    def _release_pinned_memory(self) -> None:
        if self.device.type == "cuda" and release_pinned_memory(self.pinned_host_bytes):
            log.info("released unused page-locked memory (over %d bytes)", self.pinned_host_bytes)

    # -- prompt scoring -------------------------------------------------------------------------

    async def prompt_logprobs(
        self, ids: Sequence[int], top_k: int, adapter: str | None = None
    ) -> PromptLogprobs:
        return await self._run(self._prompt_logprobs, ids, top_k, adapter)

    @torch.inference_mode()
    def _prompt_logprobs(self, ids: Sequence[int], top_k: int, adapter: str | None) -> PromptLogprobs:
        tokens = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        logits = self._call([adapter], input_ids=tokens, use_cache=False).logits[0, :-1]
        targets = tokens[0, 1:]
        chosen, top_ids, top_vals = [], [], []
        for start in range(0, logits.shape[0], _PROMPT_CHUNK):
            chunk = torch.log_softmax(logits[start : start + _PROMPT_CHUNK].float(), dim=-1)
            chosen.append(chunk.gather(-1, targets[start : start + _PROMPT_CHUNK, None])[:, 0])
            values, indices = chunk.topk(top_k, dim=-1) if top_k else (chunk[:, :0], chunk[:, :0].long())
            top_ids.append(indices)
            top_vals.append(values)
        return PromptLogprobs(
            token_logprobs=torch.cat(chosen).cpu().numpy() if chosen else np.zeros(0, np.float32),
            top_ids=torch.cat(top_ids).cpu().numpy() if top_ids else np.zeros((0, top_k), np.int64),
            top_logprobs=torch.cat(top_vals).cpu().numpy() if top_vals else np.zeros((0, top_k), np.float32),
        )

    # -- generation -----------------------------------------------------------------------------

    async def generate(
        self, ids: Sequence[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[TokenStep]:
        """With prefix K/V reuse, each step is a dense row (the prompt and the tokens so far) in
        the passes the engine shares among requests: concurrent streams decode together, and a
        step costs one token. Without it (attention the prefix cache cannot hold), or where the
        sampler needs raw logits rather than those rows (the repetition penalty), a stream keeps
        its own K/V and runs alone."""
        sequence = GrowingRow(ids)
        state = _DecodeState()

        alternatives = greedy_alternatives(params)

        def step_items(tokens: Sequence[int], steps: int = 1) -> list[StepItem]:
            """The scheduler's item for the steps after `tokens` are appended (none: the prompt's)."""
            for token in tokens:
                sequence.append(token)
            steps = min(steps, self.steps_ahead)
            want = alternatives if steps == 1 or alternatives is None else GreedySteps(alternatives, steps)
            return [(sequence.view(), sequence.key, adapter, want)]

        shared = self.prefix_kv is not None and not needs_logits(params)

        async def next_logits(token: int | None) -> np.ndarray | Pick:
            # Through the scheduler, rows of log-probabilities: the sampler's choices are those
            # of the logits (a constant shift of every logit changes none), its scores the rows;
            # a greedy stream's token is chosen on the device.
            if not shared:
                return await self._run(self._forward, state, list(ids) if token is None else [token], adapter)
            result = await self.steps.submit(step_items([] if token is None else [token]))
            return result if isinstance(result, Pick) else result[0]

        eos = self.info.eos_token_ids
        if shared and params.grammar is None and params.stream_interval > 1:
            bursts = sample_in_bursts(params, eos, step_items([]), step_items, self.steps.run, ids)
            async for step in bursts:
                yield step
            return
        steps = sample_tokens(params, eos, next_logits, shared, self.structured_outputs, ids)
        async for step in steps:
            yield step

    @torch.inference_mode()
    def _forward(self, state: _DecodeState, new_ids: list[int], adapter: str | None) -> np.ndarray:
        tokens = torch.tensor([new_ids], dtype=torch.long, device=self.device)
        out = self._call(
            [adapter], input_ids=tokens, **with_cache(state.cache), use_cache=True, logits_to_keep=1
        )
        state.cache = output_cache(out)
        return out.logits[0, -1].float().cpu().numpy()

    def status(self) -> EngineStatus:
        kv = self.prefix_kv
        prefill = None if kv is None else (kv.stats.reused_tokens, kv.stats.computed_tokens)
        return EngineStatus(pass_stats=replace(self.steps.stats), prefill_tokens=prefill)

    async def aclose(self) -> None:
        await self.groups.aclose()
        await self.steps.aclose()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.structured_outputs.close()
