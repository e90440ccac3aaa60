"""A served model's state: its engine, what the routes read off its tokenizer, the identity of
its weights (the output cache's scope), its adapters, and the lock its weights' readers hold.

What changes that state is beside it: loading.py (the engine), adapters.py, weights_update.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from backends.engine import Engine
from gateway.errors import ModelNotFoundError, ModelNotReadyError
from gateway.metrics import Metrics
from gateway.models.weights_lock import WeightsLock
from gateway.openai.tool_formats import ToolFormat
from gateway.settings import ModelSettings


@dataclass
class AdapterInfo:
    name: str
    path: str
    fingerprint: str
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class ServedModel:
    settings: ModelSettings
    engine: Engine | None = None
    token_bytes: list[bytes] = field(default_factory=list)
    special_ids: frozenset[int] = frozenset()  # tokens that add no text to completions
    tokenizer_files: dict[str, str] = field(default_factory=dict)
    # how its tool calls are written: its settings' format, else its chat template's; None: no calls
    tool_format: ToolFormat | None = None
    fingerprint: str = ""  # identity of the weights, for cache keys
    weights: WeightsLock = field(default_factory=WeightsLock, repr=False)  # held by whoever reads them
    weight_version: str = "default"  # what the last weights update called its weights
    weight_updates: int = 0
    cache_epoch: int = 0  # raised by a cache flush: the output cache's earlier rows are not read
    metrics: Metrics = field(default_factory=Metrics, repr=False)
    adapters: dict[str, AdapterInfo] = field(default_factory=dict)
    loaded: bool = False  # the engine and the configured adapters are all in place
    adapter_lock: asyncio.Lock = field(
        default_factory=asyncio.Lock, repr=False
    )  # one load or unload at a time
    error: str | None = None
    # the load failed for the configuration's sake (composed engines that do not match): the
    # serving process exits with status 2, as for a configuration refused before loading
    misconfigured: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def name(self) -> str:
        return self.settings.served_name

    @property
    def cache_scope(self) -> str:
        """The model's part of output-cache keys: its weights, and how often its cache was flushed."""
        return self.fingerprint if not self.cache_epoch else f"{self.fingerprint}/flush-{self.cache_epoch}"

    @property
    def ready(self) -> bool:
        return self.loaded and self.engine is not None

    def require_engine(self) -> Engine:
        if self.engine is None:
            reason = f"failed to load: {self.error}" if self.error else "is still loading"
            raise ModelNotReadyError(f"model {self.name!r} {reason}")
        return self.engine

    @asynccontextmanager
    async def reading(self, adapter: str | None = None) -> AsyncIterator[None]:
        """The model's weights, and `adapter`'s, read until the block ends (see WeightsLock);
        ModelNotFoundError where the adapter was unloaded since the request named it."""
        async with self.weights.reading(adapter):
            if adapter is not None and adapter not in self.adapters:
                raise ModelNotFoundError(self.no_adapter_message(adapter), param="model")
            yield

    def no_adapter_message(self, adapter: str) -> str:
        available = ", ".join(f"{self.name}:{a}" for a in self.adapters) or "none"
        return f"model {self.name!r} has no adapter {adapter!r}; available adapters: {available}"
