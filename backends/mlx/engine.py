"""MLX engine (mlx-lm): Apple silicon, and the CPU build of MLX on Linux.

MLX arrays and streams belong to the thread that made them, so everything MLX does, loading
included, runs on this engine's one worker thread. Dense rows of different lengths run in one
forward pass: left padding with mlx-lm's BatchKVCache, which gives each row its own rotary
positions and masks the padding. When the model runs in bfloat16/float16, the final projection
of dense rows runs in float32 (a float32 copy of the output head is kept), so rows are not
quantised to bfloat16's 8-bit mantissa. `auto` (backends/types.py `resolve_auto_dtype`) is float32
on the CPU and bfloat16 on Apple silicon's GPU, whatever dtype the checkpoint was saved in.

Generation reuses KV state across requests: prompts are prefilled from the longest cached prefix
of the same adapter (mlx-lm's LRUPromptCache, bounded by the `prompt_cache_bytes` option,
256 MiB by default), so chat turns and shared system prompts cost only their new tokens.
Concurrent streams decode together (backends/step_scheduler.py): each pass merges the K/V of the
streams that wait for a token into one mlx-lm BatchKVCache, runs one forward pass, and hands each
stream its K/V back; a stream that starts joins at its next step, one that stops is dropped.
Concurrent dense calls share those passes too: their rows (each distinct row once) run together,
left-padded, at most `DENSE_ROWS` to a forward pass.

LoRA adapters (PEFT format) apply per row, so one forward pass serves several adapters and the
base (see backends/mlx/lora.py).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from mlx_lm.models.cache import BatchKVCache, KVCache, LRUPromptCache, make_prompt_cache, trim_prompt_cache
from transformers import AutoTokenizer

from backends import engine as contract
from backends.builtin_models import resolve_model_dir
from backends.engine import Engine
from backends.errors import WeightsError
from backends.grammar.constraint import LLGuidanceGrammars
from backends.mlx.lora import AdapterSet
from backends.placement import distinct_positions
from backends.rows import PackedRows
from backends.sampling import log_softmax, prompt_scores, sample_tokens
from backends.step_scheduler import StepScheduler, split_rows
from backends.types import (
    EngineConfig,
    EngineStatus,
    ModelInfo,
    PromptLogprobs,
    SamplingParams,
    TokenStep,
    resolve_auto_dtype,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
DENSE_ROWS = 256  # dense rows per forward pass, whose logits are [rows, longest row, vocab]


class _Stream:
    """A generation stream: its K/V per layer (empty until its prompt has run) and its adapter."""

    __slots__ = ("cache", "adapter")

    def __init__(self, adapter: str | None) -> None:
        self.cache: list[Any] = []
        self.adapter = adapter


Step = tuple[_Stream, list[int]]  # a stream and the tokens to run: its prompt, or its last token
DenseRow = tuple[bytes, np.ndarray, str | None]  # a dense call's row: its key, int32 ids, adapter


def _log_softmax(logits: mx.array) -> np.ndarray:
    # normalised in float64 on the host: MLX's float32 logsumexp over 49k entries is off by ~1e-4
    return log_softmax(np.array(logits.astype(mx.float32)))


def _checked_weights(model: Any, path: Path) -> list[tuple[str, mx.array]]:
    """The directory's safetensors weights under the model's parameter names (an adapted layer's
    own weights lie in its `base`), in the parameters' dtypes; WeightsError, before anything is
    loaded, if the directory holds another architecture or a tensor is missing or misshapen."""
    if not path.is_dir():
        raise WeightsError(f"{path} is not a directory")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{path} has no readable config.json: {exc}") from None
    if config.get("model_type") != getattr(model.args, "model_type", config.get("model_type")):
        raise WeightsError(
            f"{path} holds a {config.get('model_type')} model, this one is a {model.args.model_type}"
        )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path} has no .safetensors weights")
    loaded: dict[str, mx.array] = {}
    for file in files:
        loaded.update(mx.load(str(file)))
    if hasattr(model, "sanitize"):
        loaded = model.sanitize(loaded)
    pairs = []
    for name, current in tree_flatten(model.parameters()):
        plain = name.replace(".base.", ".")
        source = loaded.get(plain)
        if source is None:
            raise WeightsError(f"{path} has no tensor {plain!r}")
        if source.shape != current.shape:
            raise WeightsError(
                f"{path}: {plain!r} has shape {list(source.shape)}, this model's has {list(current.shape)}"
            )
        pairs.append((name, source.astype(current.dtype)))
    return pairs


class MlxAdapters(contract.Adapters):
    def __init__(self, engine: MlxEngine) -> None:
        self.engine = engine

    async def load(self, name: str, path: str) -> None:
        await self.engine._run(self.engine._adapters.load, name, path)

    async def unload(self, name: str) -> None:
        await self.engine._run(self.engine._adapters.unload, name)


class MlxWeights(contract.Weights):
    held_between_steps = True  # generation steps are computed when asked for

    def __init__(self, engine: MlxEngine) -> None:
        self.engine = engine

    async def load(self, path: str) -> None:
        await self.engine._run(self._load, path)

    def _load(self, path: str) -> None:
        engine = self.engine
        engine.model.load_weights(_checked_weights(engine.model, Path(path)), strict=True)
        mx.eval(engine.model.parameters())
        engine._head = engine._float32_head()
        engine._prompt_cache.trim_to(n_sequences=0)  # keys/values of the old weights
        engine.info = replace(engine.info, path=path)


class MlxPrefixCache(contract.PrefixCache):
    """The prompts' keys/values that generation reuses."""

    def __init__(self, engine: MlxEngine) -> None:
        self.engine = engine

    async def flush(self) -> None:
        await self.engine._run(lambda: self.engine._prompt_cache.trim_to(n_sequences=0))


