"""Served models by name: loading them in the background and resolving request model names."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.engine import Adapters, Collective, Engine, Weights
from backends.errors import AdapterError, WeightsError, WeightsGroupError
from backends.registry import engine_class
from backends.types import AnnouncedTensor, WeightsGroup
from backends.vocab import token_bytes_table
from gateway.errors import (
    GatewayError,
    InvalidRequestError,
    ModelNotFoundError,
    ModelNotReadyError,
    NotSupportedError,
)
from gateway.metrics import Metrics
from gateway.settings import ModelSettings
from gateway.weights.adapters import adapter_fingerprint, check_adapter_dir, check_adapter_name
from gateway.weights.lock import WeightsLock, weight_files_stat

log = logging.getLogger(__name__)


def _tokenizer_files(tokenizer: object) -> dict[str, str]:
    """The files from which a client rebuilds the exact tokenizer (tokenizer.json, config, template)."""
    with tempfile.TemporaryDirectory() as directory:
        tokenizer.save_pretrained(directory)  # type: ignore[attr-defined]
        return {p.name: p.read_text() for p in sorted(Path(directory).iterdir()) if p.is_file()}


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Named special tokens and every added token marked special (SmolLM2 has 17, only 3 named)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(tokenizer.all_special_ids) | {
        int(i) for i, t in added.items() if getattr(t, "special", False)
    }


def weights_fingerprint(model_dir: str | Path, *extra: str) -> str:
    """Identity of a model's weights without reading them: config.json and every safetensors
    header (tensor names, dtypes, shapes, offsets), plus `extra` (backend, dtype, ...)."""
    digest = hashlib.sha256()
    for part in extra:
        digest.update(part.encode() + b"\0")
    root = Path(model_dir)
    for name in ("config.json", "model.safetensors.index.json"):
        if (root / name).is_file():
            digest.update(name.encode() + b"\0" + (root / name).read_bytes())
    for weights in sorted(root.glob("*.safetensors")):
        with weights.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            digest.update(weights.name.encode() + b"\0" + f.read(min(size, 100_000_000)))
    return digest.hexdigest()


def parse_model_name(name: str) -> tuple[str, str | None]:
    """`base:adapter` -> ("base", "adapter"); a name without ':' is the base model."""
    base, sep, adapter = name.partition(":")
    return base, (adapter if sep else None)


def _weights_error(exc: WeightsError, param: str) -> GatewayError:
    """New weights that do not fit (nothing changed): 400."""
    return InvalidRequestError(str(exc), param="group_name" if isinstance(exc, WeightsGroupError) else param)


@contextmanager
def _weights_errors(param: str) -> Iterator[None]:
    try:
        yield
    except WeightsError as exc:
        raise _weights_error(exc, param) from None


def _adapters(engine: Engine) -> Adapters:
    """An engine without adapters: the request's adapter cannot be loaded (400)."""
    if engine.adapters is None:
        raise InvalidRequestError(
            f"the {type(engine).__name__} backend does not support adapters", param="lora_path"
        )
    return engine.adapters


def _weights(engine: Engine) -> Weights:
    """An engine that cannot take new weights: 501."""
    if engine.weights is None:
        raise NotSupportedError(f"the {type(engine).__name__} cannot load new weights without a restart")
    return engine.weights


