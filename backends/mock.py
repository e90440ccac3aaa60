"""A deterministic engine with a real tokenizer, for gateway-layer tests, fuzzing and benchmarks.

Its distribution after a prefix is one fixed pseudo-random distribution rotated by a hash of the
prefix: reproducible, consistent across endpoints, different for every prefix, and cheap enough
that benchmarks on it measure the gateway rather than the mock. It proves nothing about a model:
features are proven on real engines.

Options: `vocab_size` (default: the tokenizer's size), `tokenizer` (a directory whose tokenizer is
used instead of the model's, as vLLM's option of that name), `max_model_len` via the config;
`host_memory` (true: offers the capability as a GPU engine does, registration recorded, not made);
for fault tests: `delay_s` (time each engine step takes), `fail_token` (a request containing this token id
fails with an engine error) and `fatal_token` (the same, and the engine is dead from then on).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerFast

from backends import engine as engine_contract
from backends.builtin_models import resolve_model_dir
from backends.engine import Engine
from backends.errors import AdapterError, WeightsError, WeightsGroupError
from backends.grammar.constraint import LLGuidanceGrammars
from backends.placement import copy_rows_into
from backends.rows import PackedRows
from backends.sampling import log_softmax, prompt_scores, sample_tokens
from backends.types import (
    AnnouncedTensor,
    EngineConfig,
    EngineStatus,
    ModelInfo,
    PromptLogprobs,
    SamplingParams,
    TokenStep,
    WeightsGroup,
)


def _base_row(seed: int, vocab_size: int) -> np.ndarray:
    """Every row is this one rolled: the mock's weights."""
    return log_softmax(np.random.default_rng(seed).standard_normal(vocab_size, dtype=np.float32) * 3.0)


class MockHostMemory(engine_contract.HostMemory):
    """Offered as a GPU engine offers it: registrations are recorded (`calls`), not made."""

    def __init__(self, engine: MockEngine) -> None:
        self.engine = engine
        self.vocab_size = engine.info.vocab_size
        self.calls: list[tuple[str, int]] = []
        self._landing: dict[int, tuple[np.ndarray, np.ndarray, Sequence[int] | None]] = {}

    def register(self, address: int, size: int) -> bool:
        self.calls.append(("register", address))
        return True

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address))

    def empty(self, rows: int) -> np.ndarray:
        return np.empty((rows, self.vocab_size), np.float32)

    async def write_rows(
        self,
        rows: PackedRows,
        adapters: Sequence[str | None],
        arrays: Sequence[np.ndarray],
        positions: Sequence[int] | None,
    ) -> None:
        """The rows land in each array once waited for, as a device's copy may land after the call."""
        self.engine.writes.append(len(arrays))
        computed = await self.engine.next_token_logprobs(rows, adapters)
        for array in arrays:
            self._landing[array.ctypes.data] = (array, computed, positions)

    def wait_landed(self, array: np.ndarray) -> None:
        self.calls.append(("wait_landed", array.ctypes.data))
        landing = self._landing.pop(array.ctypes.data, None)
        if landing is not None:
            into, computed, positions = landing
            copy_rows_into(computed, positions, [into])


class MockAdapters(engine_contract.Adapters):
    """The mock's "adapter" only changes the hash of its rows."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}

    async def load(self, name: str, path: str) -> None:
        self.loaded[name] = path

    async def unload(self, name: str) -> None:
        if self.loaded.pop(name, None) is None:
            raise AdapterError(f"adapter {name!r} is not loaded")


class MockCollective(engine_contract.Collective):
    """The mock joins no collective: it records the groups' names, and their updates."""

    def __init__(self, engine: MockEngine) -> None:
        self.engine = engine
        self.groups: dict[str, int] = {}

    async def join(self, group: WeightsGroup) -> None:
        if group.name in self.groups:
            raise WeightsGroupError(f"a weights update group named {group.name!r} exists already")
        await asyncio.sleep(self.engine.delay_s)
        self.groups[group.name] = 0

    async def receive(self, group_name: str, tensors: Sequence[AnnouncedTensor]) -> None:
        """New "weights" drawn from the announcement and the group's count of updates: no tensor
        crosses a network, and each update changes the rows."""
        if group_name not in self.groups:
            raise WeightsGroupError(f"no weights update group named {group_name!r}")
        self.groups[group_name] += 1
        digest = hashlib.sha256(repr((group_name, self.groups[group_name], tensors)).encode()).digest()
        await asyncio.sleep(self.engine.delay_s)
        self.engine._base = _base_row(int.from_bytes(digest[:8], "little"), self.engine.info.vocab_size)

    async def leave(self, group_name: str) -> None:
        if self.groups.pop(group_name, None) is None:
            raise WeightsGroupError(f"no weights update group named {group_name!r}")


