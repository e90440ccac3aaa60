"""One served model made of two engines loaded from the same weights: a generation engine (vLLM,
SGLang, ...) and a dense engine (transformers, ...), to the gateway one Engine.

    next_token_logprobs, prompt_logprobs, host_memory   the dense engine
    generate, structured_outputs                        the generation engine
    adapters, weights, prefix_cache                     both (capabilities.py)
    status                                              both: healthy while both are and hold
                                                        the same weights; the dense engine's passes

So every score (dense rows, prompt scores) comes from the dense engine and every generated token
from the generation engine. The two must mean the same by every token id: `load` refuses engines
whose tokenizers or vocabulary sizes differ (EngineMismatchError). `info` is the dense engine's,
with the generation engine's end-of-sequence ids (where its streams stop) and the shorter of the
two context lengths.

Its config (backends/registry.py, `composed_config`) names the two backends; the model's `options`
go to the generation engine, with the defaults its backend takes in a composed model where they
leave them unset, `dense_options` to the dense one; every other field to both. On one GPU, the
generation engine's memory share leaves room for the dense engine unless the options set it
(memory.py). What differs by backend its registry entry tells: nothing here asks for one by name.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import numpy as np

from backends.composed.capabilities import (
    ComposedAdapters,
    ComposedHostMemory,
    ComposedPrefixCache,
    ComposedWeights,
)
from backends.composed.memory import dense_gpu, fitted_options
from backends.composed.vocabulary import vocabulary_difference
from backends.engine import Engine
from backends.errors import EngineMismatchError, EngineUnavailableError
from backends.registry import (
    DENSE,
    DENSE_OPTIONS,
    GENERATION,
    GENERATION_OPTIONS,
    engine_class,
    generation_defaults,
)
from backends.rows import PackedRows
from backends.types import EngineConfig, EngineStatus, ModelInfo, PromptLogprobs, SamplingParams, TokenStep


def _close(engine: Engine) -> None:
    """Close an engine from a worker thread (loading runs in one), where no event loop runs."""
    asyncio.run(engine.aclose())


async def _nothing() -> AsyncIterator[TokenStep]:
    return
    yield  # an async generator that yields nothing


class ComposedEngine(Engine):
    def __init__(self, generation: Engine, dense: Engine) -> None:
        difference = vocabulary_difference(generation.info, dense.info)
        if difference is not None:
            raise EngineMismatchError(
                f"the generation and dense engines cannot serve one model: {difference}"
            )
        self.generation = generation
        self.dense = dense
        self.info = self.composed_info()
        # Why the two engines may hold different weights (a failed update that could not be
        # undone), while they do: the model serves nothing until new weights load into both.
        self.unusable: str | None = None
        if generation.adapters is not None and dense.adapters is not None:
            self.adapters = ComposedAdapters(generation.adapters, dense.adapters)
        if generation.weights is not None and dense.weights is not None:
            self.weights = ComposedWeights(self)
        caches = [c for c in (dense.prefix_cache, generation.prefix_cache) if c is not None]
        self.prefix_cache = ComposedPrefixCache(caches) if caches else None
        if dense.host_memory is not None:
            self.host_memory = ComposedHostMemory(self, dense.host_memory)
        self.structured_outputs = generation.structured_outputs

    def composed_info(self) -> ModelInfo:
        """The dense engine's facts (its rows' width, dtype and weights' path), with the
        generation engine's end-of-sequence ids and the shorter context."""
        ours, theirs = self.dense.info, self.generation.info
        return replace(
            ours,
            eos_token_ids=theirs.eos_token_ids,
            max_model_len=min(ours.max_model_len, theirs.max_model_len),
        )

    @classmethod
    def load(cls, config: EngineConfig) -> ComposedEngine:
        """The dense engine, then the generation engine, each with its own options (the second's
        with its backend's `generation_defaults` and, on a GPU, a memory share that leaves room for
        the dense engine, where the options leave them unset); both closed again if the second
        fails to load or the two do not match."""
        options = config.options
        shared = replace(config, options={})
        dense_config = replace(shared, options=options.get(DENSE_OPTIONS, {}))
        dense = engine_class(options[DENSE]).load(dense_config)
        try:
            generation_options = {
                **generation_defaults(options[GENERATION]),
                **options.get(GENERATION_OPTIONS, {}),
            }
            on_gpu = dense_gpu(options[DENSE], dense_config)
            if on_gpu is not None:  # room for the dense engine's cache (backends/composed/memory.py)
                generation_options = fitted_options(options[GENERATION], generation_options, *on_gpu)
            generation = engine_class(options[GENERATION]).load(replace(shared, options=generation_options))
        except BaseException:
            _close(dense)
            raise
        try:
            return cls(generation, dense)
        except BaseException:
            _close(generation)
            _close(dense)
            raise

    def _check_usable(self) -> None:
        if self.unusable is not None:
            raise EngineUnavailableError(self.unusable)

    async def next_token_logprobs(self, rows: PackedRows, adapters: Sequence[str | None]) -> np.ndarray:
        self._check_usable()
        return await self.dense.next_token_logprobs(rows, adapters)

    async def prompt_logprobs(
        self, ids: Sequence[int], top_k: int, adapter: str | None = None
    ) -> PromptLogprobs:
        self._check_usable()
        return await self.dense.prompt_logprobs(ids, top_k, adapter)

    def generate(
        self, ids: Sequence[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[TokenStep]:
        self._check_usable()
        if params.max_tokens <= 0:  # scoring only (echo, max_tokens 0): nothing to generate
            return _nothing()
        return self.generation.generate(ids, params, adapter)

    def status(self) -> EngineStatus:
        generation, dense = self.generation.status(), self.dense.status()
        healthy = self.unusable is None and generation.healthy and dense.healthy
        return EngineStatus(healthy=healthy, pass_stats=dense.pass_stats, prefill_tokens=dense.prefill_tokens)

    async def aclose(self) -> None:
        try:
            await self.generation.aclose()
        finally:
            await self.dense.aclose()