def _collective(engine: Engine) -> Collective:
    collective = None if engine.weights is None else engine.weights.collective
    if collective is None:
        raise NotSupportedError(f"the {type(engine).__name__} cannot receive weights over a collective")
    return collective


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
    fingerprint: str = ""  # identity of the weights, for cache keys
    weights: WeightsLock = field(default_factory=WeightsLock, repr=False)  # held by whoever reads them
    weight_version: str = "default"  # what the last weights update called its weights
    weight_updates: int = 0
    cache_epoch: int = 0  # raised by a cache flush: the output cache's earlier rows are not read
    metrics: Metrics = field(default_factory=Metrics, repr=False)
    adapters: dict[str, AdapterInfo] = field(default_factory=dict)
    loaded: bool = False  # the engine and the configured adapters are all in place
    _adapter_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    error: str | None = None
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

    async def add_adapter(
        self, name: str, path: Path, confined_to: str | None = None, configured: bool = False
    ) -> AdapterInfo:
        """Validate and load a LoRA adapter; on any failure the model is left as it was. Loads at
        run time are `confined_to` the adapters root: every file of the adapter must resolve inside.
        `configured`: the name is the operator's (the config file), so the log line names it."""
        check_adapter_name(name)
        engine = self.require_engine()
        async with self._adapter_lock:
            if name in self.adapters:
                raise InvalidRequestError(
                    f"adapter {name!r} is already loaded on {self.name!r}", param="lora_name"
                )
            await asyncio.to_thread(check_adapter_dir, path, self.settings.max_lora_rank, confined_to)
            fingerprint = await asyncio.to_thread(adapter_fingerprint, path)
            try:
                await _adapters(engine).load(name, str(path))
            except AdapterError as exc:
                raise InvalidRequestError(str(exc), param="lora_path") from None
            info = AdapterInfo(name, str(path), fingerprint)
            self.adapters[name] = info
        if configured:
            log.info("model %r: adapter %r loaded (%d served)", self.name, name, len(self.adapters))
        else:  # names, paths and versions a caller chose: never in a log line
            log.info("model %r: an adapter loaded at run time (%d served)", self.name, len(self.adapters))
        return info

    async def remove_adapter(self, name: str) -> None:
        engine = self.require_engine()
        async with self._adapter_lock:
            if name not in self.adapters:
                raise ModelNotFoundError(self._no_adapter_message(name), param="lora_name")
            del self.adapters[name]  # new requests stop seeing it before the weights go
            await _adapters(engine).unload(name)
        log.info("model %r: an adapter unloaded (%d served)", self.name, len(self.adapters))

    async def update_weights(self, path: Path, version: str | None = None) -> None:
        """New weights of the same architecture from the directory `path`, once the requests
        reading the old ones have finished; the fingerprint (every output-cache key) changes with
        them. Weights that do not fit change nothing (400); an engine that cannot, 501."""
        engine = self.require_engine()
        weights = _weights(engine)

        def fingerprint() -> str:
            try:
                extra = (self.settings.backend, engine.info.dtype, str(engine.info.vocab_size))
                return weights_fingerprint(path, *extra, *weight_files_stat(path))
            except OSError:  # the files changed since they were loaded: a key no other replica shares
                return hashlib.sha256(f"{self.fingerprint}:disk:{uuid.uuid4().hex}".encode()).hexdigest()

        await self._replace_weights(
            lambda: weights.load(str(path)), fingerprint, version, "model_path", "disk"
        )
        log.info("model %r: new weights loaded from a directory", self.name)

    async def join_weights_group(self, group: WeightsGroup) -> None:
        """The engine joins a trainer's collective, which new weights then come over."""
        collective = _collective(self.require_engine())
        with _weights_errors("group_name"):
            await collective.join(group)

    async def leave_weights_group(self, name: str) -> None:
        collective = _collective(self.require_engine())
        with _weights_errors("group_name"):
            await collective.leave(name)

    async def update_weights_from_group(
        self, group: str, tensors: Sequence[AnnouncedTensor], version: str | None = None
    ) -> None:
        """New weights broadcast by a trainer over the collective `group` (the engine has joined
        it), loaded as `update_weights` loads them. Their fingerprint is new and this replica's
        own: nothing says another replica received the same numbers."""
        collective = _collective(self.require_engine())

        def fingerprint() -> str:
            return hashlib.sha256(f"{self.fingerprint}:received:{uuid.uuid4().hex}".encode()).hexdigest()

        await self._replace_weights(
            lambda: collective.receive(group, tensors),
            fingerprint,
            version,
            "names",
            "distributed",
        )
        log.info("model %r: new weights received over a collective", self.name)

    async def _replace_weights(
        self,
        load: Callable[[], Awaitable[None]],
        fingerprint: Callable[[], str],
        version: str | None,
        param: str,
        source: str,
    ) -> None:
        """`load` new weights into the engine once no request reads the old ones, then change the
        fingerprint and the version. WeightsError: nothing changed (400, `param` named); an engine
        that cannot, 501; any other failure may have left weights half written, so rows computed
        from then on match no earlier key (an unreadable file, OSError, is then a 400)."""
        async with self.weights.writing():
            try:
                await load()
            except WeightsError as exc:
                raise _weights_error(exc, param) from None
            except BaseException as exc:
                self.fingerprint = f"{self.fingerprint}:update-failed-{self.weight_updates + 1}"
                self.weight_updates += 1
                if isinstance(exc, OSError):  # unreadable files: the caller's to fix
                    reason = exc.strerror or type(exc).__name__
                    raise InvalidRequestError(
                        f"the new weights cannot be read: {reason}", param=param
                    ) from None
                raise
            self.fingerprint = await asyncio.to_thread(fingerprint)
            self.weight_updates += 1
            self.weight_version = version or str(self.weight_updates)
            self.metrics.weight_updates.labels(self.name, source).inc()

    def _no_adapter_message(self, adapter: str) -> str:
        available = ", ".join(f"{self.name}:{a}" for a in self.adapters) or "none"
        return f"model {self.name!r} has no adapter {adapter!r}; available adapters: {available}"