class MockWeights(engine_contract.Weights):
    held_between_steps = True  # generation steps are computed when asked for

    def __init__(self, engine: MockEngine) -> None:
        self.engine = engine
        self.collective = MockCollective(engine)

    async def load(self, path: str) -> None:
        """The mock's "weights" are its base row: new ones drawn from the directory's files, so
        rows change with what the directory holds."""
        directory = Path(path)
        if not (directory / "config.json").is_file():
            raise WeightsError(f"{path} has no config.json")
        digest = hashlib.sha256()
        for file in sorted(directory.iterdir()):
            if file.is_file():
                digest.update(file.name.encode() + b"\0" + file.read_bytes())
        # On a thread, as the real engines load: a caller cancelled meanwhile does not stop it.
        await asyncio.to_thread(self._swap, int.from_bytes(digest.digest()[:8], "little"), path)

    def _swap(self, seed: int, path: str) -> None:
        time.sleep(self.engine.delay_s)
        self.engine._base = _base_row(seed, self.engine.info.vocab_size)
        self.engine.info = replace(self.engine.info, path=str(path))


class MockEngine(Engine):
    adapters: MockAdapters
    weights: MockWeights
    structured_outputs: LLGuidanceGrammars

    def __init__(
        self,
        tokenizer: object,
        *,
        vocab_size: int,
        max_model_len: int,
        model_path: str,
        options: dict | None = None,
    ) -> None:
        eos = getattr(tokenizer, "eos_token_id", None)
        self.info = ModelInfo(
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            eos_token_ids=frozenset([eos] if eos is not None else []),
            max_model_len=max_model_len,
            path=model_path,
            dtype="float32",
        )
        self.adapters = MockAdapters()
        self.weights = MockWeights(self)
        self.calls = 0  # engine invocations, for tests of batching
        self.rows_computed = 0  # distinct dense rows computed
        self.writes: list[int] = []  # arrays of `out` of each call given one, for tests
        options = options or {}
        self.delay_s = float(options.get("delay_s", 0.0))
        self.fail_token = options.get("fail_token")
        self.fatal_token = options.get("fatal_token")
        self.dead = False
        self.host_memory = MockHostMemory(self) if options.get("host_memory") else None
        self._base = _base_row(0, vocab_size)
        self.structured_outputs = LLGuidanceGrammars(tokenizer, self.info.vocab_size, self.info.eos_token_ids)

    @classmethod
    def load(cls, config: EngineConfig) -> MockEngine:
        path = resolve_model_dir(config.model)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(config.options.get("tokenizer", path))
        vocab_size = int(config.options.get("vocab_size", len(tokenizer)))
        return cls(
            tokenizer,
            vocab_size=vocab_size,
            max_model_len=config.max_model_len or 2048,
            model_path=str(path),
            options=dict(config.options),
        )

    def logits(self, prefix: np.ndarray | Sequence[int], adapter: str | None = None) -> np.ndarray:
        """Already normalised: these logits are also the log-probabilities."""
        if adapter is not None and adapter not in self.adapters.loaded:
            raise AdapterError(f"adapter {adapter!r} is not loaded")
        if self.dead:
            raise RuntimeError("the engine is dead")
        if self.fatal_token is not None and self.fatal_token in prefix:
            self.dead = True
            raise RuntimeError("injected fatal engine failure")
        if self.fail_token is not None and self.fail_token in prefix:
            raise RuntimeError("injected engine failure")
        digest = hashlib.blake2b(
            np.asarray(prefix, dtype=np.int64).tobytes(), digest_size=8, person=(adapter or "").encode()[:16]
        ).digest()
        return np.roll(self._base, int.from_bytes(digest, "little") % self.info.vocab_size)

    async def next_token_logprobs(self, rows: PackedRows, adapters: Sequence[str | None]) -> np.ndarray:
        self.calls += 1
        self.rows_computed += len(rows)
        await asyncio.sleep(self.delay_s)
        if not len(rows):
            return np.zeros((0, self.info.vocab_size), np.float32)
        return np.stack([self.logits(row, a) for row, a in zip(rows.views(), adapters, strict=True)])

    def status(self) -> EngineStatus:
        return EngineStatus(healthy=not self.dead)

    async def prompt_logprobs(
        self, ids: Sequence[int], top_k: int, adapter: str | None = None
    ) -> PromptLogprobs:
        self.calls += 1
        rows = np.zeros((0, self.info.vocab_size), np.float32)
        if len(ids) > 1:
            rows = np.stack([self.logits(ids[:i], adapter) for i in range(1, len(ids))])
        return prompt_scores(rows, ids, top_k)

    async def generate(
        self, ids: Sequence[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[TokenStep]:
        prefix = list(ids)

        async def next_logits(token: int | None) -> np.ndarray:
            if token is None:
                self.calls += 1
            else:
                prefix.append(token)
            await asyncio.sleep(self.delay_s)
            return self.logits(prefix, adapter)

        async for step in sample_tokens(
            params, self.info.eos_token_ids, next_logits, grammars=self.structured_outputs, prompt_ids=ids
        ):
            yield step
