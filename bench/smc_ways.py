"""The ways bench/smc.py serves its rows: each a factory of `NextRows` calls."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import torch

from backends.engine import Engine
from backends.placement import place_rows
from backends.rows import PackedRows
from backends.transformers.host_copy import rows_to_host
from backends.types import EngineConfig
from bench.checks import GIB, gpu_free
from bench.launcher import GatewayProcess, start_gateway
from logprob_gateway_client import AsyncGatewayLM

NextRows = Callable[[list[list[int]]], Awaitable[np.ndarray]]  # rows -> float32 [rows, vocab]
# SGLang with what scripts/stage.sh leaves out kept off; each engine takes a fraction of the GPU's
# memory that leaves room for the bench's own transformers model and a second engine beside it
# (composed models too: their default share would leave room for their own dense engine only).
SGLANG_ARGS = {
    "attention_backend": "triton",
    "sampling_backend": "pytorch",
    "grammar_backend": "none",
    "mem_fraction_static": 0.3,
}
VLLM_ARGS = {"gpu_memory_utilization": 0.25}
ENGINE_ARGS = {"sglang": {"mode": "engine", **SGLANG_ARGS}, "vllm": VLLM_ARGS}


def engine_rows(engine: Engine) -> NextRows:
    async def next_rows(rows: list[list[int]]) -> np.ndarray:
        index: dict[tuple[int, ...], int] = {}  # identical rows once, as AsyncGatewayLM asks for them
        for row in rows:
            index.setdefault(tuple(row), len(index))
        out = (await place_rows(engine, PackedRows.of(list(index)))).logprobs
        if len(index) == len(rows):  # no particle repeats: the engine's matrix as it is
            return out
        return out[[index[tuple(r)] for r in rows]]

    return next_rows


def batch_rows(lm: object) -> NextRows:
    """One batch call per step (genlm's AsyncLM.batch_next_token_logprobs)."""

    async def next_rows(rows: list[list[int]]) -> np.ndarray:
        return await lm.batch_next_token_logprobs(rows)  # type: ignore[attr-defined]

    return next_rows


def particle_rows(lm: object) -> NextRows:
    """Concurrent per-particle calls, as genlm's samplers make them; the client batches them."""

    async def next_rows(rows: list[list[int]]) -> np.ndarray:
        out = await asyncio.gather(*(lm.next_token_logprobs(r) for r in rows))  # type: ignore[attr-defined]
        return torch.stack(out)

    return next_rows


class _Decode:
    """A decode in this process, the bench's reference: rows must all extend the previous step's
    rows (a resampling repeats or drops some)."""

    def __init__(self, model: object) -> None:
        self.model = model
        self.device = next(model.parameters()).device  # type: ignore[attr-defined]
        self.previous: dict[tuple[int, ...], int] = {}  # the last step's rows, by position

    async def __call__(self, rows: list[list[int]]) -> np.ndarray:
        with torch.inference_mode():
            logits = self._step(rows)
        self.previous = {tuple(r): i for i, r in enumerate(rows)}
        return rows_to_host(torch.log_softmax(logits.float(), dim=-1))  # as the engine copies them

    def parents(self, rows: list[list[int]]) -> list[int]:
        return [self.previous[tuple(r[:-1])] for r in rows]

    def restart(self) -> None:
        """The next call is a new run's prompt."""
        self.previous = {}

    def _step(self, rows: list[list[int]]) -> torch.Tensor:
        raise NotImplementedError


class PlainDecode(_Decode):
    """One DynamicCache for all particles: prefill the prompt once, then one token per row per
    step; resampling reorders the cache rows."""

    def __init__(self, model: object) -> None:
        super().__init__(model)
        self.cache = None

    def _step(self, rows: list[list[int]]) -> torch.Tensor:
        if not self.previous:
            out = self.model(torch.tensor([rows[0]], device=self.device), use_cache=True, logits_to_keep=1)  # type: ignore[operator]
            out.past_key_values.batch_repeat_interleave(len(rows))
            logits = out.logits[:, -1].expand(len(rows), -1)
        else:
            parents = self.parents(rows)
            if parents != list(range(len(self.previous))):
                self.cache.batch_select_indices(torch.tensor(parents, device=self.device))
            ids = torch.tensor([[r[-1]] for r in rows], device=self.device)
            out = self.model(ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)  # type: ignore[operator]
            logits = out.logits[:, -1]
        self.cache = out.past_key_values
        return logits


class StaticDecode(_Decode):
    """transformers' own static-shape decode: one `StaticCache` of `slots` rows, the one-token
    step compiled by torch.compile with CUDA graphs ("reduce-overhead"). The reference a dense
    step is held to: the same rows, but no scheduling, no prefix lookups and a fixed batch (fewer
    rows fill the rest with a copy). Rows are all of one length."""

    def __init__(self, model: object, slots: int, max_len: int) -> None:
        from transformers import StaticCache

        super().__init__(model)
        self.slots = slots
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)  # type: ignore[attr-defined]
        self.step_forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)  # type: ignore[attr-defined]

    def _step(self, rows: list[list[int]]) -> torch.Tensor:
        pad = self.slots - len(rows)
        if not self.previous:  # the prompt, prefilled eagerly into every slot
            self.cache.reset()
            ids = torch.tensor([rows[0]] * self.slots, device=self.device)
            out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)  # type: ignore[operator]
        else:
            parents = self.parents(rows) + [0] * pad
            if parents != list(range(self.slots)):
                index = torch.tensor(parents, device=self.device)
                for layer in self.cache.layers:
                    layer.keys.copy_(layer.keys[index])
                    layer.values.copy_(layer.values[index])
            ids = torch.tensor([[r[-1]] for r in rows] + [[0]] * pad, device=self.device)
            out = self.step_forward(
                input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1
            )
        return out.logits[: len(rows), -1]


