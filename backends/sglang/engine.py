"""SGLang engine: one SGLang request per row or prompt, submitted concurrently so they share
SGLang's continuous batching and radix (prefix) cache. LoRA adapters travel per request
(`lora_path` holds the adapter's name), never as a global switch. New weights, from disk or a
trainer's collective, go through SGLang's own calls (backends/sglang/weights.py).

Modes (`EngineConfig.options["mode"]`), one request format (GenerateReqInput field names):
- "engine" (default): `sglang.Engine` in this process; CUDA only.
- "server": a managed `python -m sglang.launch_server` child on a free port (`launch_args`: extra
  CLI options; `server_command`: another command taking the same options; `startup_timeout_s`;
  `log_path`).
- "url": an external server at `url`; start it with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (see below).
  The `dtype` setting is not sent there: it states what that server computes in.
Other options: `request_timeout_s`, `max_connections`, `vocab_size`, and in "engine" mode any
`ServerArgs` field (e.g. `mem_fraction_static`).

Dense rows: one request per row with max_new_tokens = 1 and the custom logit processor of
backends/sglang/processor.py, which SGLang runs in its scheduler on the batch's logits and which
hands each request its whole log_softmax row (raw float32 in process, base64 over HTTP). The "engine"
and "server" modes start SGLang with `enable_custom_logit_processor`; a "url" server is asked that
way only with the option `dense_rows = "processor"` (it must have the flag and be able to import
this package). Otherwise a row is asked the slow way: `top_logprobs_num = vocab_size` sorts the whole
distribution, `return_flat_raw_top_logprobs_b64` ships it as arrays, and since those fields exist
only for prompt positions, the row is sent with one placeholder token appended and scored from its
last token. Either way a row needs one position past it, so the engine's context length is one
token shorter than SGLang's.

Grammars (`SamplingParams.grammar`) go to SGLang's own structured-output machinery as its
`regex`, `json_schema` or `ebnf` (Lark too, which its llguidance backend reads there). The
"engine" and "server" modes start SGLang with the llguidance grammar backend (unless told another),
the library the gateway checks grammars with, and JSON without free whitespace (as
backends/grammar/constraint.py), so what the check accepts SGLang enforces alike; a
"url" server enforces with whatever backend it was started with.

Sampled-token logprobs: SGLang reports them after temperature unless SGLANG_RETURN_ORIGINAL_LOGPROB
is set, which the "engine" and "server" modes do. Even then they include penalties and
logit_bias (SGLang applies those to the logits before its sampler).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import math
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoTokenizer

from backends import engine as contract
from backends.builtin_models import resolve_model_dir
from backends.engine import Engine
from backends.errors import AdapterError, EngineUnavailableError, RequestRejectedError
from backends.grammar.constraint import LLGuidanceGrammars, ascii_digits
from backends.rows import PackedRows
from backends.sglang import launch
from backends.sglang.processor import PROCESSOR
from backends.sglang.transport import HttpTransport, Transport
from backends.sglang.weights import SglangWeights
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

_PLACEHOLDER = 0  # the token appended to dense rows; its own logprob is never read


class ScatterError(RuntimeError):
    """SGLang's dense row was not one float per token id (sorted: not every id exactly once)."""


def _model_facts(path: Path) -> tuple[int, int | None, frozenset[int]]:
    """(vocab size, context length, eos ids) from the model directory's own config files."""
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    eos: set[int] = set()
    for source in (path / "generation_config.json", path / "config.json"):
        value = json.loads(source.read_text()).get("eos_token_id") if source.exists() else None
        eos.update([value] if isinstance(value, int) else value or [])
    return int(text["vocab_size"]), text.get("max_position_embeddings"), frozenset(eos)