class MlxEngine(Engine):
    structured_outputs: LLGuidanceGrammars

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        executor: ThreadPoolExecutor,
        *,
        max_model_len: int,
        model_path: str,
        dtype: str,
        prompt_cache_bytes: int = 256 * 2**20,
    ) -> None:
        self.model = model
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.info = ModelInfo(
            tokenizer=tokenizer,
            vocab_size=int(model.args.vocab_size),
            eos_token_ids=frozenset(eos),
            max_model_len=max_model_len,
            path=model_path,
            dtype=dtype,
        )
        self._executor = executor
        self._head = executor.submit(self._float32_head).result()
        self._adapters = AdapterSet(model)
        self._prompt_cache = LRUPromptCache(max_size=64, max_bytes=prompt_cache_bytes)
        self.prompt_tokens_computed = 0  # prompt tokens prefilled (not served from the prompt cache)
        self.steps: StepScheduler[Step | DenseRow, np.ndarray] = StepScheduler(
            lambda groups: self._run(self._step_pass, groups)
        )
        self.adapters = MlxAdapters(self)
        self.weights = MlxWeights(self)
        self.prefix_cache = MlxPrefixCache(self)
        self.structured_outputs = LLGuidanceGrammars(tokenizer, self.info.vocab_size, self.info.eos_token_ids)

    def _float32_head(self) -> mx.array | None:
        """The output projection in float32, for llama-family models run in a 16-bit dtype."""
        inner = getattr(self.model, "model", None)
        if self.info.dtype == "float32" or inner is None:
            return None
        if getattr(self.model.args, "tie_word_embeddings", False):
            weight = inner.embed_tokens.weight
        else:
            weight = self.model.lm_head.weight
        head = weight.astype(mx.float32)
        mx.eval(head)
        return head

    @classmethod
    def load(cls, config: EngineConfig) -> MlxEngine:
        path = resolve_model_dir(config.model)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-engine")
        model, dtype = executor.submit(cls._load_model, str(path), config.dtype).result()
        tokenizer = AutoTokenizer.from_pretrained(path)
        context = int(getattr(model.args, "max_position_embeddings", None) or 2048)
        return cls(
            model,
            tokenizer,
            executor,
            max_model_len=config.max_model_len or context,
            model_path=str(path),
            dtype=dtype,
            prompt_cache_bytes=int(config.options.get("prompt_cache_bytes", 256 * 2**20)),
        )

    @staticmethod
    def _load_model(path: str, dtype: str) -> tuple[Any, str]:
        device = mx.default_device()
        log.info("loading %s with mlx-lm on %s", path, device)
        model, _ = mlx_load(path)
        # set_dtype casts floating parameters only, so quantized (integer) weights stay packed.
        model.set_dtype(_DTYPES[resolve_auto_dtype(dtype, on_gpu=device.type == mx.gpu)])
        floating = (v for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
        return model, str(next(floating).dtype).removeprefix("mlx.core.")

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- dense rows -----------------------------------------------------------------------------

    async def next_token_logprobs(self, rows: PackedRows, adapters: Sequence[str | None]) -> np.ndarray:
        return await self.steps.submit(list(zip(rows.keys, rows.views(), adapters, strict=True)))

    def _dense_rows(self, items: Sequence[DenseRow]) -> np.ndarray:
        """log_softmax after each of the dense rows of a pass, each distinct row computed once
        (placement's rule, across the pass's calls)."""
        firsts, positions = distinct_positions([key for key, _, _ in items], [a for *_, a in items])
        self.steps.stats.rows += len(firsts)
        parts = []
        for start in range(0, len(firsts), DENSE_ROWS):
            chunk = [items[i] for i in firsts[start : start + DENSE_ROWS]]
            parts.append(self._next_token_logprobs([ids for _, ids, _ in chunk], [a for *_, a in chunk]))
        computed = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return computed if positions is None else computed[positions]

    def _next_token_logprobs(self, rows: Sequence[np.ndarray], adapters: Sequence[str | None]) -> np.ndarray:
        self._adapters.set_rows(adapters)
        width = max(len(r) for r in rows)
        padding = [width - len(r) for r in rows]
        padded = np.zeros((len(rows), width), dtype=np.int32)  # left-padded, from the int32 ids as they came
        for row, (pad, ids) in enumerate(zip(padding, rows, strict=True)):
            padded[row, pad:] = ids
        tokens = mx.array(padded)
        cache = [BatchKVCache(padding) for _ in self.model.layers]
        if self._head is None:
            return _log_softmax(self.model(tokens, cache=cache)[:, -1, :])
        hidden = self.model.model(tokens, cache=cache)[:, -1, :]
        return _log_softmax(hidden.astype(mx.float32) @ self._head.T)

    # -- prompt scoring -------------------------------------------------------------------------

    async def prompt_logprobs(
        self, ids: Sequence[int], top_k: int, adapter: str | None = None
    ) -> PromptLogprobs:
        return await self._run(self._prompt_logprobs, ids, top_k, adapter)

    def _prompt_logprobs(self, ids: Sequence[int], k: int, adapter: str | None) -> PromptLogprobs:
        self._adapters.set_rows([adapter])
        return prompt_scores(_log_softmax(self.model(mx.array([list(ids)]))[0, :-1]), ids, k)

    # -- generation -----------------------------------------------------------------------------

    async def generate(
        self, ids: Sequence[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[TokenStep]:
        stream = _Stream(adapter)

        async def next_logits(token: int | None) -> np.ndarray:
            return (await self.steps.submit([(stream, list(ids) if token is None else [token])]))[0]

        async for step in sample_tokens(
            params, self.info.eos_token_ids, next_logits, grammars=self.structured_outputs, prompt_ids=ids
        ):
            yield step

    def _step_pass(self, groups: list[Sequence[Step | DenseRow]]) -> list[np.ndarray]:
        """Log-probabilities after each dense row and logits after each step, a view per group:
        the dense rows together, prompts prefilled one by one, the streams' next tokens in one
        forward pass over their merged K/V (alone when a cache is not plain KVCache, e.g. a
        sliding window's)."""
        items = [item for group in groups for item in group]
        dense = [i for i, item in enumerate(items) if not isinstance(item[0], _Stream)]
        if len(dense) == len(items):  # dense calls alone: their rows as computed
            return split_rows(self._dense_rows(items), groups)  # type: ignore[arg-type]
        out = np.empty((len(items), self.info.vocab_size), dtype=np.float32)
        if dense:
            out[dense] = self._dense_rows([items[i] for i in dense])  # type: ignore[misc]
        steps: list[Step] = [item for item in items if isinstance(item[0], _Stream)]  # type: ignore[misc]
        at = [i for i, item in enumerate(items) if isinstance(item[0], _Stream)]
        self.steps.stats.rows += len(steps)
        decoding = []
        for i, (stream, ids) in zip(at, steps, strict=True):
            if not stream.cache:
                stream.cache, out[i] = self._prefill(ids, stream.adapter)
            elif len(steps) > 1 and all(type(layer) is KVCache for layer in stream.cache):
                decoding.append(i)
            else:
                out[i] = self._forward(stream.cache, ids, stream.adapter)
        if len(decoding) == 1:
            stream, ids = items[decoding[0]]  # type: ignore[misc]
            out[decoding[0]] = self._forward(stream.cache, ids, stream.adapter)
        elif decoding:
            streams: list[_Stream] = [items[i][0] for i in decoding]  # type: ignore[misc]
            batch = [
                BatchKVCache.merge([s.cache[layer] for s in streams])
                for layer in range(len(streams[0].cache))
            ]
            self._adapters.set_rows([s.adapter for s in streams])
            logits = self.model(mx.array([items[i][1] for i in decoding]), cache=batch)[:, -1]
            out[decoding] = np.array(logits.astype(mx.float32))
            for row, s in enumerate(streams):
                s.cache = [layer.extract(row) for layer in batch]
        return split_rows(out, groups)

    def _prefill(self, ids: list[int], adapter: str | None) -> tuple[list[Any], np.ndarray]:
        """Start from the cached KV state of the longest known prefix (of the same adapter), run
        only the rest, and remember this prompt's state for the requests that share it."""
        key = adapter or ""
        cache, rest = self._prompt_cache.fetch_nearest_cache(key, ids)
        if cache is None:
            cache, rest = make_prompt_cache(self.model), ids
        elif not rest:  # the whole prompt is cached, but its last logits are not: redo one token
            trim_prompt_cache(cache, 1)
            rest = ids[-1:]
        self.prompt_tokens_computed += len(rest)
        logits = self._forward(cache, list(rest), adapter)
        self._prompt_cache.insert_cache(key, ids, copy.deepcopy(cache))
        return cache, logits

    def _forward(self, cache: list[Any], new_ids: list[int], adapter: str | None) -> np.ndarray:
        self._adapters.set_rows([adapter])
        logits = self.model(mx.array([new_ids]), cache=cache)[0, -1]
        return np.array(logits.astype(mx.float32))

    def status(self) -> EngineStatus:
        return EngineStatus(pass_stats=replace(self.steps.stats))

    async def aclose(self) -> None:
        await self.steps.aclose()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.structured_outputs.close()
