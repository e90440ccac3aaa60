"""A served model loaded: its engine, its chat template and tool-call format, what the routes read
off its tokenizer (token bytes, special tokens, the tokenizer's files), the fingerprint of its
weights, its configured adapters."""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from backends.errors import EngineMismatchError
from backends.registry import engine_class
from backends.vocab import token_bytes_table
from gateway.metrics import Metrics
from gateway.models.adapters import add_adapter
from gateway.models.chat_template import chat_template_text, served_tool_format
from gateway.models.fingerprint import weights_fingerprint
from gateway.models.served import ServedModel
from gateway.settings import ConfigError

log = logging.getLogger(__name__)


def tokenizer_files(tokenizer: object) -> dict[str, str]:
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


async def load_model(served: ServedModel, metrics: Metrics) -> None:
    """Load the model's engine and its configured adapters; a failure is recorded on the model
    (`served.error`), never raised."""
    started = time.perf_counter()
    settings = served.settings
    log.info("loading model %r (%s, backend %s)", served.name, settings.model, settings.engines)
    try:
        cls = engine_class(settings.backend, settings.dense_backend)
        template = await asyncio.to_thread(chat_template_text, settings)
        engine = await asyncio.to_thread(cls.load, settings.engine_config())
        if template is not None:  # on the tokenizer: every reader of its template sees this one
            engine.info.tokenizer.chat_template = template
        served.tool_format = served_tool_format(
            settings, getattr(engine.info.tokenizer, "chat_template", None)
        )
        served.token_bytes = await asyncio.to_thread(
            token_bytes_table, engine.info.tokenizer, engine.info.vocab_size
        )
        served.special_ids = special_token_ids(engine.info.tokenizer) | engine.info.eos_token_ids
        served.tokenizer_files = await asyncio.to_thread(tokenizer_files, engine.info.tokenizer)
        served.fingerprint = await asyncio.to_thread(
            weights_fingerprint,
            engine.info.path,
            settings.engines,
            engine.info.dtype,
            str(engine.info.vocab_size),
        )
        served.engine = engine
        served.weights.hold_at_steps = engine.weights is not None and engine.weights.held_between_steps
        for name, path in settings.adapters.items():
            await add_adapter(served, name, Path(path), configured=True)
        served.loaded = True
    except Exception as exc:  # a model that cannot load must not take the others down
        served.engine = None
        served.error = f"{type(exc).__name__}: {exc}"
        served.misconfigured = isinstance(exc, EngineMismatchError | ConfigError)
        log.error("model %r failed to load: %s", served.name, served.error)
        return
    elapsed = time.perf_counter() - started
    metrics.model_load_duration.labels(served.name).set(elapsed)
    log.info(
        "model %r ready in %.1f s (vocab %d, context %d)",
        served.name,
        elapsed,
        engine.info.vocab_size,
        engine.info.max_model_len,
    )
