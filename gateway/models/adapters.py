"""LoRA adapters loaded onto a served model and unloaded from it, checked first
(adapter_checks.py); on any failure the model is left as it was."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from backends.engine import Adapters, Engine
from backends.errors import AdapterError
from gateway.errors import InvalidRequestError, ModelNotFoundError, RateLimitError
from gateway.models.adapter_checks import adapter_fingerprint, check_adapter_dir, check_adapter_name
from gateway.models.served import AdapterInfo, ServedModel
from gateway.models.to_the_end import to_the_end
from gateway.models.weights_lock import ReadersOutlasted

log = logging.getLogger(__name__)


def _adapters(engine: Engine) -> Adapters:
    """An engine without adapters: the request's adapter cannot be loaded (400)."""
    if engine.adapters is None:
        raise InvalidRequestError(
            f"the {type(engine).__name__} backend does not support adapters", param="lora_path"
        )
    return engine.adapters


async def add_adapter(
    served: ServedModel, name: str, path: Path, confined_to: str | None = None, configured: bool = False
) -> AdapterInfo:
    """Validate and load a LoRA adapter; on any failure the model is left as it was. Loads at
    run time are `confined_to` the adapters root: every file of the adapter must resolve inside.
    `configured`: the name is the operator's (the config file), so the log line names it."""
    check_adapter_name(name)
    engine = served.require_engine()
    async with served.adapter_lock:
        if name in served.adapters:
            raise InvalidRequestError(
                f"adapter {name!r} is already loaded on {served.name!r}", param="lora_name"
            )
        await asyncio.to_thread(check_adapter_dir, path, served.settings.max_lora_rank, confined_to)
        fingerprint = await asyncio.to_thread(adapter_fingerprint, path)
        try:
            await _adapters(engine).load(name, str(path))
        except AdapterError as exc:
            raise InvalidRequestError(str(exc), param="lora_path") from None
        info = AdapterInfo(name, str(path), fingerprint)
        served.adapters[name] = info
    if configured:
        log.info("model %r: adapter %r loaded (%d served)", served.name, name, len(served.adapters))
    else:  # names, paths and versions a caller chose: never in a log line
        log.info("model %r: an adapter loaded at run time (%d served)", served.name, len(served.adapters))
    return info


async def remove_adapter(served: ServedModel, name: str, wait_s: float) -> None:
    """Unload an adapter once the requests that use it have finished, waiting `wait_s` at most
    (RateLimitError then, the adapter still served); requests that name it meanwhile get a 404.
    It runs to its end whatever happens to the request that asked for it."""
    await to_the_end(_remove_adapter(served, name, wait_s))
    log.info("model %r: an adapter unloaded (%d served)", served.name, len(served.adapters))


async def _remove_adapter(served: ServedModel, name: str, wait_s: float) -> None:
    engine = served.require_engine()
    async with served.adapter_lock:
        info = served.adapters.pop(name, None)  # new requests stop seeing it before the weights go
        if info is None:
            raise ModelNotFoundError(served.no_adapter_message(name), param="lora_name")
        try:
            await served.weights.until_unread(name, wait_s)
        except ReadersOutlasted as exc:
            served.adapters[name] = info
            raise RateLimitError(
                f"{exc.running} requests still use the adapter after {exc.wait_s:g} s "
                "(limits.weights_update_wait_s); it is still loaded. Retry once they end",
                retry_after=exc.wait_s,
            ) from None
        await _adapters(engine).unload(name)