def _top_rows(meta: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Prompt-side top logprobs as float32 values and int64 ids [rows, k], covered rows only.

    Reads the `return_flat_raw_top_logprobs_b64` arrays; a server that ignored those fields (an
    older SGLang) or fell back from them sends nested [logprob, id, text] triples instead.
    """
    if "input_top_logprobs_val_flat_b64" in meta:
        rows, k = meta["input_top_logprobs_shape"]
        values = np.frombuffer(base64.b64decode(meta["input_top_logprobs_val_flat_b64"]), dtype="<f4")
        ids = np.frombuffer(base64.b64decode(meta["input_top_logprobs_idx_flat_b64"]), dtype="<i4")
        return values.reshape(rows, k), ids.reshape(rows, k).astype(np.int64)
    nested = [row for row in meta["input_top_logprobs"] if row]
    k = len(nested[0]) if nested else 0
    values = np.array([[t[0] for t in row] for row in nested], dtype=np.float32).reshape(-1, k)
    ids = np.array([[t[1] for t in row] for row in nested], dtype=np.int64).reshape(-1, k)
    return values, ids


def scatter_row(values: np.ndarray, ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """A sorted (value, id) distribution back in token-id order; every id must occur exactly once."""
    if ids.shape != (vocab_size,) or ids.min() < 0 or ids.max() >= vocab_size:
        raise ScatterError(f"expected {vocab_size} token ids in [0, {vocab_size}), got {ids.shape[0]}")
    if np.bincount(ids, minlength=vocab_size).max() != 1:
        raise ScatterError("SGLang's distribution names some token id more than once")
    row = np.empty(vocab_size, dtype=np.float32)
    row[ids] = values
    return row


def _finish(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    if not reason:
        return None
    return "length" if reason.get("type") == "length" else "stop"


class SglangAdapters(contract.Adapters):
    def __init__(self, engine: SglangEngine) -> None:
        self.engine = engine

    async def load(self, name: str, path: str) -> None:
        await self.engine.transport.load_lora(name, path)
        self.engine._adapters.add(name)

    async def unload(self, name: str) -> None:
        self.engine._lora(name)
        await self.engine.transport.unload_lora(name)
        self.engine._adapters.discard(name)


class SglangEngine(Engine):
    def __init__(
        self,
        transport: Transport,
        tokenizer: Any,
        *,
        model_path: Path,
        dtype: str,
        max_model_len: int | None,
        vocab_size: int | None = None,
        dense_rows: str = "sorted",
        tp_size: int = 1,
    ) -> None:
        self.transport = transport
        self.dense_rows = dense_rows  # "raw" or "b64" through the processor, or "sorted"
        own_vocab, context, eos = _model_facts(model_path)
        eos_id = getattr(tokenizer, "eos_token_id", None)
        self.info = ModelInfo(
            tokenizer=tokenizer,
            vocab_size=int(vocab_size or own_vocab),
            eos_token_ids=eos | ({eos_id} if eos_id is not None else set()),
            max_model_len=int(max_model_len or context or 2048) - 1,  # room for the placeholder
            path=str(model_path),
            dtype=dtype,
        )
        self._adapters: set[str] = set()
        self.adapters = SglangAdapters(self)
        self.weights = SglangWeights(self, tp_size)
        self.structured_outputs = LLGuidanceGrammars(tokenizer, self.info.vocab_size, self.info.eos_token_ids)

    @classmethod
    def load(cls, config: EngineConfig) -> SglangEngine:
        path = resolve_model_dir(config.model)
        # SGLang runs on CUDA only; the resolved dtype is passed explicitly, never SGLang's own auto.
        config = dataclasses.replace(config, dtype=resolve_auto_dtype(config.dtype, on_gpu=True))
        options = dict(config.options)
        vocab_size = options.pop("vocab_size", None)
        mode = options.pop("mode", "url" if "url" in options else "engine")
        dense_rows = {"engine": "raw", "server": "b64"}.get(mode, "sorted")
        if options.pop("dense_rows", "sorted") == "processor" and mode == "url":
            dense_rows = "b64"
        tokenizer = AutoTokenizer.from_pretrained(path)
        tp_size = launch.tp_size(mode, options)
        http = {
            "timeout_s": float(options.pop("request_timeout_s", 600.0)),
            "max_connections": int(options.pop("max_connections", 256)),
        }
        if mode == "url":
            transport: Transport = HttpTransport(options.pop("url"), **http)
        elif mode == "server":
            transport = launch.launch_server(config, path, options, http)
        elif mode == "engine":
            transport = launch.start_in_process(config, path, options)
        else:
            raise EngineUnavailableError(f"sglang mode {mode!r}: choose engine, server or url")
        return cls(
            transport,
            tokenizer,
            model_path=path,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            vocab_size=vocab_size,
            dense_rows=dense_rows,
            tp_size=tp_size,
        )

    def _lora(self, adapter: str | None) -> str | None:
        if adapter is not None and adapter not in self._adapters:
            raise AdapterError(f"adapter {adapter!r} is not loaded")
        return adapter

    # -- dense rows -----------------------------------------------------------------------------

    def dense_request(self, row: Sequence[int], adapter: str | None) -> dict[str, Any]:
        if not row:
            raise RequestRejectedError("a dense row needs at least one token")
        if self.dense_rows == "sorted":
            return self.sorted_request(row, adapter)
        return self.processor_request(row, adapter)

    def processor_request(self, row: Sequence[int], adapter: str | None) -> dict[str, Any]:
        return {
            "input_ids": list(row),
            # The processor runs in the sampler, so one token is sampled (greedy: the cheapest).
            "sampling_params": {
                "max_new_tokens": 1,
                "temperature": 0.0,
                "custom_params": {"b64": self.dense_rows != "raw"},
            },
            "custom_logit_processor": PROCESSOR,
            "lora_path": self._lora(adapter),
        }

    def sorted_request(self, row: Sequence[int], adapter: str | None) -> dict[str, Any]:
        return {
            "input_ids": [*row, _PLACEHOLDER],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": len(row) - 1,  # entries: [None for row[-1], dist after row]
            "top_logprobs_num": self.info.vocab_size,
            "return_flat_raw_top_logprobs": True,
            "return_flat_raw_top_logprobs_b64": True,
            "lora_path": self._lora(adapter),
        }

    async def _dense_row(self, row: Sequence[int], adapter: str | None) -> np.ndarray:
        meta = (await self.transport.generate(self.dense_request(row, adapter)))["meta_info"]
        if self.dense_rows == "sorted":
            values, ids = _top_rows(meta)
            return scatter_row(values[-1], ids[-1], self.info.vocab_size)
        payload = meta["dense"][0]
        data = base64.b64decode(payload) if isinstance(payload, str) else payload
        if len(data) != 4 * self.info.vocab_size:
            raise ScatterError(
                f"expected {self.info.vocab_size} floats in SGLang's row, got {len(data) / 4:g}"
            )
        return np.frombuffer(data, dtype="<f4")

    async def next_token_logprobs(self, rows: PackedRows, adapters: Sequence[str | None]) -> np.ndarray:
        if not len(rows):
            return np.zeros((0, self.info.vocab_size), np.float32)
        lists = rows.lists()
        done = await asyncio.gather(
            *(self._dense_row(row, a) for row, a in zip(lists, adapters, strict=True))
        )
        return np.stack(done)

    # -- prompt scoring -------------------------------------------------------------------------

    def prompt_request(self, ids: Sequence[int], top_k: int, adapter: str | None) -> dict[str, Any]:
        return {
            "input_ids": list(ids),
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": top_k,
            "return_flat_raw_top_logprobs": top_k > 0,
            "return_flat_raw_top_logprobs_b64": top_k > 0,
            "lora_path": self._lora(adapter),
        }

    async def prompt_logprobs(
        self, ids: Sequence[int], top_k: int, adapter: str | None = None
    ) -> PromptLogprobs:
        meta = (await self.transport.generate(self.prompt_request(ids, top_k, adapter)))["meta_info"]
        # input_token_logprobs: [logprob, token id, text] per prompt token; the first has no logprob.
        chosen = np.array([entry[0] for entry in meta["input_token_logprobs"][1:]], dtype=np.float32)
        n = len(ids) - 1
        if top_k == 0:
            return PromptLogprobs(chosen, np.zeros((n, 0), np.int64), np.zeros((n, 0), np.float32))
        values, top_ids = _top_rows(meta)
        return PromptLogprobs(chosen, top_ids[len(top_ids) - n :], values[len(values) - n :])

    # -- generation -----------------------------------------------------------------------------

    def generate_request(self, ids: Sequence[int], params: SamplingParams, adapter: str | None) -> dict:
        """SGLang's /generate request for a stream; RequestRejectedError for a control SGLang's
        sampler lacks."""
        for field, asked in (
            ("bad_words", params.bad_words),
            ("allowed_token_ids", params.allowed_token_ids),
        ):
            if asked:
                raise RequestRejectedError(f"{field} is not supported by the sglang engine", param=field)
        sampling = {
            "max_new_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty,
            "logit_bias": {str(t): float(b) for t, b in params.logit_bias.items()} or None,
            "sampling_seed": params.seed,
            "top_k": params.top_k or -1,
            "min_p": params.min_p,
            "repetition_penalty": params.repetition_penalty,
            "min_new_tokens": params.min_tokens,
            "ignore_eos": params.ignore_eos,
            "stop_token_ids": sorted(params.ending_tokens(self.info.eos_token_ids)),
            # Its scheduler then sends this request's tokens to our process once per interval,
            # as it does for its own non-streamed requests, instead of one wake-up per token.
            "stream_interval": params.stream_interval,
        }
        grammar = params.grammar
        if grammar is not None:
            if grammar.kind == "regex":
                sampling["regex"] = ascii_digits(grammar.source)
            else:
                sampling["json_schema" if grammar.kind == "json_schema" else "ebnf"] = grammar.source
        return {
            "input_ids": list(ids),
            "sampling_params": sampling,
            "return_logprob": params.logprobs,  # computing them costs SGLang's every step
            "top_logprobs_num": params.top_logprobs if params.logprobs else 0,
            "lora_path": self._lora(adapter),
        }

    async def generate(
        self, ids: Sequence[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[TokenStep]:
        if params.max_tokens == 0:
            return
        stream = self.transport.stream(self.generate_request(ids, params, adapter))
        emitted = 0
        try:
            async for out in stream:
                meta = out["meta_info"]
                # Chunks hold all tokens so far, or only new ones with --incremental-streaming-output;
                # the cumulative completion_tokens says which of the listed tokens are new either way.
                new = int(meta["completion_tokens"]) - emitted
                if not new:
                    continue
                if params.logprobs:
                    tokens = meta["output_token_logprobs"][-new:]
                else:
                    tokens = [(math.nan, token, None) for token in out["output_ids"][-new:]]
                tops = (meta.get("output_top_logprobs") or [None] * new)[-new:]
                for j, ((logprob, token, _), top) in enumerate(zip(tokens, tops, strict=True)):
                    top = top or []
                    yield TokenStep(
                        token_id=int(token),
                        logprob=float(logprob),
                        top_ids=np.array([t[1] for t in top], dtype=np.int64),
                        top_logprobs=np.array([t[0] for t in top], dtype=np.float32),
                        finish_reason=_finish(meta) if j == new - 1 else None,
                    )
                emitted += new
        finally:
            await stream.aclose()

    def status(self) -> EngineStatus:
        return EngineStatus(healthy=self.transport.is_healthy())

    async def aclose(self) -> None:
        await self.transport.aclose()
        self.structured_outputs.close()