class ModelRegistry:
    def __init__(self, models: list[ModelSettings], metrics: Metrics | None = None) -> None:
        self.metrics = metrics or Metrics()
        self.models = {m.served_name: ServedModel(m, metrics=self.metrics) for m in models}

    async def load_all(self) -> None:
        """Load every model, one after another (they share the machine); failures are recorded."""
        for served in self.models.values():
            await self._load(served)

    async def _load(self, served: ServedModel) -> None:
        started = time.perf_counter()
        log.info(
            "loading model %r (%s, backend %s)", served.name, served.settings.model, served.settings.backend
        )
        try:
            cls = engine_class(served.settings.backend)
            engine = await asyncio.to_thread(cls.load, served.settings.engine_config())
            served.token_bytes = await asyncio.to_thread(
                token_bytes_table, engine.info.tokenizer, engine.info.vocab_size
            )
            served.special_ids = special_token_ids(engine.info.tokenizer) | engine.info.eos_token_ids
            served.tokenizer_files = await asyncio.to_thread(_tokenizer_files, engine.info.tokenizer)
            served.fingerprint = await asyncio.to_thread(
                weights_fingerprint,
                engine.info.path,
                served.settings.backend,
                engine.info.dtype,
                str(engine.info.vocab_size),
            )
            served.engine = engine
            served.weights.hold_at_steps = engine.weights is not None and engine.weights.held_between_steps
            for name, path in served.settings.adapters.items():
                await served.add_adapter(name, Path(path), configured=True)
            served.loaded = True
        except Exception as exc:  # a model that cannot load must not take the others down
            served.engine = None
            served.error = f"{type(exc).__name__}: {exc}"
            log.error("model %r failed to load: %s", served.name, served.error)
            return
        elapsed = time.perf_counter() - started
        self.metrics.model_load_duration.labels(served.name).set(elapsed)
        log.info(
            "model %r ready in %.1f s (vocab %d, context %d)",
            served.name,
            elapsed,
            engine.info.vocab_size,
            engine.info.max_model_len,
        )

    def resolve(self, name: str) -> tuple[ServedModel, str | None]:
        """The served base model and the adapter (None: the base) that a request's `model` names."""
        base, adapter = parse_model_name(name)
        served = self.models.get(base)
        if served is None:
            raise ModelNotFoundError(
                f"model {name!r} does not exist; available: {', '.join(self.models)}", param="model"
            )
        if adapter is not None and adapter not in served.adapters:
            raise ModelNotFoundError(served._no_adapter_message(adapter), param="model")
        return served, adapter

    @property
    def healthy(self) -> bool:
        return all(m.ready and m.engine is not None and m.engine.is_healthy() for m in self.models.values())

    async def aclose(self) -> None:
        for served in self.models.values():
            if served.engine is not None:
                await served.engine.aclose()
                served.engine = None
