"""Hugging Face transformers engine: CPU by default, CUDA when available.

All model calls run on one worker thread per engine, so concurrent requests interleave at
forward-pass granularity without blocking the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from backends.base import AdapterError, Engine, EngineConfig, PromptLogprobs, SamplingParams, TokenStep
from backends.builtin_models import resolve_model_dir
from backends.sampling import sample_tokens

log = logging.getLogger(__name__)
T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PROMPT_CHUNK = 512  # positions whose full-vocabulary log_softmax is held at once


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":  # exact float32 on CPU; bfloat16 where it is fast
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be auto or one of {', '.join(_DTYPES)}, got {dtype!r}") from None


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
    def __init__(self, model: Any, tokenizer: Any, *, max_model_len: int, model_path: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.max_model_len = max_model_len
        self.model_path = model_path
        self.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="transformers-engine")
        self._peft: Any = None  # the PeftModel wrapping `model` once an adapter is loaded

    @classmethod
    def load(cls, config: EngineConfig) -> TransformersEngine:
        path = resolve_model_dir(config.model)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        log.info("loading %s with transformers on %s in %s", path, device, dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        context = getattr(model.config, "max_position_embeddings", None) or 2048
        return cls(model, tokenizer, max_model_len=config.max_model_len or context, model_path=str(path))

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _call(self, adapters: Sequence[str | None], **kwargs: Any) -> Any:
        """A forward pass where row i uses adapter i: PEFT's mixed-adapter batches, never a global switch."""
        if self._peft is None:
            if any(adapters):
                raise AdapterError(f"no adapter is loaded (asked for {sorted(set(filter(None, adapters)))})")
            return self.model(**kwargs)
        return self._peft(**kwargs, adapter_names=[a or BASE for a in adapters])

    # -- adapters (loaded and unloaded on the worker thread, so never during a forward pass) ----

    async def load_adapter(self, name: str, path: str) -> None:
        await self._run(self._load_adapter, name, path)

    def _load_adapter(self, name: str, path: str) -> None:
        from peft import PeftModel

        try:
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(
                    self.model, path, adapter_name=name, is_trainable=False
                )
                self._peft.eval()
            else:
                self._peft.load_adapter(path, adapter_name=name, is_trainable=False)
        except Exception as exc:  # shape mismatches, missing modules, unreadable files
            if self._peft is not None and name in self._peft.peft_config:
                self._peft.delete_adapter(name)
            raise AdapterError(
                f"adapter {name!r} does not fit this model: {type(exc).__name__}: {exc}"
            ) from exc

    async def unload_adapter(self, name: str) -> None:
        await self._run(self._unload_adapter, name)

    def _unload_adapter(self, name: str) -> None:
        if self._peft is None or name not in self._peft.peft_config:
            raise AdapterError(f"adapter {name!r} is not loaded")
        if len(self._peft.peft_config) == 1:  # the last one: back to the plain model
            self.model = self._peft.unload()
            self._peft = None
        else:
            self._peft.delete_adapter(name)

    # -- dense rows -----------------------------------------------------------------------------

    async def next_token_logprobs(
        self, rows: Sequence[Sequence[int]], adapters: Sequence[str | None] | None = None
    ) -> np.ndarray:
        return await self._run(self._next_token_logprobs, rows, adapters or [None] * len(rows))

    @torch.inference_mode()
    def _next_token_logprobs(
        self, rows: Sequence[Sequence[int]], adapters: Sequence[str | None]
    ) -> np.ndarray:
        # Left padding keeps every row's last token in the final position; explicit position ids
        # and the attention mask make each row's result equal to its unpadded forward pass.
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self._call(
            adapters,
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            use_cache=False,
            logits_to_keep=1,
        )
        return torch.log_softmax(out.logits[:, -1, :].float(), dim=-1).cpu().numpy()

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
        state = _DecodeState()

        async def next_logits(token: int | None) -> np.ndarray:
            return await self._run(self._forward, state, list(ids) if token is None else [token], adapter)

        async for step in sample_tokens(params, self.eos_token_ids, next_logits):
            yield step

    @torch.inference_mode()
    def _forward(self, state: _DecodeState, new_ids: list[int], adapter: str | None) -> np.ndarray:
        tokens = torch.tensor([new_ids], dtype=torch.long, device=self.device)
        out = self._call(
            [adapter], input_ids=tokens, past_key_values=state.cache, use_cache=True, logits_to_keep=1
        )
        state.cache = out.past_key_values
        return out.logits[0, -1].float().cpu().numpy()

    async def aclose(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