def start_bench_gateway(
    mode: str,
    model_dir: Path,
    args: argparse.Namespace,
    tmp: Path,
    stack: contextlib.ExitStack | contextlib.AsyncExitStack,
    cache_bytes: int | None = None,
    backend: str | None = None,
    module: str = "gateway.cli",
) -> GatewayProcess:
    """A gateway process serving `model_dir` as "smc" for `mode` (its output cache off for
    gateway-nocache, else of `cache_bytes` when given) on `backend` (default: the mode's, else
    transformers; gateway-composed-G: G generating, transformers computing the rows), its command
    line run from `module`, stopped with `stack`."""
    toml = tmp / f"{mode}.toml"
    cache = (
        "enabled = false" if mode == "gateway-nocache" else cache_bytes and f"memory_bytes = {cache_bytes}"
    )
    options = ", ".join(f"{key} = {value}" for key, value in args.engine_option)
    engine = mode.removeprefix("gateway-")
    dense = ""
    if engine.startswith("composed-"):  # the transformers engine's options go to the dense engine
        engine = engine.removeprefix("composed-")
        dense = f'dense_backend = "transformers"\ndense_options = {{{options}}}\n'
    if engine in ENGINE_ARGS:
        backend = engine
        options = ", ".join(f"{key} = {json.dumps(value)}" for key, value in ENGINE_ARGS[engine].items())
    toml.write_text(
        f'[[models]]\nname = "smc"\nmodel = "{model_dir}"\ndtype = "{args.dtype}"\ndevice = "{args.device}"\n'
        + (f'backend = "{backend}"\n' if backend else "")
        + dense
        + f"options = {{{options}}}\n"
        + (f"[cache]\n{cache}\n" if cache else "")
    )
    gateway = start_gateway(["--config", str(toml), *args.gateway_arg], tmp / f"{mode}.log", module=module)
    stack.callback(gateway.stop)
    return gateway


def server_timing(lm: AsyncGatewayLM) -> dict[str, float]:
    """The last answer's Server-Timing, ms by part (parse, rows, encode); empty when none."""
    parts = (p.strip().split(";dur=") for p in (lm.server_timing or "").split(",") if p)
    return {name: float(ms) for name, ms in parts}


async def gateway_way(
    mode: str, model_dir: Path, args: argparse.Namespace, tmp: Path, stack: contextlib.AsyncExitStack
) -> tuple[Callable[[int, int], NextRows], dict[int, list[tuple[float, float]]]]:
    """A gateway process for `mode`, and its rows per (P, repeat); the second value collects the
    server's (rows ms, encode ms) per request size from Server-Timing."""
    before = gpu_free(args.device)
    gateway = start_bench_gateway(mode, model_dir, args, tmp, stack)
    if before is not None:
        after = gpu_free(args.device)
        print(f"{mode}: {(before - after) / GIB:.1f} GiB of GPU memory at start, {after / GIB:.1f} left")
    # One client for every run, as a user keeps one: its connection and shared memory segments
    # are set up in the warm-up run, as the engine's memory is. Each run has its own prompt, so
    # no row of its cache is asked again.
    lm = AsyncGatewayLM(
        gateway.base_url,
        "smc",
        shared_memory=False if mode == "gateway-socket" else None,
        local_socket=mode != "gateway-http",
    )
    stack.push_async_callback(lm.aclose)
    timings: dict[int, list[tuple[float, float]]] = {}
    calls = particle_rows if mode == "gateway-particles" else batch_rows

    def make(p: int, r: int) -> NextRows:
        inner = calls(lm)

        async def next_rows(rows: list[list[int]]) -> np.ndarray:
            out = await inner(rows)
            parts = server_timing(lm)
            if parts:
                timings.setdefault(len(rows), []).append((parts["rows"], parts["encode"]))
            return out

        return next_rows

    return make, timings


async def backend_way(
    backend: str, model_dir: Path, args: argparse.Namespace, stack: contextlib.AsyncExitStack
) -> Callable[[int, int], NextRows]:
    """Our `backend` engine (sglang or vllm) in this process: each distinct row one request of that
    engine, all of a step's submitted at once, so that it batches them and shares their prefixes."""
    from backends.registry import engine_class

    config = EngineConfig(model=str(model_dir), dtype=args.dtype, options=ENGINE_ARGS[backend])
    engine = await asyncio.to_thread(engine_class(backend).load, config)
    stack.push_async_callback(engine.aclose)
    return lambda p, r: engine_rows(engine)
