"""A deterministic engine with a real tokenizer, for gateway-layer tests, fuzzing and benchmarks.

Its distribution after a prefix is one fixed pseudo-random distribution rotated by a hash of the
prefix: reproducible, consistent across endpoints, different for every prefix, and cheap enough
that benchmarks on it measure the gateway rather than the mock. It proves nothing about a model:
features are proven on real engines.

Options: `vocab_size` (default: the tokenizer's size), `max_model_len` via the config;
`host_writes` (true: offers the capability as a GPU engine does, registration recorded, not made);
for fault tests: `delay_s` (time each engine step takes), `fail_token` (a request containing this token id
fails with an engine error) and `fatal_token` (the same, and the engine is dead from then on).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from backends import base
from backends.base import AdapterError, Engine, EngineConfig, PromptLogprobs, SamplingParams, TokenStep
from backends.builtin_models import resolve_model_dir
from backends.sampling import log_softmax, prompt_scores, sample_tokens


def _base_row(seed: int, vocab_size: int) -> np.ndarray:
    """Every row is this one rolled: the mock's weights."""
    return log_softmax(np.random.default_rng(seed).standard_normal(vocab_size, dtype=np.float32) * 3.0)


class MockHostWrites(base.HostWrites):
    """Writes rows into the caller's memory itself, as a GPU engine does; registrations are
    recorded (`calls`), and so is each write's `keep`."""

    def __init__(self, engine: MockEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[str, int]] = []
        self.keeps: list[bool] = []

    def register(self, address: int, size: int) -> bool:
        self.calls.append(("register", address))
        return True

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address))

    async def write_rows(
        self,
        rows: Sequence[Sequence[int]],
        adapters: Sequence[str | None],
        into: np.ndarray,
        keep: bool,
        positions: Sequence[int] | None = None,
    ) -> base.WrittenRows:
        out = await self.engine.next_token_logprobs(rows, adapters)
        into[...] = out if positions is None else out[list(positions)]
        self.keeps.append(keep)
        return base.WrittenRows(out if keep else into, base.already_landed)


class MockEngine(Engine):
    steps_on_demand = True  # generation steps are computed when asked for

    def __init__(
        self,
        tokenizer: object,
        *,
        vocab_size: int,
        max_model_len: int,
        model_path: str,
        options: dict | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = frozenset([eos] if eos is not None else [])
        self.max_model_len = max_model_len
        self.model_path = model_path
        self.dtype = "float32"
        self.adapters: dict[str, str] = {}
        self.groups: dict[str, int] = {}  # weights update groups "joined", and their updates
        self.calls = 0  # engine invocations, for tests of batching
        options = options or {}
        self.delay_s = float(options.get("delay_s", 0.0))
        self.fail_token = options.get("fail_token")
        self.fatal_token = options.get("fatal_token")
        self.dead = False
        self.host_writes = MockHostWrites(self) if options.get("host_writes") else None
        self._base = _base_row(0, vocab_size)

    @classmethod
    def load(cls, config: EngineConfig) -> MockEngine:
        path = resolve_model_dir(config.model)
        tokenizer = AutoTokenizer.from_pretrained(path)
        vocab_size = int(config.options.get("vocab_size", len(tokenizer)))
        return cls(
            tokenizer,
            vocab_size=vocab_size,
            max_model_len=config.max_model_len or 2048,
            model_path=str(path),
            options=dict(config.options),
        )

    def logits(self, prefix: Sequence[int], adapter: str | None = None) -> np.ndarray:
        """Already normalised: these logits are also the log-probabilities."""
        if adapter is not None and adapter not in self.adapters:
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
        return np.roll(self._base, int.from_bytes(digest, "little") % self.vocab_size)

    async def next_token_logprobs(
        self, rows: Sequence[Sequence[int]], adapters: Sequence[str | None] | None = None
    ) -> np.ndarray:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        adapters = adapters or [None] * len(rows)
        return np.stack([self.logits(row, a) for row, a in zip(rows, adapters, strict=True)])

    def is_healthy(self) -> bool:
        return not self.dead

    async def update_weights(self, path: str) -> None:
        """The mock's "weights" are its base row: new ones drawn from the directory's files, so
        rows change with what the directory holds."""
        directory = Path(path)
        if not (directory / "config.json").is_file():
            raise base.WeightsError(f"{path} has no config.json")
        digest = hashlib.sha256()
        for file in sorted(directory.iterdir()):
            if file.is_file():
                digest.update(file.name.encode() + b"\0" + file.read_bytes())
        await asyncio.sleep(self.delay_s)
        self._base = _base_row(int.from_bytes(digest.digest()[:8], "little"), self.vocab_size)
        self.model_path = str(path)

    async def join_weights_group(self, group: base.WeightsGroup) -> None:
        """The mock joins no collective: it records the group's name."""
        if group.name in self.groups:
            raise base.WeightsGroupError(f"a weights update group named {group.name!r} exists already")
        await asyncio.sleep(self.delay_s)
        self.groups[group.name] = 0

    async def update_weights_from_group(self, group: str, tensors: Sequence[base.AnnouncedTensor]) -> None:
        """New "weights" drawn from the announcement and the group's count of updates: no tensor
        crosses a network, and each update changes the rows."""
        if group not in self.groups:
            raise base.WeightsGroupError(f"no weights update group named {group!r}")
        self.groups[group] += 1
        digest = hashlib.sha256(repr((group, self.groups[group], tensors)).encode()).digest()
        await asyncio.sleep(self.delay_s)
        self._base = _base_row(int.from_bytes(digest[:8], "little"), self.vocab_size)

    async def leave_weights_group(self, group: str) -> None:
        if self.groups.pop(group, None) is None:
            raise base.WeightsGroupError(f"no weights update group named {group!r}")

    async def load_adapter(self, name: str, path: str) -> None:
        self.adapters[name] = path  # the mock's "adapter" only changes the hash of its rows

    async def unload_adapter(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise AdapterError(f"adapter {name!r} is not loaded")

    async def prompt_logprobs(
        self, ids: Sequence[int], top_k: int, adapter: str | None = None
    ) -> PromptLogprobs:
        self.calls += 1
        rows = np.zeros((0, self.vocab_size), np.float32)
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

        async for step in sample_tokens(params, self.eos_token_ids, next_logits):
            yield step
